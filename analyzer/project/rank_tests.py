"""Rank tests (a part of SC301's checker): which side of a test only some ranks take.

``if rank == 0:``, ``if accelerator.is_main_process:``, ``if not args.local_rank in (-1, 0):`` and the
rank tests behind a property, an accessor or an attribute stored once: ``sides`` says which branch
only the main rank runs ("main"), which only the others ("others"), or neither.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.index import Function

# (``args.lora_rank``, ``low_rank``: a matrix rank, a hyper-parameter the same on every process)
RANK_NAME = re.compile(r"(?<![A-Za-z0-9])(?<!lora_)(?<!low_)(?<!adapter_)(?<!svd_)(?<!matrix_)(?<!per_)"
                       r"(?!rank_(?:gradient|batch|update|loss|size|steps?|buffer|samples?)(?![A-Za-z0-9]))(rank|global_rank|local_rank|get_rank|node_rank|process_index|"
                       r"local_process_index|is_main_process|is_local_main_process|master_process|is_master|"
                       r"is_rank_zero|is_global_zero|is_world_process_zero|is_local_process_zero|main_process|"
                       r"is_main|rank_zero|is_master_process|is_chief|ddp_rank|is_global_main|is_local_main|is_global_master|"
                       r"is_local_master|is_main_rank|is_master_rank|is_rank0|is_rank_0|is_main_worker|is_root_worker|"
                       r"is_local_root_worker|is_root_process|is_root_rank|"
                       # (timm's ``utils.is_primary(args)``, copied into many training scripts)
                       r"is_primary|is_global_primary|is_local_primary)(?![A-Za-z0-9])",
                       re.I)
MAIN_WORDS = ("main", "master", "zero", "chief", "root", "primary")
# a process's rank number, tested as a truth value
_RANK_NUMBER = re.compile(r"(?:^|[._])(?:rank|global_rank|local_rank|get_rank|get_local_rank|node_rank|process_index|"
                          r"local_process_index|ddp_rank)$", re.I)
# a test of whether the job is distributed at all: false, there is one process
DISTRIBUTED_TEST = re.compile(r"distributed|is_initialized|is_dist|world_size|ddp|multi_gpu|n_gpu|num_gpus|"
                              r"num_processes|use_dist", re.I)
# a test of how the job was launched, the same on every rank (``accelerator.distributed_type ==
# DistributedType.DEEPSPEED``, ``args.deepspeed``)
_LAUNCH_TEST = re.compile(r"deepspeed", re.I)


class RankTests:
    """How _RankChecker reads rank tests (it holds ``program``, ``values`` and ``_attribute_stores``)."""

    def sides(self, test, scope) -> tuple:
        """(ranks where the test holds, ranks where it does not): "main", "other" or None (no
        restriction: every rank may be there)."""
        return _ranked(self._sides(test, scope, 0))

    def _sides(self, test, scope, depth: int) -> tuple:
        # a third value, "single": the job is not distributed (``not args.distributed``,
        # ``world_size == 1``): the one process is the main rank, and no collective can hang there.
        # It only ever joins a real rank test (``distributed and rank != 0``).
        if depth > 6:
            return None, None
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            on_true, on_false = self._sides(test.operand, scope, depth + 1)
            return on_false, on_true
        if isinstance(test, ast.BoolOp):
            # (a test of how the job was launched, ``distributed_type == DistributedType.DEEPSPEED``,
            # says nothing of the ranks nor of whether the job is distributed)
            texts = [ast.unparse(v) for v in test.values]
            launch = [bool(_LAUNCH_TEST.search(t)) and not RANK_NAME.search(t) for t in texts]
            parts = [(None, None) if launched else
                     ("single", None) if _absent_object(v, texts) else self._sides(v, scope, depth + 1)
                     for v, launched in zip(test.values, launch)]
            trues, falses = [p[0] for p in parts], [p[1] for p in parts]
            if isinstance(test.op, ast.Or):
                # ``not a or not b`` is ``not (a and b)``
                trues, falses = falses, trues
            # an ``and`` holds only where each of its parts that names the ranks holds; it fails
            # wherever any part fails, so only where every part fails on the same side
            on_true = _agree([t for t in trues if t is not None])
            if "single" in trues:
                on_true = "single"      # ``local_rank in [-1, 0] and local_rank == -1``: not distributed
            on_false = _agree(falses) if all(f is not None for f in falses) else None
            if isinstance(test.op, ast.Or):
                on_true, on_false = on_false, on_true
            if isinstance(test.op, ast.Or) and (on_true, on_false) == (None, "other") and any(
                    _LAUNCH_TEST.search(t) for t in texts):
                # ``if accelerator.distributed_type == DistributedType.DEEPSPEED or is_main_process:``
                # (diffusers' checkpoint guard): every rank enters under DeepSpeed, only the main rank
                # otherwise -- a launch setting, the same on every rank. What the block runs for every
                # rank under DeepSpeed (``save_state``) is fine; a barrier there waits alone otherwise.
                on_true = "main"
            if not {"main", "other", "single"} & {on_true, on_false}:
                # (``local_rank == -1 and evaluate_during_training``: still a test of a job that is
                # not distributed, which a rank branch around it must see)
                return None, None
            return on_true, on_false
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot)) and \
                _is_none(test.comparators[0]):
            # ``if writer is not None:`` with ``writer = SummaryWriter(...) if rank == 0 else None``
            made = self._none_unless(test.left, scope, depth, callers=True)
            if made is not None:
                on_true, on_false = self._sides(made[0], made[1], depth + 1)
                return (on_true, on_false) if isinstance(test.ops[0], ast.IsNot) else (on_false, on_true)
        if isinstance(test, ast.Name) and not _main_name(test.id):
            value, where = self._bound(test, scope)
            read = self._sides(value, where, depth + 1) if value is not None else (None, None)
            if read == (None, None):
                made = self._none_unless(test, scope, depth)
                if made is not None:
                    read = self._sides(made[0], made[1], depth + 1)
            if read != (None, None):
                return read
            # (a parameter, ``if not world_size:``: its name may still say what it tests, below)
        if isinstance(test, ast.IfExp) and (_is_none(test.orelse) or _is_none(test.body)) and \
                not (_is_none(test.orelse) and _is_none(test.body)):
            # ``if writer:`` with ``writer = SummaryWriter(...) if rank == 0 else None``: an object
            # where the test holds, None elsewhere
            on_true, on_false = self._sides(test.test, scope, depth + 1)
            return (on_true, on_false) if _is_none(test.orelse) else (on_false, on_true)
        if _no_rank(test):
            # ``args.local_rank == -1``: the job is not distributed
            return ("single", None) if isinstance(test.ops[0], (ast.Eq, ast.In, ast.Is)) else (None, "single")
        pol = self.polarity(test, scope, depth)
        if pol is not None:
            return pol, _flip(pol)
        if DISTRIBUTED_TEST.search(ast.unparse(test)):
            return _single_side(test)
        return None, None

    def polarity(self, test, scope, depth: int = 0) -> Optional[str]:
        """"main" when the test holds on the main rank only, "other" when on every rank but it."""
        if depth > 6:
            return None
        if isinstance(test, ast.BoolOp) or (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)):
            return _ranks(self._sides(test, scope, depth)[0])
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right, op = test.left, test.comparators[0], test.ops[0]
            if _is_const(left) and not _is_const(right):
                left, right = right, left
                op = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(), ast.GtE: ast.LtE()}.get(type(op), op)
            if not RANK_NAME.search(ast.unparse(left)) and not self._rank_valued(left, scope):
                return None
            if isinstance(left, ast.BinOp) and not isinstance(left.op, ast.Mod):
                return None
            zeroish = _zeroish(right)
            if zeroish is None:
                return None
            if isinstance(op, (ast.Eq, ast.In, ast.Is)) or (isinstance(op, ast.LtE) and zeroish):
                return "main"
            if isinstance(op, (ast.NotEq, ast.NotIn, ast.IsNot)) or (isinstance(op, ast.Gt) and zeroish):
                return "other"
            return None
        if isinstance(test, ast.IfExp):
            # ``a if fs_is_local else b``: a rank test when both cases are the same one
            body, orelse = self.polarity(test.body, scope, depth + 1), self.polarity(test.orelse, scope, depth + 1)
            return body if body == orelse else None
        if isinstance(test, (ast.Name, ast.Attribute, ast.Call)):
            node = test.func if isinstance(test, ast.Call) else test
            text = ast.unparse(node)
            if _main_name(text):
                return "main"
            if isinstance(test, ast.Name):
                value, where = self._bound(test, scope)
                if value is not None:
                    return self.polarity(value, where, depth + 1)
            returned = self._accessor_return(node, scope)
            if returned is not None:
                return self.polarity(returned[0], returned[1], depth + 1)
            helper = self._helper_return(test.func, scope) if isinstance(test, ast.Call) else None
            if helper is not None:
                # (what the helper's return says, when it says something: ``get_rank()`` returning
                # ``dist.get_rank() if dist.is_initialized() else 0`` is still a rank, below)
                pol = self.polarity(helper[0], helper[1], depth + 1)
                if pol is not None:
                    return pol
            if _RANK_NUMBER.search(text) or (not isinstance(test, ast.Call) and self._rank_valued(test, scope)):
                # ``if rank:`` / ``if not rank:`` with ``rank = get_rank()``: a rank as a truth value
                # holds on every rank but 0
                return "other"
        return None

    def _rank_valued(self, node, scope, depth: int = 0) -> bool:
        """``device_id = int(os.environ["LOCAL_RANK"])``, ``self.gpu = dist.get_rank()``: a name or an
        attribute of ``self`` bound once to a process rank, whatever it is called (``self.device_id =
        device_id`` in ``__init__``: what every construction hands it)."""
        value = None
        if isinstance(node, ast.Name):
            value = self._bound(node, scope)[0]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                isinstance(scope, Function) and scope.cls is not None and scope.params and \
                node.value.id == scope.params[0]:
            stored = self._stored_once(scope.cls, node.attr)
            value = stored[0] if stored is not None else None
            if isinstance(value, ast.Name) and stored[1].node.name == "__init__" and value.id in stored[1].params \
                    and depth < 2:
                return self._handed_a_rank(stored[1], value.id, depth)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "int" and \
                len(value.args) == 1:
            value = value.args[0]
        return isinstance(value, (ast.Call, ast.Subscript, ast.Attribute)) and _rank_source(value)

    def _handed_a_rank(self, fn, name: str, depth: int) -> bool:
        """Does a call of ``fn`` hand parameter ``name`` a process rank (``Trainer(..., device_id, ...)``
        with ``device_id = int(os.environ["LOCAL_RANK"])``), and none a number other than -1 or 0?
        (Scripts written for an older signature may hand that place something else.)"""
        from synccheck.analyzer.project.value_helpers import _argument
        index = fn.params.index(name)
        handed = False
        for caller, call, shift in self.values.callers(fn):
            arg = _argument(call, fn, name, index, shift)
            if isinstance(arg, ast.Constant) and arg.value not in (-1, 0, None):
                return False
            if arg is not None and (RANK_NAME.search(ast.unparse(arg)) or self._rank_valued(arg, caller, depth + 1)):
                handed = True
        return handed

    def _helper_return(self, func, scope):
        """``is_primary(args)`` where the project's ``is_primary`` only returns an expression
        (``is_local_primary(args) if local else is_global_primary(args)``, ``args.rank == 0``):
        (that expression, the function)."""
        if not isinstance(func, ast.Name) or scope is None:
            return None
        module = scope.module if isinstance(scope, Function) else scope
        found = self.program.project.resolve(module, func.id)
        if not isinstance(found, Function):
            return None
        returned = found.only_return
        return (returned, found) if returned is not None else None

    def _accessor_return(self, node, scope):
        """``self.can_checkpoint`` where the class defines ``can_checkpoint`` as a property (or a method
        called without arguments) that only returns an expression: (that expression, the method)."""
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and
                isinstance(scope, Function) and scope.cls is not None and scope.params and
                node.value.id == scope.params[0]):
            return None
        method = self.program.project.attribute(scope.cls, node.attr)
        if not isinstance(method, Function):
            return self._stored_once(scope.cls, node.attr)
        returned = method.only_return
        return (returned, method) if returned is not None else None

    def _stored_once(self, klass, attr: str):
        """``self.can_checkpoint = self.is_local_main if ... else self.is_main``: the one expression the
        class's methods store in the attribute, with the method that stores it; None otherwise."""
        table = self._attribute_stores.get(klass.uid)
        if table is None:
            # every ``self.x = ...`` of the class's methods, read once per class (a test class of
            # thousands of lines is asked about many attributes)
            table = self._attribute_stores[klass.uid] = {}
            for method in klass.methods.values():
                if not method.params:
                    continue
                for node in ast.walk(method.node):
                    if isinstance(node, ast.Assign) and len(node.targets) == 1:
                        target = node.targets[0]
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                                target.value.id == method.params[0]:
                            table.setdefault(target.attr, []).append((node.value, method))
        found = table.get(attr, ())
        return found[0] if len(found) == 1 else None

    def _none_unless(self, node, scope, depth: int, callers: bool = False):
        """(test, its scope) when ``node`` is None exactly where the test fails: a name bound to
        ``X if test else None``, or (``callers``: for ``x is not None``, not for every ``if flag:``,
        which would ask for the callers of every function that tests a parameter) a parameter every
        caller passes such a name."""
        if depth > 4 or not isinstance(node, ast.Name):
            return None
        value, where = self._bound(node, scope)
        if value is None and callers and _MAIN_ONLY_OBJECT.search(node.id) and isinstance(scope, Function) and \
                node.id in scope.params and \
                not any(isinstance(n, ast.Name) and n.id == node.id and isinstance(n.ctx, ast.Store)
                        for n in ast.walk(scope.node)):
            from synccheck.analyzer.project.value_helpers import _argument
            index = scope.params.index(node.id)
            made = None
            for caller, call, shift in self.values.callers(scope):
                arg = _argument(call, scope, node.id, index, shift)
                found = self._none_unless(arg, caller, depth + 1, callers) if arg is not None else None
                if found is None or (made is not None and ast.dump(found[0]) != ast.dump(made[0])):
                    return None
                made = found
            return made
        if isinstance(value, ast.IfExp) and _is_none(value.orelse) and not _is_none(value.body):
            return value.test, where
        return None

    def _bound(self, name: ast.Name, scope) -> tuple:
        """(the expression a name is bound to unconditionally, its scope), or (None, None)."""
        if isinstance(scope, Function):
            for value, path in self.values.info(scope).assigns.get(name.id, ()):
                if not path:
                    return value, scope
        module = self.values.module_of(scope)
        for value in module.globals.get(name.id, ()):
            return value, module
        return None, None


