"""Tests of what the model is and whether the job is distributed (a mixin of conditions.Conditions):
``isinstance(model, DDP)`` split by the paths where the name holds the wrapper, and ``if args.distributed:``
/ ``if world_size > 1:``, true exactly when training is distributed."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from typing import Optional

from synccheck.analyzer.parse import dotted

from synccheck.analyzer.project.guards import FALSE, TRUE

# wrapper kinds fixed when the wrapper is built (an accelerate or fabric model's is decided at run time)
DECIDED_KINDS = frozenset(("ddp", "fsdp", "fsdp2", "apex"))


_SWITCH = re.compile(r"(?:^|_)(?:ddp|distributed|dist|multi_gpu|data_parallel)(?:$|_)|is_initialized$")
_COUNT = re.compile(r"(?:^|_)(?:world_size|n_gpus?|num_gpus|ngpus?|nprocs|num_processes)$")


def distributed_switch(test) -> bool:
    """``if self.use_ddp or self.use_fsdp:``, ``if args.distributed:``, ``if world_size > 1:``,
    ``if dist.is_initialized():``: a test that is true exactly when training is distributed. Where
    it only guards a sync control, its false side is a run with no data-parallel model, where no
    sync rule has anything to say (FSDP and DeepSpeed switches are not this: they choose a wrapper)."""
    t = type(test)
    if t is ast.BoolOp:
        parts = [distributed_switch(v) for v in test.values]
        return any(parts) if isinstance(test.op, ast.Or) else all(parts)
    if t is ast.Call:
        test = test.func
        t = type(test)
    if t is ast.Name or t is ast.Attribute:
        return bool(_SWITCH.search((test.id if t is ast.Name else test.attr).lower()))
    if t is ast.Compare and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant):
        left, op, bound = test.left, test.ops[0], test.comparators[0].value
        name = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else ""
        return bool(_COUNT.search(name.lower())) and isinstance(bound, int) and (
            (isinstance(op, ast.Gt) and bound == 1) or (isinstance(op, ast.GtE) and bound == 2))
    return False


# a test of whether the job is distributed at all, read for the truth value it has there (facts.py: a
# DDP model's micro-steps hold where it does). Narrower than distributed_switch: not ``n_gpu > 1``,
# DataParallel's, one GPU per DDP process in the same scripts
_DISTRIBUTED_JOB = re.compile(r"distributed|is_initialized|is_dist\b|world_size|\bddp\b|use_ddp|use_dist", re.I)


@lru_cache(maxsize=4096)
def _distributed_value(text: str) -> Optional[bool]:
    """The truth value of a test (an atom's text) in a distributed job: ``args.distributed`` True,
    ``not dist.is_initialized()`` False, ``world_size == 1`` False; None for any other test
    (``ooms == world_size * len(samples)`` says nothing of the job)."""
    if not _DISTRIBUTED_JOB.search(text):
        return None
    try:
        test = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    return _job_test(test)


def _job_test(test) -> Optional[bool]:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _job_test(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and not test.args:
        name = test.func.attr if isinstance(test.func, ast.Attribute) else getattr(test.func, "id", "")
        return True if name in ("is_initialized", "is_distributed", "is_dist_avail_and_initialized") else None
    if isinstance(test, (ast.Name, ast.Attribute)):
        name = (test.attr if isinstance(test, ast.Attribute) else test.id).lstrip("_")
        return True if re.fullmatch(r"(?i)(?:args_)?(?:distributed|is_distributed|is_dist|ddp|use_ddp|use_dist|"
                                    r"use_distributed|dist_train|distributed_training)", name) else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) and \
            isinstance(test.left, (ast.Name, ast.Attribute, ast.Call)) and \
            re.search(r"(?i)world_size|num_processes", ast.unparse(test.left)):
        n, op = test.comparators[0].value, type(test.ops[0])
        if not isinstance(n, int) or isinstance(n, bool):
            return None
        if (op is ast.Gt and n == 1) or (op is ast.GtE and n == 2) or (op is ast.NotEq and n == 1):
            return True
        if (op is ast.Eq and n == 1) or (op is ast.Lt and n == 2) or (op is ast.LtE and n == 1):
            return False
    return None


def wrapper_type_test(values, test, scope) -> tuple:
    """(the name tested, the wrapper kinds of its classes) for ``isinstance(model, DDP)`` or
    ``isinstance(model, (FSDP, DDP))``; (None, set()) for any other test, or classes not all wrappers."""
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr" and \
            len(test.args) == 2 and isinstance(test.args[1], ast.Constant) and test.args[1].value == "module" and \
            isinstance(test.args[0], (ast.Name, ast.Attribute)) and dotted(test.args[0]):
        # ``if hasattr(model, "module"): model = model.module``: the wrappers that hold a module
        return dotted(test.args[0]), {"ddp", "fsdp"}
    if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" and
            len(test.args) == 2 and isinstance(test.args[0], (ast.Name, ast.Attribute))):
        return None, set()
    tested = dotted(test.args[0])       # ``model``, or ``self.model`` (apex's schedules)
    if tested is None:
        return None, set()
    from synccheck.analyzer.project import vocabulary as vocab
    from synccheck.analyzer.project.values import Ext, Tup
    classes = values.expr(test.args[1], scope)
    classes = frozenset(x for v in classes for x in (frozenset().union(*v.items) if isinstance(v, Tup) else (v,)))
    kinds = {vocab.wrapper_kind(v.qualname) if isinstance(v, Ext) else "" for v in classes}
    if not kinds or "" in kinds:
        return None, set()
    return tested, kinds


def tested_values(values, name: str, test, scope) -> frozenset:
    """What the name an ``isinstance`` test names holds where nothing on this path bound it."""
    if "." in name:
        return values.expr(test.args[0], scope)
    return values.name(name, scope, test.lineno)


def _text(fr, node) -> str:
    text = fr.module.segment(node) if hasattr(node, "lineno") else None
    return (text or ast.unparse(node)).strip()


class TypeTests:
    """The type tests of Conditions (needs ``self.flow`` and ``self.atoms``)."""

    def _type_test_by_paths(self, node: ast.Call, st, fr) -> Optional[tuple]:
        """``isinstance(model, DDP)`` where ``model`` is the wrapper on some paths and a plain module on
        the others (``if is_dist(): model = DDP(model)``): true exactly on the paths of the wrapper,
        not a test of its own (which would let a run be distributed with an unwrapped model)."""
        name, kinds = wrapper_type_test(self.flow.values, node, fr.scope)
        if name is None or not kinds <= {"ddp", "fsdp"}:
            return None
        from synccheck.analyzer.project.state import EnvVal
        from synccheck.analyzer.project.values import Inst, Obj, Unknown, Wrapper
        known = st.env.get(name)
        if known is None:
            known = EnvVal(((TRUE, tested_values(self.flow.values, name, node, fr.scope)),))
        wrappers = self.flow.program.wrappers
        split = []          # (guard, values of the kinds tested, the other values)
        for guard, values in known.alts:
            if not values:
                return None
            yes = frozenset(v for v in values if isinstance(v, Wrapper) and v.kind in kinds)
            no = frozenset(v for v in values if v not in yes and (
                isinstance(v, (Obj, Inst)) and not wrappers(frozenset((v,))) or
                # beside the wrapper tested, what a builder out of view made: the module it wraps
                yes and isinstance(v, (Obj, Unknown)) or
                # a wrapper of another kind decided when it was built (DDP where the FSDP test fails)
                isinstance(v, Wrapper) and v.kind in DECIDED_KINDS))
            if len(yes) + len(no) != len(values):
                return None
            split.append((guard, yes, no))
        if len(split) == 1 and not split[0][2]:
            return TRUE, FALSE      # one value on every path, the wrapper tested (``model = FSDP(model)``)
        true = false = FALSE
        for guard, yes, no in split:
            if yes:
                true |= guard
            if no:
                false |= guard
        if not true:
            if all(no and all(isinstance(v, Wrapper) and v.kind in DECIDED_KINDS for v in no) for _, _, no in split):
                # ``isinstance(model, FSDP)`` on a model that is a DDP wrapper on every path: false
                return FALSE, TRUE
            return None if len(split) == 1 else (true, false)
        if not true & false:
            return true, false
        # ``model`` may be FSDP or DDP on the same paths (a parameter, ``FSDP(m) if cfg.fsdp else
        # DDP(m)``): which one is a condition of its own, the same for the whole run, and the name's
        # values are split by it from here on (open_lm: the FSDP model under no_sync, the DDP one not).
        # The split is made again each time the test runs (a loop's next turn joins the values from
        # before the loop, not split yet)
        atom = self.atoms.get(("TYPE", name, tuple(sorted(kinds)), id(fr.scope)), _text(fr, node))
        if atom is None:
            return None
        self.flow.note_atom(atom, (), False, (name,))     # (the same on every turn of a loop)
        tested = self.flow.type_atoms.setdefault(atom.index, set())
        for _, yes, _ in split:
            tested |= yes
        on, off = self.atoms.formula(atom, True), self.atoms.formula(atom, False)
        alts = []
        true = false = FALSE
        for guard, yes, no in split:
            if yes and guard & on:
                alts.append((guard & on, yes))
                true |= guard & on
            if no and guard & off:
                alts.append((guard & off, no))
                false |= guard & off
        st.env[name] = known._replace(alts=tuple(alts))
        return true, false
