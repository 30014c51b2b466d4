"""Stage 6 of the pipeline: the sync-state dataflow of one training loop.

The analysis runs over a function's control flow as its syntax gives it (``if`` joins its branches,
a loop goes round to a fixpoint, ``break`` / ``continue`` / ``return`` leave through their edges, a
``with`` pushes and pops its sync controls), from one *root*: a function (or a script's top level)
whose loop reaches a backward pass. The state at each point is a map from properties (state.py) to
guards (guards.py); properties join by OR-ing their guards, so the cost is linear in the code and
not in its paths. A call into a project function is analysed in place with the caller's state and
arguments (a context-sensitive summary, memoized on that input), so a trainer whose loop calls
``self._run_batch()`` and ``self._optimizer_step()`` is one loop to the analysis.

What happens to gradients is written down as *records* (facts.py): each backward's token and how
it was resolved, each optimizer step's reach, each forward's sync decision. Rules read those.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project import events
from synccheck.analyzer.project.conditions import Conditions
from synccheck.analyzer.project.facts import Records
from synccheck.analyzer.project.guards import MASKS, TRUE, Atoms, exists
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.state import EnvVal, Prop
from synccheck.analyzer.project.values import ONE_UNKNOWN, Const
from synccheck.analyzer.parse import dotted as _dotted

MAX_LOOP_ROUNDS = 6
MAX_DEPTH = 8
MAX_WORK = 60_000          # statements executed per root, inlined calls included
UNKNOWN_VAL = EnvVal(((TRUE, ONE_UNKNOWN),))


class St:
    """Props (property -> guard) and the local environment along the paths joined here."""
    __slots__ = ("props", "env")

    def __init__(self, props: dict, env: dict) -> None:
        self.props = props
        self.env = env

    def copy(self) -> "St":
        return St(dict(self.props), dict(self.env))


DEAD = None


class LoopInfo:
    """What a loop's syntax says: its counter, the bound of a counted loop, the nodes inside it."""
    __slots__ = ("node", "counter", "bound", "start", "ids", "id")

    def __init__(self, node) -> None:
        self.node = node
        self.id = id(node)
        self.counter = None
        self.bound = None
        self.start = 0
        self.ids = {id(n) for n in ast.walk(node)}
        if isinstance(node, (ast.For, ast.AsyncFor)):
            target, it = node.target, node.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name):
                if it.func.id == "enumerate" and it.args and isinstance(target, ast.Tuple) and target.elts \
                        and isinstance(target.elts[0], ast.Name):
                    self.counter = target.elts[0].id
                    self.start = _int(it.args[1]) if len(it.args) > 1 else _int(
                        next((k.value for k in it.keywords if k.arg == "start"), None)) or 0
                    if self.start == 0:
                        self.bound = ast.dump(ast.Call(ast.Name("len", ast.Load()), [it.args[0]], []))
                elif it.func.id == "range" and isinstance(target, ast.Name):
                    self.counter = target.id
                    if len(it.args) == 1:
                        self.bound = ast.dump(it.args[0])
                    elif len(it.args) == 2 and _int(it.args[0]) == 0:
                        self.bound = ast.dump(it.args[1])
                    elif len(it.args) == 2:
                        self.start = None          # range(k, n): counter does not start at 0
                        self.bound = ast.dump(it.args[1])


def _int(node) -> Optional[int]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, int) else None


class LoopCtx:
    __slots__ = ("info", "breaks", "continues", "last")

    def __init__(self, info: LoopInfo, last) -> None:
        self.info = info
        self.breaks: list = []
        self.continues: list = []
        self.last = last

    @property
    def counter(self):
        return self.info.counter

    @property
    def bound(self):
        return self.info.bound


class Frame:
    """One function being analysed (the root, or a callee analysed in place)."""

    def __init__(self, scope, depth: int = 0, stack: tuple = (), no_grad: int = 0) -> None:
        self.scope = scope
        self.module = scope.module if isinstance(scope, Function) else scope
        self.depth = depth
        self.stack = stack
        self.returns: list = []
        self.ret_vals: list = []
        self.loops: list = []
        self.no_grad = no_grad
        self.yield_handler = None
        self.control = None             # (module, call) of the with helper(...) this frame runs for
        self.exitstacks: dict = {}      # ExitStack creation site -> the with statement that owns it
        self.gate = False               # inside a branch that decides whether the optimizer steps


