"""Stage 6 of the pipeline (sync dataflow): branches, a part of ``Flow``.

An ``if`` restricts the state to the paths where its test holds (its atoms, conditions.py), walks each
branch and joins them. Which tests take a place in the condition table decides what the rules can tell
apart: a test that only says whether the run is distributed, or a branch that only leaves before any
micro-step, takes none; a test of the model's class (``isinstance(model, FSDP)``) narrows what the
model is inside the branch.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.type_tests import DECIDED_KINDS, distributed_switch, tested_values, wrapper_type_test
from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.flow_state import Frame, St
from synccheck.analyzer.project.guards import TRUE, depends_on
from synccheck.analyzer.project.state import EnvVal
from synccheck.analyzer.project.values import Inst, Obj, Wrapper

_SYNC_TEXT = re.compile(r"no_sync|require_backward_grad_sync|set_requires_gradient_sync|disable_allreduce")


class Branches:
    """``if`` statements (a part of Flow)."""

    def if_(self, s: ast.If, st: St, fr: Frame):
        relevant = self.program.relevant_branch(s, fr) and not self._exit_outside_training(s, fr)
        true, false = self.conds.cond(self._without_switches(s, fr), st, fr, relevant)
        gate = relevant and self.program.decides_step(s, fr)
        if gate and fr.gate and not self._schedule_test(true or false):
            # a check inside the branch that steps (``if torch.isfinite(norm): optimizer.step()``) may
            # skip a step now and then; it is not the accumulation schedule: take the stepping branch
            # (unless the check is the schedule, a count modulo N or a loop's last turn, and the outer
            # branch a switch: ``if args.use_scaler: loss_scaler(...) else: loss.backward(); if
            # update_grad: optimizer.step()``)
            if self.program.steps_in(s.body, fr) and not self.program.steps_in(s.orelse, fr):
                true, false = TRUE, 0
            elif self.program.steps_in(s.orelse, fr) and not self.program.steps_in(s.body, fr):
                true, false = 0, TRUE
        if self.stable_atoms and true and false:
            # ``if self.accum_count == 1: optim.zero_grad()``: a switch that decides whether a
            # zero_grad runs at all (SC201 looks at the runs where it is on)
            text = fr.module.segment(s) or ""
            if "zero_grad" in text:
                for k in self.stable_atoms:
                    if depends_on(true, k) and k not in self.records.switches:
                        self.records.switches.add(k)
                        self.atom_info[k] = (self.atom_info.get(k, ((), True))[0], False)
        never_none = _none_test_decided(s.test, st)
        if never_none is not None and true and false:
            # ``if no_sync_func is None: no_sync_func = nullcontext`` where the caller handed
            # ``model.no_sync`` (Megatron's schedules): the test's side where it is None is not taken
            true, false = (TRUE, 0) if never_none else (0, TRUE)
        if true and false and fr.loops and fr.loops[-1].info.bound is not None and _out_of_data(s):
            # ``if not batch: break`` in ``for micro in range(accum):`` after filling a micro-batch from
            # an iterator: the data ran out in the middle of a window, the end of the run rather than a
            # schedule (a window cut short there is not what the step's boundary is written for)
            true, false = 0, TRUE
        if not s.orelse and true and false and distributed_switch(s.test) and _SYNC_TEXT.search(
                fr.module.segment(s) or ""):
            true, false = TRUE, 0       # the run with no data-parallel model has nothing to check
        outer_gate = fr.gate
        fr.gate = outer_gate or gate
        body_st = self.restrict(st.copy(), true) if true else None
        else_st = self.restrict(st.copy(), false) if false else None
        narrowed = self._narrow(s.test, body_st, else_st, fr)
        # ``if cfg.ACCUMULATION_STEPS > 1: ... else: ... % cfg.ACCUMULATION_STEPS == 0``: on the side
        # where the count is 1, a test modulo it always holds (conditions._fold)
        one, in_body = _count_is_one(s.test)
        body = self._with_one(s.body, body_st, fr, one if in_body else None) if true else None
        orelse = self._with_one(s.orelse, else_st, fr, one if in_body is False else None) if false else None
        fr.gate = outer_gate
        exact = (true & false) == 0 and (true | false) & self.atoms.universe == self.atoms.universe
        out = self.join([body, orelse], (true, false) if exact else None)
        if out is not None and body is not None and orelse is not None:
            _divided_on_one_side(s, body, orelse, out)
        if narrowed and out is not None:
            # ``if isinstance(model, DDP): sd = model.module.state_dict()`` says what the model is
            # inside the branch only: past it, the model is what it was (unless a branch rebinds it)
            stored = _stored_names(s)
            for name in narrowed:
                if name in stored:
                    continue
                if name in st.env:
                    out.env[name] = st.env[name]
                else:
                    out.env.pop(name, None)
        return out

    def _schedule_test(self, guard: int) -> bool:
        """Does the guard read a count modulo N or a loop's last turn (the accumulation schedule)?"""
        return any((atom.mod is not None or atom.loop is not None) and depends_on(guard, atom.index)
                   for atom in self.atoms.atoms)

    def _with_one(self, stmts, st, fr: Frame, one: Optional[str]):
        if one is None:
            return self.block(stmts, st, fr)
        fr.ones.append(one)
        try:
            return self.block(stmts, st, fr)
        finally:
            fr.ones.pop()

    def _exit_outside_training(self, s: ast.If, fr: Frame) -> bool:
        """``if dataset_n_tokens < minimum: raise ValueError(...)`` before the training loop, or ``if not
        isinstance(module, nn.Linear): continue`` in a loop over a model's modules: a branch whose only
        event is leaving, where no running loop does anything a micro-step does. What it decides is
        whether the run goes on at all, not which micro-steps step: it takes no atom (the table is
        small, and the training loop's own tests come after)."""
        program = self.program
        if (program.words(s.body, fr.scope) | program.words(s.orelse, fr.scope)) - {"call", "exit"}:
            return False
        if fr.no_grad:
            return True     # under ``torch.no_grad()`` (a feature-extraction pass): no micro-step here
        if len(self.loop_stack) > len(fr.loops):
            # a caller's loop is running: a ``return`` may skip what the rest of this function does,
            # unless it does nothing a micro-step does (a loss function's ``if self.loss_type == ...:
            # return ...``, where the model's forward is only a call)
            return isinstance(fr.scope, Function) and not (program.fn_words(fr.scope) - program.CALLS_ONLY)
        return not any(program.words(ctx.info.node.body, fr.scope) - program.CALLS_ONLY for ctx in fr.loops)

    def _narrow(self, test, body: Optional[St], orelse: Optional[St], fr: Frame) -> None:
        """``if isinstance(model, FSDP) and i < n - 1: ctx = model.no_sync``: inside the branch the model
        is an FSDP one, so a DDP model on the other paths is not the one ``no_sync`` names (open_lm);
        in the ``else`` of a lone test it is anything but. Wrappers whose kind is decided at run time
        (accelerate's) stay on both sides."""
        tests = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
        narrowed = []
        for c in tests:
            name, kinds = wrapper_type_test(self.values, c, fr.scope)
            if name is None:
                continue
            sides = ((body, True),) + (((orelse, False),) if len(tests) == 1 else ())
            for side, holds in sides:
                if side is None:
                    continue
                known = side.env.get(name) or EnvVal(((TRUE, tested_values(self.values, name, c, fr.scope)),))
                alts = tuple((g, frozenset(v for v in vals if self._kept_by_type_test(v, kinds, holds)))
                             for g, vals in known.alts)
                if alts != known.alts:
                    side.env[name] = known._replace(alts=alts)
                    narrowed.append(name)
        return narrowed

    def _kept_by_type_test(self, v, kinds: set, holds: bool) -> bool:
        """May ``v`` be on this side of ``isinstance(model, <kinds>)``? A wrapper, or an object the
        program knows is wrapped in place (``fully_shard(model)``), of a kind decided at build time."""
        wrappers = (v,) if isinstance(v, Wrapper) else self.program.wrappers(frozenset((v,))) \
            if isinstance(v, (Obj, Inst)) else ()
        return not wrappers or not all(w.kind in DECIDED_KINDS and (w.kind in kinds) != holds for w in wrappers)

    def _without_switches(self, s: ast.If, fr: Frame):
        """``if world_size > 1 and hasattr(model, "no_sync") and i < n - 1: return model.no_sync()``:
        the conjuncts that only say whether training is distributed hold wherever a sync control can
        matter; the test that is left is the one that picks the micro-steps."""
        test = s.test
        if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)):
            return test
        key = ("switchless", id(s))
        hit = self.memo.get(key)
        if hit is None or hit[0] is not s:
            kept = [v for v in test.values if not (distributed_switch(v) or _asks_for_no_sync(v))]
            new = test
            if kept and len(kept) < len(test.values) and any(
                    _SYNC_TEXT.search(fr.module.segment(b) or "") for b in s.body):
                new = kept[0] if len(kept) == 1 else ast.copy_location(ast.BoolOp(ast.And(), kept), test)
            hit = self.memo[key] = (s, new)
        return hit[1]


