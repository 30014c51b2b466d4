"""Stage 6 of the pipeline (sync dataflow), part 2: loops and their back edges.

A loop goes round to a fixpoint (at most ``MAX_LOOP_ROUNDS``): each round runs the body from the
join of the entry and the back edge. Going round, pending micro-steps remember the iteration they
came from, conditions the next iteration evaluates afresh are forgotten, and names rebound in the
loop get a new version. A counted loop (``for i in range(n)``, ``enumerate``) gets an atom for its
last iteration, so ``i == len(loader) - 1`` style boundaries are understood. ``LoopInfo`` is what a
loop's syntax says; ``Loops`` is the part of ``syncflow.Flow`` that runs loops.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project import events
from synccheck.analyzer.project.flow_state import Frame, St, _merge_props, _same  # noqa: F401
from synccheck.analyzer.project.guards import TRUE, exists
from synccheck.analyzer.project.definitions import called_name
from synccheck.analyzer.project.state import EnvVal, Prop, Token
from synccheck.analyzer.project.values import ONE_UNKNOWN, Tup, Wrapper
from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project.traversal import walk

_UNKNOWN = EnvVal(((TRUE, ONE_UNKNOWN),))

MAX_LOOP_ROUNDS = 6


class LoopInfo:
    """What a loop's syntax says: its counter, the bound of a counted loop, the nodes inside it."""
    __slots__ = ("node", "counter", "bound", "start", "ids", "id", "_each")

    def __init__(self, node) -> None:
        self.node = node
        self.id = id(node)
        self.counter = None
        self.bound = None
        self.start = 0
        self.ids = {id(n) for n in walk(node)}
        self._each = {}
        if isinstance(node, (ast.For, ast.AsyncFor)):
            target, it = node.target, node.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name):
                if it.func.id == "enumerate" and it.args and isinstance(target, ast.Tuple) and target.elts \
                        and isinstance(target.elts[0], ast.Name):
                    self.counter = target.elts[0].id
                    self.start = _int(it.args[1]) if len(it.args) > 1 else _int(
                        next((k.value for k in it.keywords if k.arg == "start"), None)) or 0
                    if self.start == 0:
                        counted = it.args[0]
                        if isinstance(counted, ast.Call) and isinstance(counted.func, ast.Name) and \
                                counted.func.id == "zip" and counted.args and not counted.keywords:
                            # ``enumerate(zip(inputs, targets))`` with ``n = len(inputs)``: chunks of one batch
                            counted = counted.args[0]
                        self.bound = ast.dump(ast.Call(ast.Name("len", ast.Load()), [counted], []))
                elif it.func.id == "range" and isinstance(target, ast.Name):
                    self.counter = target.id
                    if len(it.args) == 1:
                        self.bound = ast.dump(it.args[0])
                    elif len(it.args) == 2 and _int(it.args[0]) == 0:
                        self.bound = ast.dump(it.args[1])
                    elif len(it.args) == 2:
                        self.start = None          # range(k, n): counter does not start at 0
                        self.bound = ast.dump(it.args[1])


    def each(self, test) -> bool:
        """``test(node)`` (_steps_each, _flags_each) for this loop, read once: the loop runs every
        time its function is analysed, and every turn of the loops around it."""
        found = self._each.get(test)
        if found is None:
            found = self._each[test] = test(self.node)
        return found


_new = tuple.__new__        # a named tuple made from its fields, as its _make and _replace make it


def _with_first(items, loop: int, entering: bool) -> dict:
    """Properties with ``loop`` added to (entering: ``{p._replace(first=...): g}``, the last guard of
    properties that become equal kept) or taken from (leaving: _merge_props, their guards OR-ed)
    their first iterations."""
    out: dict = {}
    firsts: dict = {}
    for p, g in items:
        first = firsts.get(p.first)
        if first is None:
            first = firsts[p.first] = p.first | {loop} if entering else p.first - {loop}
        key = _new(Prop, p[:4] + (first,))
        if entering:
            out[key] = g
        else:
            old = out.get(key)
            out[key] = g if old is None else old | g
    return out


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


