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

The stage's modules: flow_state.py (``St``, ``Frame``, joins), loops.py (loops and back edges, a part
of ``Flow``), branches.py (``if``, a part of ``Flow``), events.py and its parts (what each expression
and call does), and this one: ``Flow``, statements, ``try``, and the states' restriction and join. Every name these modules define
that syncflow.py held before stays importable from here.
"""
from __future__ import annotations

import ast
import re
from functools import cached_property
from itertools import islice
from typing import Optional

from synccheck.analyzer.project import events
from synccheck.analyzer.project.conditions import Conditions
from synccheck.analyzer.project.facts import Records
from synccheck.analyzer.project.guards import MASKS, TRUE, Atoms
from synccheck.analyzer.project.definitions import Function, enclosing_function
from synccheck.analyzer.project.state import EnvVal, Prop, origin_of
from synccheck.analyzer.project.value_calls import made_per_call
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.values import ONE_UNKNOWN, Const, Obj, Unknown, site_of
# Flow builds on loops.py; the rest is re-exported: these names have always been importable from here.
from synccheck.analyzer.project.flow_state import DEAD, Frame, St, _merge_props, _merge_val, _same, _scaled_or, _vkey, zero_start
from synccheck.analyzer.project.entry_points import per_call_loop, then_call
from synccheck.analyzer.project.program import lightning_manual_step
from synccheck.analyzer.project.branches import DECIDED_KINDS, Branches
from synccheck.analyzer.project.loops import MAX_LOOP_ROUNDS, LoopCtx, LoopInfo, Loops, _int, _loop_head, _steps_each

_DISTRIBUTED_WORDS = re.compile(r"num_processes|world_size|distributed|multi_gpu|n_gpu|num_gpus")

MAX_DEPTH = 8
MAX_WORK = 60_000          # statements executed per root, inlined calls included
# the same, each statement counted once per property it carries: a root whose properties multiply
# (ColossalAI's GRPO consumer loop inlining pipeline schedules: 40 million within a minute, where
# the largest of diffusers' and the corpus's roots stay under a million) stops here, incomplete
MAX_COST = 3_000_000
UNKNOWN_VAL = EnvVal(((TRUE, ONE_UNKNOWN),))


class Flow(Branches, Loops):
    """The analysis of one root."""

    def __init__(self, program, root, receiver=None) -> None:
        self.program = program
        # the instance a base class's method runs on, when it is analysed once per concrete subclass
        self.receiver = receiver
        self.values = program.values
        self.project = program.project
        self.root = root
        # the root's module and its syntax tree (a function's, or a script's whole module)
        self.root_module = root.module if isinstance(root, Function) else root
        self.root_node = root.node if isinstance(root, Function) else root.tree
        self.atoms = Atoms()
        # accelerate's boundary test gets its atom first: a loop with many tests of its own may
        # fill the table before its prepared optimizer steps
        if ".accumulate(" in self.root_module.text:
            self.atoms.get(("ACCELERATE_SYNC_GRADIENTS",), "accelerator.sync_gradients")
        self.conds = Conditions(self)
        self.records = Records(self)
        self.atom_info: dict = {}        # atom index -> (versions, volatile)
        self.atom_loops: dict = {}       # atom index -> ids of the loops it was tested in
        self.atom_names: dict = {}       # atom index -> the names its test reads
        self.atom_in_callee: set = set()  # atoms volatile only for being tested in a callee (note_atom)
        self.stable_atoms: set = set()   # atoms that hold the same value all through the analysis
        self.type_atoms: dict = {}       # atom index -> the wrappers ``isinstance(x, DDP)`` found x may be
        self.loop_infos: dict = {}
        self.last_atoms: dict = {}
        self._first_masks: dict = {}
        self.memo: dict = {}
        self.work = 0
        self.cost = 0                    # statements times the properties they carried (MAX_COST)
        self.peak = 0                    # the most properties a loop head held (what a statement costs)
        self.incomplete = False
        self.calls_loop = None           # the root frame, when the root is the body of a loop out of view
        self.loop_stack: list = []       # ids of the loops being executed, callers' included
        self.optimizer_loops: set = set()  # ids of ``for opt in optimizers: opt.step()`` loops
        self.entering: list = []         # ids of the withs whose context object's __enter__ runs now
        self.call_stack: list = []       # (module, call) of the project calls being analysed in place
        self.loop_owner: dict = {}       # loop id -> (module, depth of call_stack) where it runs
        self.helpers: dict = {}          # (call id, function) -> a @contextmanager helper call, entered by a with
        self.partial_calls: dict = {}    # partial id -> the functools.partial(...) call that made it
        self.partials: dict = {}         # call id -> functools.partial(f, ...)
        self.exitstacks: dict = {}       # ExitStack creation site -> the with statement that owns it

    def close(self) -> None:
        for store in (self.memo, self.helpers, self.partials, self.partial_calls, self.exitstacks, self.loop_infos):
            store.clear()
        self.records = self.conds = self.program = self.values = self.project = None
        self.__dict__.pop("_populations", None)

    @cached_property
    def accumulation_forbidden(self) -> bool:
        """Does the root refuse to run, up front, some configuration of distributed accumulation?
        ``if args.train_text_encoder and args.gradient_accumulation_steps > 1 and
        accelerator.num_processes > 1: raise ValueError(...)`` (diffusers' dreambooth scripts): the
        second model that ``accelerator.accumulate(unet)`` leaves syncing never accumulates."""
        for stmt in self.root_node.body:
            if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], ast.Raise):
                test = self.root_module.segment(stmt.test) or ""
                if "accum" in test and _DISTRIBUTED_WORDS.search(test):
                    return True
        return False

    # -- running ---------------------------------------------------------------------------------------
    def run(self) -> "Flow":
        scope = self.root
        fr = Frame(scope)
        body = self.root_node.body
        if isinstance(scope, Function) and lightning_manual_step(scope, scope.module.segment(scope.node)):
            body = [_lightning_loop(scope)]
            self.calls_loop = fr
        elif isinstance(scope, Function) and scope.uid in self.program.per_call:
            body = [per_call_loop(scope)]
            self.calls_loop = fr
        elif isinstance(scope, Function) and scope.uid in self.program.then_call:
            body = then_call(scope, self.program.then_call[scope.uid])
        st = St({Prop(): TRUE}, {})
        if isinstance(scope, Function):
            for name in scope.params:
                st.env[name] = EnvVal(((TRUE, self.values.parameter(scope, name)),))
            if self.receiver is not None:
                st.env[scope.params[0]] = EnvVal(((TRUE, frozenset((self.receiver,))),))
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
            self.cost += len(st.props)
            if self.work > MAX_WORK or self.cost > MAX_COST:
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
                value = self.expr(s.value, st, fr)
                if isinstance(s.target, ast.Name) and all(isinstance(v, (Unknown, Obj)) for v in value.values):
                    # ``engine: TrainingEngine = registry.construct(...)``: what the annotation names
                    named = self.values.annotated_instance(fr.module, s.annotation, s.value)
                    if named:
                        value = value._replace(alts=((TRUE, named),))
                events.assign(self, s.target, value, s, st, fr)
            return st
        if t is ast.AugAssign:
            value = self.expr(s.value, st, fr)
            old = self.expr(s.target, st, fr) if isinstance(s.target, (ast.Name, ast.Attribute)) else UNKNOWN_VAL
            product = events.weighted(old, value, s.value, self, fr) if isinstance(s.op, ast.Mult) else events._UNWEIGHTED
            if product is not events._UNWEIGHTED:
                scaled = product             # ``loss *= weight``
            else:
                scaled = old.scaled if isinstance(s.op, (ast.Div, ast.FloorDiv)) and (
                    events.is_one(value) and not events.the_step_count(
                        s.value, fr.scope.node if isinstance(fr.scope, Function) else None) or events.mean_over(
                    s.target, s.value, s, fr.scope.node if isinstance(fr.scope, Function) else None)) else \
                    True if isinstance(s.op, (ast.Div, ast.Mult, ast.FloorDiv)) else \
                    value.scaled if zero_start(old) else _scaled_or(old.scaled, value.scaled)
            moved = None
            if isinstance(s.target, (ast.Name, ast.Attribute)):
                moved = origin_of(ast.BinOp(s.target, s.op, s.value), st)    # ``step += 1``
            events.assign(self, s.target, EnvVal(((TRUE, ONE_UNKNOWN),), old.prov | value.prov, scaled, None, 0, moved),
                          s, st, fr)
            return st
        if t is ast.If:
            return self.if_(s, st, fr)
        if t in (ast.For, ast.AsyncFor, ast.While):
            held = self._generator_context(s, fr) if t is not ast.While else None
            if held is None:
                return self.loop(s, st, fr)
            # ``for _ in accumulate_contexts(n, model):`` over a generator that yields inside ``with
            # ctx():`` (``model.no_sync`` on all turns but the last): each turn runs in a context we do
            # not follow turn by turn, so its micro-steps get no verdict rather than a wrong one
            from synccheck.analyzer.project.sync_control import pop_controls, push_controls
            push_controls(self, s.iter, held, st, fr, id(s))
            out = self.loop(s, st, fr)
            pop_controls(out, id(s))
            return out
        if t in (ast.With, ast.AsyncWith):
            return events.with_(self, s, st, fr)
        if t is ast.Return:
            value = self.expr(s.value, st, fr) if s.value is not None else EnvVal(((TRUE, frozenset((Const(None),))),))
            if type(s.value) is ast.Call and self.call_stack:
                # ``return component(*args)`` makes the caller's own object (ValueCalls._made_per_call)
                caller = site_of(*self.call_stack[-1])
                made = {site_of(fr.module, s.value)}
                value = value._replace(alts=tuple((g, made_per_call(v, made, caller)) for g, v in value.alts))
            if fr is self.calls_loop and fr.loops:
                # the root runs once per turn of a loop out of view: its ``return loss`` ends the turn
                fr.loops[0].continues.append(st)
                return None
            fr.returns.append(st)
            fr.ret_vals.append(value)
            fr.ret_nodes.append(s)
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

    def try_(self, s, st: St, fr: Frame):
        entry = st.copy()
        body = self.block(s.body, st, fr)
        handlers = []
        if s.handlers:
            # a handler runs when the body failed part-way: from the state before the body (the body's
            # last statement raising after all the others ran is one path among many, and reading it as
            # the handler's would have a boundary micro-step that ran skip its step: HMA's
            # ``try: ... backward ...; if not is_update_step: continue`` / ``except Exception: continue``)
            into = entry
            for handler in s.handlers:
                if into is not None:
                    handlers.append(self.block(handler.body, into.copy(), fr))
        if s.orelse and body is not None:
            body = self.block(s.orelse, body, fr)
        out = self.join([body] + handlers)
        if s.finalbody and out is not None:
            out = self.block(s.finalbody, out, fr)
        return out

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
                elif atom.first is not None and atom.first[0] in first:
                    mask &= MASKS[atom.index] if atom.first[1] else ~MASKS[atom.index]
            mask &= TRUE
            self._first_masks[key] = mask
        return mask

    def restrict(self, st: Optional[St], formula: int) -> Optional[St]:
        if st is None:
            return None
        # most restrictions change no guard: a new dict is made only from the first one that changes
        # (no code changes a dict of properties in place once a state holds it)
        old = st.props
        props = None
        masks: dict = {}           # first_mask of each set of first iterations met here
        for i, (prop, guard) in enumerate(old.items()):
            first = prop.first
            mask = masks.get(first)
            if mask is None:
                mask = masks[first] = self.first_mask(first)
            g = guard & formula & mask
            if props is None:
                if g and g == guard:
                    continue
                props = dict(islice(old.items(), i))
            if g:
                props[prop] = g
        if props is not None:
            st.props = props
        return st

    def join(self, states, formulas: Optional[tuple] = None) -> Optional[St]:
        live = [s for s in states if s is not None and s.props]
        if not live:
            return None
        if len(live) == 1:
            return live[0]
        # a dict of properties met twice (states copied from one another, that changed none) is
        # OR-ed in once: the OR of a guard with itself is itself
        first = live[0].props
        others = []
        for s in live[1:]:
            if s.props is not first and all(s.props is not o for o in others):
                others.append(s.props)
        props = dict(first) if others else first
        for other in others:
            for p, g in other.items():
                old = props.get(p)
                props[p] = g if old is None else old | g
        env = dict(live[0].env)
        pair = formulas if len(live) == 2 else None
        for s in live[1:]:
            if s.env is live[0].env:
                continue
            for name, value in s.env.items():
                mine = env.get(name)
                if mine is None:
                    env[name] = value
                elif mine is not value:          # (a value merged with itself is itself)
                    env[name] = _merge_val(mine, value, pair)
        return St(props, env)

    # -- expressions ---------------------------------------------------------------------------------
    def expr(self, node, st: St, fr: Frame) -> EnvVal:
        return events.expr(self, node, st, fr)

    def _generator_context(self, s, fr):
        """An unknown sync control for a ``for`` over a project generator that yields inside a ``with``
        and says ``no_sync``; None for any other loop."""
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, (ast.Name, ast.Attribute))):
            return None
        key = ("generator context", id(s))
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = found = self._find_generator_context(s, it, fr)
        return found

    def _find_generator_context(self, s, it, fr):
        targets = self.program.syntactic_targets(it, fr.scope) or []
        for fn in targets:
            if not isinstance(fn, Function) or not self.values.info(fn).has_yield:
                continue
            text = fn.module.segment(fn.node) or ""
            if "sync" not in text:
                continue
            if any(isinstance(w, (ast.With, ast.AsyncWith)) and any(isinstance(n, (ast.Yield, ast.YieldFrom))
                                                                    for n in ast.walk(w))
                   for w in ast.walk(fn.node)):
                from synccheck.analyzer.project.events import FlowCtx, _text, _val
                return _val(frozenset((FlowCtx("unknown", frozenset(), site_of(fr.module, it), _text(fr, it)),)))
        return None

    def report_site(self, module, node):
        """Where to report an event that happened in a callee: the call, in the file of the loop that
        holds it, through which the loop reached it (a shared helper's ``loss.backward()`` is not the
        bug; the loop that calls it without sync control is)."""
        from synccheck.analyzer.project.values import site_of
        if self.loop_stack:
            loop_module, depth = self.loop_owner.get(self.loop_stack[-1], (module, len(self.call_stack)))
            if module is not loop_module and not loop_module.linted:
                # the loop is a context file's (a lint of single files): the call nearest to it in a
                # linted file, where the micro-step's code is (``engine.step(batch)`` run by a script)
                for caller_module, call in self.call_stack[depth:]:
                    if caller_module.linted:
                        site = site_of(caller_module, call)
                        self.records.node(site, caller_module, call)
                        return site
                best = enclosing_function(module, node)
                if best is not None and _loss_is_a_parameter(node, best):
                    # a shared helper handed the loop's loss (an optimizer wrapper's ``backward(loss)``):
                    # the micro-step is the context file's, and so is the finding (not reported here)
                    for caller_module, call in self.call_stack[depth:]:
                        site = site_of(caller_module, call)
                        self.records.node(site, caller_module, call)
                        return site
            elif module is not loop_module and not self._holds_the_micro_step(module, node) and \
                    not self._fills_the_hook(module, node, depth):
                for caller_module, call in reversed(self.call_stack[depth:]):
                    if caller_module is loop_module:
                        site = site_of(caller_module, call)
                        self.records.node(site, caller_module, call)
                        return site
            elif module is loop_module and len(self.call_stack) > depth and self.call_stack[depth][0] is module:
                best = enclosing_function(module, node)
                if best is not None and best.cls is None and _loss_is_a_parameter(node, best) and \
                        len(best.node.body) <= 6 and not any(
                        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
                        n.func.attr in ("step", "zero_grad") for n in best.nodes()):
                    # a small helper of the same file handed the loop's loss (``backward(loss, scaler)``
                    # with a scaler branch and a plain one): the finding is the loop's, at its call,
                    # once whichever branch runs
                    caller_module, call = self.call_stack[depth]
                    site = site_of(caller_module, call)
                    self.records.node(site, caller_module, call)
                    return site
        return site_of(module, node)

    def _holds_the_micro_step(self, module, node) -> bool:
        """Does the function of ``module`` holding the backward ``node`` make its own loss and step the
        optimizer when due (detectron2's ``AccumTrainer.run_step``, called by the base class's loop; a
        BasicSR-style ``optimize_parameters(..., apply_gradient)`` handed the loop's flag)? The
        micro-step is that function's: its backward is reported where it is. (A ``_backward(self,
        loss)`` helper handed the loop's loss, and a loss scaler handed ``update_grad=``, are reported
        at the loop's call.)"""
        best = enclosing_function(module, node)
        if best is None or not {"step", "backward"} <= self.program.fn_words(best):
            return False
        if _loss_is_a_parameter(node, best):
            return False
        # its own schedule: a test of its own (``(self.iter + 1) % self.accum_iters == 0``), not a
        # flag it was handed (a loss scaler's ``if update_grad:``)
        for stmt in walk_no_defs(best.node):
            if isinstance(stmt, ast.If) and "step" in self.program.words(stmt.body, best):
                return True
        return False

    def _fills_the_hook(self, module, node, depth: int) -> bool:
        """Is the backward ``node`` in a subclass's override of the hook the base class's loop calls on
        ``self`` (``loss = self.train_step(batch, is_accumulating)``, a Fabric trainer's ``train_step``
        making its own loss and backward in another file)? The micro-step's code, where its sync
        control goes, is the override's: reported there."""
        best = enclosing_function(module, node)
        if best is None or best.cls is None or _loss_is_a_parameter(node, best) or len(self.call_stack) <= depth:
            return False
        caller_module, call = self.call_stack[depth]
        func = getattr(call, "func", None)
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and
                func.attr == best.node.name):
            return False
        caller = enclosing_function(caller_module, call)
        return caller is not None and caller.cls is not None and caller.cls is not best.cls and \
            best.cls in self.project.subclasses(caller.cls)

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