def _none_test_decided(test, st) -> Optional[bool]:
    """``x is None`` (False) / ``x is not None`` (True) where every value ``x`` may hold on this path is
    a known object that is not None; None when it may be None or is not known."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        return None
    known = st.env.get(test.left.id) if st is not None else None
    if known is None or not known.values:
        return None
    from synccheck.analyzer.project.events import FlowFactory
    if not all(isinstance(v, (FlowFactory, Wrapper)) for v in known.values):
        return None         # (only a sync control or a wrapper handed in is known not to be None)
    return isinstance(test.ops[0], ast.IsNot)


def _asks_for_no_sync(node) -> bool:
    """``hasattr(self.model, "no_sync")``: true exactly when the model is a DDP wrapper."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" and \
        len(node.args) == 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "no_sync"


def _stored_names(s: ast.If) -> set:
    """Names an ``if`` statement binds in its branches (an assignment, a loop target, a ``with ... as``)."""
    return {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


# a test of the accumulation count (``if gradient_accumulation_steps > 1: loss = loss / ...``): the
# undivided side is the run without accumulation
_COUNT_WORDS = re.compile(r"accum|grad_acc|update_freq|micro|gas\b|ga_steps|iters_to|sub_batch|n_chunks|num_chunks",
                          re.I)


def count_guard(test, divided) -> bool:
    """Does ``test`` ask about the count the statements ``divided`` divide by? A count word in it, or a
    term of it (a name, ``args.accum``, ``cfg["accum"]``) that their divisors name."""
    if _COUNT_WORDS.search(ast.unparse(test)):
        return True
    terms = {ast.unparse(n) for n in ast.walk(test) if isinstance(n, (ast.Name, ast.Attribute, ast.Subscript))}
    terms = {t for t in terms if not any(o != t and o.startswith(t) for o in terms)}   # ``args`` of ``args.x``
    means = {id(m) for d in divided for n in ast.walk(d) if isinstance(n, ast.BinOp) and _weighted_mean(n)
             for m in ast.walk(n)}
    divisors = [n.right for d in divided for n in ast.walk(d) if isinstance(n, ast.BinOp) and
                isinstance(n.op, (ast.Div, ast.FloorDiv, ast.Mult)) and id(n) not in means]
    divisors += [d.value for d in divided if isinstance(d, ast.AugAssign) and isinstance(d.op, (ast.Div, ast.Mult))]
    text = "\n".join(ast.unparse(d) for d in divisors)
    return any(re.search(r"(?<![\w.])" + re.escape(t) + r"(?![\w\[])", text) for t in terms)


def _weighted_mean(n: ast.BinOp) -> bool:
    """``(losses * weights).sum() / weights.sum()``: the mean of one micro-batch under its own weights,
    not a count of the window (its test, ``if weights is None``, is not about the accumulation)."""
    right = n.right
    if not (isinstance(n.op, ast.Div) and isinstance(right, ast.Call) and isinstance(right.func, ast.Attribute)
            and right.func.attr == "sum" and not right.args):
        return False
    weights = ast.unparse(right.func.value)
    return any(isinstance(m, ast.BinOp) and isinstance(m.op, ast.Mult) and weights in (ast.unparse(m.left), ast.unparse(m.right))
               for m in ast.walk(n.left))


def _divided_on_one_side(s: ast.If, body: St, orelse: St, out: St) -> None:
    """``if rank == 0 and i % log_every == 0: loss = loss / accum``: a loss divided on one side of a test
    that is not about the accumulation count stays undivided on the other side, where it reaches the
    backward all the same. (Divided on either side, the joined value counted as divided.)"""
    for name, value in list(out.env.items()):
        if value.scaled is not True:
            continue
        a, b = body.env.get(name), orelse.env.get(name)
        if a is None or b is None or {a.scaled, b.scaled} != {True, False}:
            continue
        side = s.body if a.scaled else s.orelse
        divided = [n for stmt in side for n in ast.walk(stmt) if isinstance(n, (ast.Assign, ast.AugAssign)) and
                   any(isinstance(t, ast.Name) and t.id == name
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        if divided and not count_guard(s.test, divided):
            out.env[name] = value._replace(scaled=False)


def _count_is_one(test) -> tuple:
    """(the count's text, True) when the test holds exactly where a count of at least 1 is 1
    (``accum == 1``, ``accum <= 1``, ``accum < 2``); (text, False) when it fails exactly there
    (``accum > 1``, ``accum >= 2``, ``accum != 1``); (None, None) otherwise."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) and
            type(test.comparators[0].value) is int and isinstance(test.left, (ast.Name, ast.Attribute))):
        return None, None
    op, n = type(test.ops[0]), test.comparators[0].value
    if (op, n) in ((ast.Eq, 1), (ast.LtE, 1), (ast.Lt, 2)):
        return ast.unparse(test.left), True
    if (op, n) in ((ast.Gt, 1), (ast.GtE, 2), (ast.NotEq, 1)):
        return ast.unparse(test.left), False
    return None, None


def _out_of_data(s: ast.If) -> bool:
    """``if not batch: break`` / ``if batch is None: break`` / ``if len(batch) == 0: break``: a loop
    left when a name filled from the data holds nothing."""
    if s.orelse or len(s.body) != 1 or not isinstance(s.body[0], ast.Break):
        return False
    test = s.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return isinstance(test.operand, ast.Name)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and len(test.comparators) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if isinstance(left, ast.Name) and isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
            return True
        return isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "len" and \
            len(left.args) == 1 and isinstance(left.args[0], ast.Name) and isinstance(op, ast.Eq) and \
            isinstance(right, ast.Constant) and right.value == 0
    return False