class Loops:
    """Loops to a fixpoint, back edges, and loop atoms (a part of Flow)."""

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

    def _broke_atom(self, s, info: LoopInfo):
        """An atom for "the loop ended by a ``break``", only for a loop that sets a flag to a constant
        right before one of its breaks (a retry loop's ``loss_computed = True; break``)."""
        flagged = False
        for node in walk(s):
            body = getattr(node, "body", None)
            for block in (body, getattr(node, "orelse", None)):
                if not isinstance(block, list):
                    continue
                for before, stmt in zip(block, block[1:]):
                    if isinstance(stmt, ast.Break) and isinstance(before, ast.Assign) and \
                            isinstance(before.value, ast.Constant) and isinstance(before.value.value, bool):
                        flagged = True
        if not flagged:
            return None
        atom = self.atoms.get(("BROKE", info.id), f"`{_loop_head(info.node, self)}` ended by a break")
        if atom is not None:
            atom.loop = info.id
            self.atom_info[atom.index] = ((), False)
        return atom

    def _runs_once(self, s, fr: Frame) -> bool:
        """``for _ in range(n)`` where ``n`` holds 1 and only 1 (a literal, or every value it may hold)."""
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and
                len(it.args) == 1 and not it.keywords):
            return False
        arg = it.args[0]
        if not (isinstance(arg, ast.Constant) and arg.value == 1 or isinstance(arg, ast.Name) or
                isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "self"):
            # (``args.num_microbatches``: a config record's field, which a YAML file or the command line
            # may set where no code does, mistral-finetune's TrainArgs)
            return False
        if any(isinstance(n, (ast.For, ast.While, ast.AsyncFor)) for stmt in s.body for n in ast.walk(stmt)):
            return False        # (an epoch loop run once still holds the micro-steps' loop: its first
            #                    turn is what ``self.global_step == 0`` tells apart)
        if isinstance(arg, ast.Constant):
            return True
        from synccheck.analyzer.project.values import Const
        vals = self.values.expr(arg, fr.scope)
        return bool(vals) and all(isinstance(v, Const) and v.value == 1 for v in vals)

    def loop(self, s, st: St, fr: Frame):
        info = self.loop_info(s)
        is_for = not isinstance(s, ast.While)
        iterated = self.expr(s.iter, st, fr) if is_for else None
        # ``for _ in range(self.grad_accum_every)`` where every value the count may hold is 1 (the
        # constructor's default, and what each caller passes): one turn, no micro-steps (LAPA)
        once = is_for and self._runs_once(s, fr)
        counted = is_for and info.bound is not None and self.program.loop_runs_backward(s, fr) and not once
        ctx = LoopCtx(info, None)
        last = self.last_atom(ctx) if counted else None
        turn = self.values.iteration(s.iter, fr.scope) if is_for else ONE_UNKNOWN
        if is_for and info.each(_steps_each):
            self.optimizer_loops.add(info.id)
        # a loop's first iteration is told apart only where a test can ask for it: its counter's
        # in a loop that runs an event (``micro_step == 0``, ``i % n``), or DDP's static_graph (SC106);
        # other loops (a model's ``for block in self.blocks``) would only multiply the properties
        first = self.program.mentions_static_graph or info.counter is not None and info.start is not None and bool(
            self.program.words(s.body, fr.scope) - self.program.CALLS_ONLY)
        entry = St(_with_first(st.props.items(), info.id, True) if first else st.props, dict(st.env))
        # a name the loop rebinds is one definition at its head (SSA's phi), the first turn included:
        # ``micro % n == 0`` is then one test on every turn, and in every turn of a loop around it
        rebound = self._rebound(info)
        for name, value in entry.env.items():
            if name in rebound and value.version != ("phi", info.id):
                entry.env[name] = value._replace(version=("phi", info.id))
        head = entry
        end = None
        # a loop of micro-steps inside a branch that decides whether anything steps (``if do_eval:
        # return`` / ``else: for step, batch in ...``) has its own schedule: its tests are not "a
        # check inside the stepping branch" (Flow.if_)
        outer_gate = fr.gate
        if outer_gate and self.program.loop_runs_backward(s, fr):
            fr.gate = False
        restarted = False
        for _ in range(MAX_LOOP_ROUNDS):
            counted_rebound = len(rebound)
            ctx.breaks, ctx.continues = [], []
            fr.loops.append(ctx)
            body_in = head.copy()
            if is_for:
                # (``for name, value in outputs.items()``: each value comes from what was iterated, the
                # keys do not)
                element = EnvVal(((TRUE, turn),), iterated.prov, iterated.scaled, version=id(s)) \
                    if _iterates_a_container(s) else EnvVal(((TRUE, turn),), version=id(s))
                if _items_loop(s):
                    events.assign(self, s.target.elts[0], EnvVal(((TRUE, turn),), version=id(s)), s, body_in, fr,
                                  version=id(s))
                    events.assign(self, s.target.elts[1], element, s, body_in, fr, version=id(s))
                else:
                    events.assign(self, s.target, element, s, body_in, fr, version=id(s))
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
            new_head = entry if once else self.join([entry, self.back_edge(back, info, entry.env)])
            if len(rebound) > counted_rebound and not restarted and not once:
                # the turn found counts that its calls move on (back_edge): the loop starts again with
                # them defined at its head, as a count the loop itself moves on is from the first turn
                restarted = True
                entry = St(entry.props, dict(entry.env))
                for name in rebound:
                    if name not in entry.env or entry.env[name].version != ("phi", info.id):
                        entry.env[name] = entry.env.get(name, _UNKNOWN)._replace(version=("phi", info.id),
                                                                                 origin=None)
                head = entry
                continue
            if new_head is not None and len(new_head.props) > self.peak:
                self.peak = len(new_head.props)
            if _same(new_head, head):
                break
            head = new_head
        fr.gate = outer_gate
        broke = self._broke_atom(s, info) if ctx.breaks else None
        exits = [] if broke is not None else list(ctx.breaks)
        if last is not None:
            exits.append(self.restrict(end.copy(), self.atoms.formula(last, True)) if end is not None else None)
        elif once:
            exits.append(end)
        elif is_for and end is not None and (info.id in self.optimizer_loops or info.each(_flags_each) or
                                             _models_written_out(iterated)):
            # ``for opt in optimizers: opt.step()``: there is at least one optimizer (and one model in
            # ``for m in [encoder, decoder]: stack.enter_context(m.no_sync())``)
            exits.append(end)
        elif is_for:
            exits.append(head)
        else:
            _, false = self.conds.cond(s.test, head.copy(), fr, self.program.relevant_branch(s, fr))
            exits.append(self.restrict(head.copy(), false) if false else None)
        out = self.join(exits)
        if broke is not None:
            # ``done = True; break`` ... ``if done: optimizer.step()``: the exits by a break and the one
            # past the last turn are told apart, so a flag set before the break says which one ran
            yes, no = self.atoms.formula(broke, True), self.atoms.formula(broke, False)
            out = self.join([self.restrict(self.join(ctx.breaks), yes), self.restrict(out, no)], (yes, no))
        if out is not None and s.orelse:
            out = self.block(s.orelse, out, fr)
        if out is not None and first:
            out = St(_with_first(out.props.items(), info.id, False), out.env)
        return out

    def back_edge(self, st: Optional[St], info: LoopInfo, before: Optional[dict] = None):
        """Going round: tokens remember the micro-step they came from; conditions that the next
        iteration evaluates afresh are forgotten; names rebound in the loop get a new version."""
        if st is None or not st.props:
            return None
        forget = [a.index for a in self.atoms.atoms if self._loop_dependent(a, info)]
        props: dict = {}
        universe, this_loop, firsts = self.atoms.universe, {info.id}, {}
        for prop, guard in st.props.items():
            # (prop._replace and token._replace, spelled out: this runs for every property every turn)
            tokens = prop.tokens
            # (a micro-step of this loop's turn; one made before the loop was entered, like a backward
            # before ``for g in optimizer.param_groups:``, does not go round with it)
            if any(t.frozen is None and info.id in t.loops for t in tokens):
                tokens = tuple(_new(Token, t[:8] + (guard,)) if t.frozen is None and info.id in t.loops else t
                               for t in tokens)
            g = guard
            for k in forget:
                g = exists(g, k)
            first = firsts.get(prop.first)
            if first is None:
                first = firsts[prop.first] = prop.first - this_loop
            key = _new(Prop, (prop.controls, prop.flags, prop.forwards, tokens, first))
            old = props.get(key)
            props[key] = (g & universe) if old is None else old | (g & universe)
        env = {}
        ids, rebound = info.ids, self._rebound(info)
        if before is not None:
            # a count a method called in the loop moves on (``self.accumulator.accumulate(model)`` doing
            # ``self.current_step += 1``) is rebound by the loop as much as a ``step += 1`` written in it
            rebound.update(name for name, value in st.env.items() if name not in rebound and
                           value.origin is not None and value.origin[0] == "shift" and before.get(name) is not value)
        for name, value in st.env.items():
            if isinstance(value.version, int) and value.version in ids or name in rebound:
                value = value._replace(version=("phi", info.id), cond=None, origin=None,
                                       alts=tuple((TRUE, v) for _, v in value.alts))
            env[name] = value
        return St(props, env)

    def _rebound(self, info: LoopInfo) -> set:
        key = ("rebound", info.id)
        if key not in self.memo:
            names = set()
            for n in walk(info.node):
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
        names = self.atom_names.get(atom.index)
        if names and not self._rebound(info).isdisjoint(names):
            return True             # (a count the loop moves on, first read before the loop rebinds it)
        for v in versions:
            if v == ("phi", info.id) or (isinstance(v, int) and v in info.ids):
                return True
            if isinstance(v, tuple) and v and v[0] == "phi" and v[1] in info.ids:
                return True
        return False

    def holds_through(self, atom, info: LoopInfo) -> bool:
        """A test in a function the loop calls, tested inside a loop of that function (``info``) on
        names that loop does not rebind (``if accum == 1:`` in ``train_one_epoch``): the same on every
        turn of that loop, though another call may see it otherwise."""
        if atom.index not in self.atom_in_callee or info.id not in self.atom_loops.get(atom.index, ()):
            return False
        names = self.atom_names.get(atom.index)
        return bool(names) and self._rebound(info).isdisjoint(names)

    def note_atom(self, atom, versions, volatile: bool, names=(), in_callee: bool = False) -> None:
        """``in_callee``: volatile only because the test is in a function the loop calls, whose names
        a later call may bind anew (not for a call or an item in the test itself)."""
        if atom.index not in self.atom_info:
            self.atom_info[atom.index] = (versions, volatile)
            if names:
                self.atom_names[atom.index] = names
            if in_callee:
                self.atom_in_callee.add(atom.index)
        self.atom_loops.setdefault(atom.index, set()).update(self.loop_stack)

    def counter_loop_from(self, counter_dump: str, start_dump: str, fr: Frame):
        """The id of the running ``for x in range(start, n)`` whose counter is ``x`` and whose start
        is written ``start`` (``epoch == self.start_epoch`` on ``range(self.start_epoch, epochs)``)."""
        for ctx in reversed(fr.loops):
            node = ctx.info.node
            if ctx.counter and counter_dump == ast.dump(ast.Name(ctx.counter, ast.Load())) and \
                    isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, ast.Call) and \
                    called_name(node.iter) == "range" and len(node.iter.args) >= 2 and \
                    ast.dump(node.iter.args[0]) == start_dump:
                return ctx.info.id
        return None

    def counter_loop(self, counter_dump: str, fr: Frame):
        for ctx in reversed(fr.loops):
            if ctx.counter and counter_dump == ast.dump(ast.Name(ctx.counter, ast.Load())) and ctx.info.start is not None:
                return ctx.info.id, ctx.info.start
        return None