# what a script makes on the main rank only and hands around as None elsewhere (asking the callers of
# every function that tests an optional parameter for None would cost more than it finds)
_MAIN_ONLY_OBJECT = re.compile(r"writer|logger|board|tb|wandb|tracker|pbar|progress|summary|experiment|visual",
                               re.I)


def _rank_source(node) -> bool:
    """``os.environ["LOCAL_RANK"]``, ``os.getenv("RANK", 0)``, ``dist.get_rank()``, ``args.local_rank``."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
            "env" in ast.unparse(node.func):
        key = node.args[0]
    elif isinstance(node, ast.Call):
        return not node.args and isinstance(node.func, ast.Attribute) and node.func.attr in ("get_rank", "get_local_rank")
    else:
        return bool(RANK_NAME.search(node.attr)) and "rank" in node.attr.lower()
    return isinstance(key, ast.Constant) and key.value in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID",
                                                            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def _absent_object(part, texts: list) -> bool:
    """``accelerator is None`` beside ``accelerator.is_main_process`` in one test: no accelerator, no
    ranks (a run that is not distributed), where the other part reads the ranks off that object."""
    if not (isinstance(part, ast.Compare) and len(part.ops) == 1 and isinstance(part.ops[0], ast.Is) and
            _is_none(part.comparators[0]) and isinstance(part.left, (ast.Name, ast.Attribute))):
        return False
    owner = ast.unparse(part.left) + "."
    return any(t.startswith(owner) and RANK_NAME.search(t[len(owner):]) or t.startswith(owner) and _main_name(t)
               for t in texts)


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _kind(name: str) -> str:
    if name in ("barrier", "monitored_barrier", "wait_for_everyone"):
        return "barrier"
    return name


def _flip(pol: Optional[str]) -> Optional[str]:
    return {"main": "other", "other": "main"}.get(pol)


def _negation(test) -> str:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return ast.unparse(test.operand)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _NEGATED:
        return ast.unparse(ast.Compare(test.left, [_NEGATED[type(test.ops[0])]()], test.comparators))
    inner = ast.unparse(test)
    return f"not ({inner})" if isinstance(test, (ast.BoolOp, ast.Compare)) else f"not {inner}"


_NEGATED = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
            ast.IsNot: ast.Is}


def _main_name(text: str) -> bool:
    last = text.rsplit(".", 1)[-1].lower()
    return bool(RANK_NAME.search(last)) and any(w in last for w in MAIN_WORDS)


def _single_side(test) -> tuple:
    """The side of a test of the job (``args.distributed``, ``world_size > 1``) where it is not
    distributed: the false one, but the true one of ``world_size is None``, ``world_size == 1``,
    ``n_gpu < 2``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant):
        op, value = test.ops[0], test.comparators[0].value
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in (0, 1)):
            if isinstance(op, (ast.Is, ast.Eq)):
                return "single", None
            if isinstance(op, ast.LtE) and value == 1:
                return "single", None
        elif isinstance(op, ast.Lt) and value == 2:
            return "single", None
    return None, "single"