class Flow:
    """The analysis of one root."""

    def __init__(self, program, root) -> None:
        self.program = program
        self.values = program.values
        self.project = program.project
        self.root = root
        self.atoms = Atoms()
        self.conds = Conditions(self)
        self.records = Records(self)
        self.atom_info: dict = {}        # atom index -> (versions, volatile)
        self.atom_loops: dict = {}       # atom index -> ids of the loops it was tested in
        self.loop_infos: dict = {}
        self.last_atoms: dict = {}
        self._first_masks: dict = {}
        self.memo: dict = {}
        self.work = 0
        self.incomplete = False
        self.loop_stack: list = []       # ids of the loops being executed, callers' included
        self.optimizer_loops: set = set()  # ids of ``for opt in optimizers: opt.step()`` loops
        self.call_stack: list = []       # (module, call) of the project calls being analysed in place
        self.loop_owner: dict = {}       # loop id -> (module, depth of call_stack) where it runs
        self.helpers: dict = {}          # call id -> a @contextmanager helper call, entered by a with
        self.partials: dict = {}         # call id -> functools.partial(f, ...)
        self.exitstacks: dict = {}       # ExitStack creation site -> the with statement that owns it

    def close(self) -> None:
        for store in (self.memo, self.helpers, self.partials, self.exitstacks, self.loop_infos):
            store.clear()
        self.records = self.conds = self.program = self.values = self.project = None
        self.__dict__.pop("_populations", None)

    # -- running ---------------------------------------------------------------------------------------
    def run(self) -> "Flow":
        scope = self.root
        fr = Frame(scope)
        body = scope.node.body if isinstance(scope, Function) else scope.tree.body
        st = St({Prop(): TRUE}, {})
        if isinstance(scope, Function):
            for name in scope.params:
                st.env[name] = EnvVal(((TRUE, self.values.name(name, scope)),))
        try:
            self.block(body, st, fr)
        except RecursionError:
            self.incomplete = True
        return self

    def block(self, stmts, st, fr):
        for s in stmts:
            if st is None or not st.props:
                return None
            self.work += 1
            if self.work > MAX_WORK:
                self.incomplete = True
                return None
            st = self.stmt(s, st, fr)
        return st

    def stmt(self, s, st: St, fr: Frame):
        t = type(s)
        if t is ast.Expr:
            if isinstance(s.value, (ast.Yield, ast.YieldFrom)) and fr.yield_handler is not None:
                if s.value.value is not None:
                    self.expr(s.value.value, st, fr)
                return fr.yield_handler(st)
            self.expr(s.value, st, fr)
            return st
        if t is ast.Assign:
            value = self.expr(s.value, st, fr)
            for target in s.targets:
                events.assign(self, target, value, s, st, fr)
            return st
        if t is ast.AnnAssign:
            if s.value is not None:
                events.assign(self, s.target, self.expr(s.value, st, fr), s, st, fr)
            return st
        if t is ast.AugAssign:
            value = self.expr(s.value, st, fr)
            old = self.expr(s.target, st, fr) if isinstance(s.target, (ast.Name, ast.Attribute)) else UNKNOWN_VAL
            if isinstance(s.op, ast.Mult) and (old.prov or old.scaled is not None) and not value.prov and \
                    value.scaled is None and not events.scales_by_count(s.value):
                scaled = old.scaled          # ``loss *= weight``
            else:
                scaled = True if isinstance(s.op, (ast.Div, ast.Mult, ast.FloorDiv)) else _scaled_or(old.scaled,
                                                                                                      value.scaled)
            events.assign(self, s.target, EnvVal(((TRUE, ONE_UNKNOWN),), old.prov | value.prov, scaled), s, st, fr)
            return st
        if t is ast.If:
            return self.if_(s, st, fr)
        if t in (ast.For, ast.AsyncFor, ast.While):
            return self.loop(s, st, fr)
        if t in (ast.With, ast.AsyncWith):
            return events.with_(self, s, st, fr)
        if t is ast.Return:
            value = self.expr(s.value, st, fr) if s.value is not None else EnvVal(((TRUE, frozenset((Const(None),))),))
            fr.returns.append(st)
            fr.ret_vals.append(value)
            return None
        if t is ast.Raise:
            return None
        if t is ast.Continue:
            if fr.loops:
                fr.loops[-1].continues.append(st)
            return None
        if t is ast.Break:
            if fr.loops:
                fr.loops[-1].breaks.append(st)
            return None
        if t in (ast.Try, getattr(ast, "TryStar", ast.Try)):
            return self.try_(s, st, fr)
        if t is ast.Match:
            self.expr(s.subject, st, fr)
            outs = [self.block(case.body, st.copy(), fr) for case in s.cases]
            outs.append(st)
            return self.join(outs)
        if t is ast.Assert:
            return st
        return st

    # -- branches ----------------------------------------------------------------------------------------
    def if_(self, s: ast.If, st: St, fr: Frame):
        relevant = self.program.relevant_branch(s, fr)
        true, false = self.conds.cond(s.test, st, fr, relevant)
        gate = relevant and self.program.decides_step(s, fr)
        if gate and fr.gate:
            # a check inside the branch that steps (``if torch.isfinite(norm): optimizer.step()``) may
            # skip a step now and then; it is not the accumulation schedule: take the stepping branch
            if self.program.steps_in(s.body, fr) and not self.program.steps_in(s.orelse, fr):
                true, false = TRUE, 0
            elif self.program.steps_in(s.orelse, fr) and not self.program.steps_in(s.body, fr):
                true, false = 0, TRUE
        outer_gate = fr.gate
        fr.gate = outer_gate or gate
        body = self.block(s.body, self.restrict(st.copy(), true), fr) if true else None
        orelse = self.block(s.orelse, self.restrict(st.copy(), false), fr) if false else None
        fr.gate = outer_gate
        exact = (true & false) == 0 and (true | false) & self.atoms.universe == self.atoms.universe
        return self.join([body, orelse], (true, false) if exact else None)

    def try_(self, s, st: St, fr: Frame):
        entry = st.copy()
        body = self.block(s.body, st, fr)
        handlers = []
        if s.handlers:
            into = self.join([entry, body.copy() if body is not None else None])
            for handler in s.handlers:
                if into is not None:
                    handlers.append(self.block(handler.body, into.copy(), fr))
        if s.orelse and body is not None:
            body = self.block(s.orelse, body, fr)
        out = self.join([body] + handlers)
        if s.finalbody and out is not None:
            out = self.block(s.finalbody, out, fr)
        return out

    # -- loops ---------------------------------------------------------------------------------------------
    def loop_info(self, node) -> LoopInfo:
        info = self.loop_infos.get(id(node))
        if info is None:
            info = self.loop_infos[id(node)] = LoopInfo(node)
        return info

    def last_atom(self, ctx: LoopCtx):
        if ctx.last is None:
            ctx.last = self.last_atoms.get(ctx.info.id)
        if ctx.last is None:
            text = f"the last iteration of `{_loop_head(ctx.info.node, self)}`"
            ctx.last = self.atoms.get(("LAST", ctx.info.id), text)
            if ctx.last is not None:
                ctx.last.loop = ctx.info.id
                self.last_atoms[ctx.info.id] = ctx.last
                self.atom_info[ctx.last.index] = ((), False)
        return ctx.last

    def loop(self, s, st: St, fr: Frame):
        info = self.loop_info(s)
        is_for = not isinstance(s, ast.While)
        if is_for:
            self.expr(s.iter, st, fr)
        counted = is_for and info.bound is not None and self.program.loop_runs_backward(s, fr)
        ctx = LoopCtx(info, None)
        last = self.last_atom(ctx) if counted else None
        turn = self.values.iteration(s.iter, fr.scope) if is_for else ONE_UNKNOWN
        if is_for and _steps_each(s):
            self.optimizer_loops.add(info.id)
        entry = St({p._replace(first=p.first | {info.id}): g for p, g in st.props.items()}, dict(st.env))
        head = entry
        end = None
        for _ in range(MAX_LOOP_ROUNDS):
            ctx.breaks, ctx.continues = [], []
            fr.loops.append(ctx)
            body_in = head.copy()
            if is_for:
                events.assign(self, s.target, EnvVal(((TRUE, turn),), version=id(s)), s, body_in, fr,
                              version=id(s))
            else:
                true, _ = self.conds.cond(s.test, body_in, fr, self.program.relevant_branch(s, fr))
                body_in = self.restrict(body_in, true)
            self.loop_stack.append(info.id)
            self.loop_owner[info.id] = (fr.module, len(self.call_stack))
            out = self.block(s.body, body_in, fr)
            self.loop_stack.pop()
            fr.loops.pop()
            end = self.join([out] + ctx.continues)
            back = self.restrict(end.copy(), self.atoms.formula(last, False)) if (last is not None and end) else end
            new_head = self.join([entry, self.back_edge(back, info)])
            if _same(new_head, head):
                break
            head = new_head
        exits = list(ctx.breaks)
        if last is not None:
            exits.append(self.restrict(end.copy(), self.atoms.formula(last, True)) if end is not None else None)
        elif is_for and end is not None and info.id in self.optimizer_loops:
            exits.append(end)      # ``for opt in optimizers: opt.step()``: there is at least one optimizer
        elif is_for:
            exits.append(head)
        else:
            _, false = self.conds.cond(s.test, head.copy(), fr, self.program.relevant_branch(s, fr))
            exits.append(self.restrict(head.copy(), false) if false else None)
        out = self.join(exits)
        if out is not None and s.orelse:
            out = self.block(s.orelse, out, fr)
        if out is not None:
            out = St(_merge_props((p._replace(first=p.first - {info.id}), g) for p, g in out.props.items()), out.env)
        return out

    def back_edge(self, st: Optional[St], info: LoopInfo):
        """Going round: tokens remember the micro-step they came from; conditions that the next
        iteration evaluates afresh are forgotten; names rebound in the loop get a new version."""
        if st is None or not st.props:
            return None
        forget = [a.index for a in self.atoms.atoms if self._loop_dependent(a, info)]
        props: dict = {}
        for prop, guard in st.props.items():
            tokens = tuple(t._replace(frozen=guard) if t.frozen is None else t for t in prop.tokens)
            g = guard
            for k in forget:
                g = exists(g, k)
            key = prop._replace(tokens=tokens, first=prop.first - {info.id})
            props[key] = props.get(key, 0) | (g & self.atoms.universe)
        env = {}
        for name, value in st.env.items():
            if isinstance(value.version, int) and value.version in info.ids or name in self._rebound(info):
                value = value._replace(version=("phi", info.id), cond=None,
                                       alts=tuple((TRUE, v) for _, v in value.alts))
            env[name] = value
        return St(props, env)

    def _rebound(self, info: LoopInfo) -> set:
        key = ("rebound", info.id)
        if key not in self.memo:
            names = set()
            for n in ast.walk(info.node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    names.add(n.id)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    dotted = _dotted(n)
                    if dotted:
                        names.add(dotted)
            self.memo[key] = names
        return self.memo[key]

    def _loop_dependent(self, atom, info: LoopInfo) -> bool:
        if atom.loop is not None:
            return atom.loop == info.id or atom.loop in info.ids
        versions, volatile = self.atom_info.get(atom.index, ((), True))
        if volatile:
            # tested afresh each time round the loops it is tested in; a test made once before an
            # inner loop (``for opt in optimizers:``) holds all through that loop
            loops = self.atom_loops.get(atom.index)
            return loops is None or info.id in loops
        for v in versions:
            if v == ("phi", info.id) or (isinstance(v, int) and v in info.ids):
                return True
            if isinstance(v, tuple) and v and v[0] == "phi" and v[1] in info.ids:
                return True
        return False

    def note_atom(self, atom, versions, volatile: bool) -> None:
        if atom.index not in self.atom_info:
            self.atom_info[atom.index] = (versions, volatile)
        self.atom_loops.setdefault(atom.index, set()).update(self.loop_stack)

    def counter_loop(self, counter_dump: str, fr: Frame):
        for ctx in reversed(fr.loops):
            if ctx.counter and counter_dump == ast.dump(ast.Name(ctx.counter, ast.Load())) and ctx.info.start is not None:
                return ctx.info.id, ctx.info.start
        return None

    # -- states ------------------------------------------------------------------------------------------
    def first_mask(self, first: frozenset) -> int:
        if not first:
            return TRUE
        key = (first, len(self.atoms.atoms))
        mask = self._first_masks.get(key)
        if mask is None:
            mask = TRUE
            for atom in self.atoms.atoms:
                if atom.loop is not None and atom.loop in first:
                    mask &= ~MASKS[atom.index]
                elif atom.counter is not None and atom.counter[0] in first and atom.mod is not None:
                    holds = atom.mod[2] == atom.counter[1]
                    mask &= MASKS[atom.index] if holds else ~MASKS[atom.index]
            mask &= TRUE
            self._first_masks[key] = mask
        return mask

    def restrict(self, st: Optional[St], formula: int) -> Optional[St]:
        if st is None:
            return None
        props = {}
        for prop, guard in st.props.items():
            g = guard & formula & self.first_mask(prop.first)
            if g:
                props[prop] = g
        st.props = props
        return st

    def join(self, states, formulas: Optional[tuple] = None) -> Optional[St]:
        live = [s for s in states if s is not None and s.props]
        if not live:
            return None
        if len(live) == 1:
            return live[0]
        props: dict = {}
        for s in live:
            for p, g in s.props.items():
                props[p] = props.get(p, 0) | g
        env = dict(live[0].env)
        for s in live[1:]:
            for name, value in s.env.items():
                mine = env.get(name)
                env[name] = value if mine is None else _merge_val(mine, value, formulas if len(live) == 2 else None)
        return St(props, env)

    # -- expressions ---------------------------------------------------------------------------------
    def expr(self, node, st: St, fr: Frame) -> EnvVal:
        return events.expr(self, node, st, fr)

    def report_site(self, module, node):
        """Where to report an event that happened in a callee: the call, in the file of the loop that
        holds it, through which the loop reached it (a shared helper's ``loss.backward()`` is not the
        bug; the loop that calls it without sync control is)."""
        from synccheck.analyzer.project.values import site_of
        if self.loop_stack:
            loop_module, depth = self.loop_owner.get(self.loop_stack[-1], (module, len(self.call_stack)))
            if module is not loop_module:
                for caller_module, call in reversed(self.call_stack[depth:]):
                    if caller_module is loop_module:
                        site = site_of(caller_module, call)
                        self.records.node(site, caller_module, call)
                        return site
        return site_of(module, node)

    def version(self, name: str, st: St):
        value = st.env.get(name)
        return value.version if value is not None else 0

    def constant(self, name: Optional[str], fr: Frame):
        """A name bound only to one literal (``accum_steps = 1``): its value, else None."""
        if not name:
            return None
        vals = self.values.name(name, fr.scope)
        if len(vals) == 1:
            (v,) = tuple(vals)
            if isinstance(v, Const) and isinstance(v.value, (int, bool)):
                return v.value
        return None


def _same(a: Optional[St], b: Optional[St]) -> bool:
    if a is None or b is None:
        return a is b
    return a.props == b.props and a.env == b.env


def _merge_props(items) -> dict:
    out: dict = {}
    for p, g in items:
        out[p] = out.get(p, 0) | g
    return out


def _scaled_or(a, b):
    if a or b:
        return True
    if a is None or b is None:
        return None
    return False


def _merge_val(a: EnvVal, b: EnvVal, formulas) -> EnvVal:
    if a == b:
        return a
    if formulas is not None:
        true, false = formulas
        alts = tuple((g & true, v) for g, v in a.alts if g & true) + tuple((g & false, v) for g, v in b.alts if g & false)
        cond = None
        if a.cond is not None and b.cond is not None:
            cond = ((true & a.cond[0]) | (false & b.cond[0]), (true & a.cond[1]) | (false & b.cond[1]))
    else:
        alts = a.alts + tuple(x for x in b.alts if x not in a.alts)
        cond = a.cond if a.cond == b.cond else None
    if len(alts) > 8:
        merged = frozenset()
        for _, v in alts:
            merged |= v
        alts = ((TRUE, merged),)
    version = a.version if a.version == b.version else ("merge", _vkey(a.version), _vkey(b.version))
    return EnvVal(alts, a.prov | b.prov, _scaled_or(a.scaled, b.scaled) if (a.scaled or b.scaled) else
                  (None if a.scaled is None or b.scaled is None else False), cond, version)


def _vkey(v):
    return v if not isinstance(v, tuple) or len(repr(v)) < 200 else hash(v)


def _loop_head(node, flow) -> str:
    if isinstance(node, (ast.For, ast.AsyncFor)):
        text = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
    else:
        text = f"while {ast.unparse(node.test)}"
    return text if len(text) < 60 else text[:57] + "..."


def _steps_each(loop) -> bool:
    """``for opt in opts: opt.step()``: a loop over optimizers, which runs at least once."""
    if not isinstance(loop.target, ast.Name):
        return False
    name = loop.target.id
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step" and
               isinstance(n.func.value, ast.Name) and n.func.value.id == name
               for stmt in loop.body for n in ast.walk(stmt))