def _loss_is_a_parameter(call, fn) -> bool:
    """Is the loss of this backward call (``loss.backward()``, ``scaler.scale(loss).backward()``,
    ``accelerator.backward(loss)``) one of ``fn``'s parameters: a helper handed the micro-step's loss?"""
    node = call.args[0] if call.args else (call.func.value if isinstance(call.func, ast.Attribute) else None)
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript, ast.BinOp)):
        if isinstance(node, ast.Call):
            node = node.args[0] if node.args else (node.func.value if isinstance(node.func, ast.Attribute) else None)
        elif isinstance(node, ast.BinOp):
            node = node.left
        else:
            node = node.value
    return isinstance(node, ast.Name) and node.id in fn.params


def _lightning_loop(fn) -> ast.For:
    """``for batch_idx, batch in enumerate(batches): <training_step's body>``: the loop Lightning runs
    around a manual-optimization ``training_step(self, batch, batch_idx)``."""
    node = fn.node
    batch, batch_idx = fn.params[1], fn.params[2]
    target = ast.Tuple([ast.Name(batch_idx, ast.Store()), ast.Name(batch, ast.Store())], ast.Store())
    iterated = ast.Call(ast.Name("enumerate", ast.Load()), [ast.Name("__lightning_batches__", ast.Load())], [])
    loop = ast.For(target=target, iter=iterated, body=node.body, orelse=[])
    for part in (loop, target, iterated) + tuple(target.elts) + (iterated.func,) + tuple(iterated.args):
        ast.copy_location(part, node)
        part.end_lineno, part.end_col_offset = node.end_lineno, node.end_col_offset
    return loop