def _agree(sides: list) -> Optional[str]:
    """The one side all of these are on ("single" is the main rank), else None."""
    found = {"main" if s == "single" else s for s in sides}
    if len(found) != 1 or None in found:
        return None
    return "single" if all(s == "single" for s in sides) else found.pop()


def _ranked(read: tuple) -> tuple:
    """RankTests.sides from what ``_sides`` read: "single" is no side of the ranks."""
    on_true, on_false = read
    if on_true == on_false:
        return None, None
    return _ranks(on_true), _ranks(on_false)


def _ranks(side: Optional[str]) -> Optional[str]:
    return side if side in ("main", "other") else None


def _no_rank(test) -> bool:
    """``local_rank == -1``, ``args.local_rank != -1``, ``rank in [-1]``: a rank name against -1 alone."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and RANK_NAME.search(ast.unparse(test.left))):
        return False
    right = test.comparators[0]
    if isinstance(right, (ast.List, ast.Tuple, ast.Set)) and len(right.elts) == 1:
        right = right.elts[0]
    try:
        value = ast.literal_eval(right)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    # (``rank == "cpu"``: a run on the CPU alone, as particleflow spells its single process)
    return (value == -1 and not isinstance(value, bool) or value in ("cpu", "mps")) and isinstance(
        test.ops[0], (ast.Eq, ast.In, ast.Is, ast.NotEq, ast.NotIn, ast.IsNot))


def _is_const(node) -> bool:
    return isinstance(node, ast.Constant) or (isinstance(node, (ast.List, ast.Tuple, ast.Set)) and all(
        isinstance(e, (ast.Constant, ast.UnaryOp)) for e in node.elts)) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def _zeroish(node) -> Optional[bool]:
    """True for 0, [0], [-1, 0] (the main rank, or no distribution); None for anything else."""
    if isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool):
        return True
    if isinstance(node, ast.Constant) and node.value == "0":
        return True         # ``os.environ.get("RANK", "0") == "0"``: the environment's string
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        vals = []
        for e in node.elts:
            try:
                vals.append(ast.literal_eval(e))
            except ValueError:
                return None
        if 0 in vals and all(v in (0, -1) for v in vals):
            return True
    return None