def _loop_head(node, flow) -> str:
    if isinstance(node, (ast.For, ast.AsyncFor)):
        text = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
    else:
        text = f"while {ast.unparse(node.test)}"
    return text if len(text) < 60 else text[:57] + "..."


def _iterates_a_container(loop) -> bool:
    """``for v in outputs.values()``, ``for l in losses``: the elements of a value (not what a
    generator or a helper yields, which its own code says)."""
    it = loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("zip", "enumerate") and \
            it.args and not it.keywords:
        # ``for dr, dg in zip(disc_real_outputs, disc_generated_outputs)`` (HiFi-GAN's losses, in every
        # VITS): the pairs are the lists' elements
        return all(isinstance(a, (ast.Name, ast.Attribute, ast.Subscript)) for a in it.args)
    if isinstance(it, ast.Call):
        return isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "values") and not it.args
    return isinstance(it, (ast.Name, ast.Attribute, ast.Subscript))


def _items_loop(loop) -> bool:
    """``for key, value in d.items():``"""
    it, target = loop.iter, loop.target
    return isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items" and \
        isinstance(target, ast.Tuple) and len(target.elts) == 2


def _steps_each(loop) -> bool:
    """``for opt in opts: opt.step()`` (or ``opt.zero_grad()``, ``scaler.step(opt)``, ``for i in ids:
    optimizers[i].step()``): a loop over optimizers, which runs at least once."""
    return _acts_on_each(loop, lambda n, name: isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
        n.func.attr in ("step", "zero_grad") and _names_it(n.func.value, name) or
        n.func.attr == "step" and len(n.args) == 1 and _names_it(n.args[0], name) and
        "scaler" in ast.unparse(n.func.value).lower()))


def _names_it(node, name: str) -> bool:
    """``opt`` (the loop's name), or ``optimizers[idx]`` indexed by it."""
    if isinstance(node, ast.Subscript):
        node = node.slice
    return isinstance(node, ast.Name) and node.id == name


def _flags_each(loop) -> bool:
    """``for m in self.modules.values(): m.require_backward_grad_sync = False``: a loop over the
    wrapped modules, which runs at least once."""
    return _acts_on_each(loop, lambda n, name: isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and
                         n.attr == "require_backward_grad_sync" and isinstance(n.value, ast.Name) and
                         n.value.id == name)


def _acts_on_each(loop, acts) -> bool:
    """Does the body of ``for name in ...:`` hold a node that ``acts(node, name)`` on the loop's name?
    Also ``for i, opt in enumerate(opts)`` and ``for opt, sched in zip(opts, scheds)``: any name bound."""
    target = loop.target
    if isinstance(target, ast.Name):
        names = [target.id]
    elif isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts) and \
            isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name) and \
            loop.iter.func.id in ("enumerate", "zip"):
        names = [e.id for e in target.elts]
    else:
        return False
    return any(acts(n, name) for stmt in loop.body for n in walk(stmt) for name in names)


def _models_written_out(iterated) -> bool:
    """Does the loop iterate a list or tuple written out with a wrapper among its items (so it
    runs at least once)?"""
    return iterated is not None and bool(iterated.values) and all(
        isinstance(v, Tup) and v.items and any(isinstance(w, Wrapper) for item in v.items for w in item)
        for v in iterated.values)
