"""SC301's fact, from the project's values without the sync dataflow: collectives that only some ranks reach.

A rank test's branches must run the same collectives -- or the function must balance them, as the
download-first idiom does (``if rank not in (-1, 0): barrier()`` ... ``if rank == 0: barrier()``).
Helpers called under a rank test are followed, with the literal arguments of the call folded into the
helper's own rank tests (``zero_first(rank=-1)``).
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.values import Ext, Framework, parameter_default
from synccheck.analyzer.project.traversal import children, walk

RANK_NAME = re.compile(r"(?<![A-Za-z0-9])(rank|global_rank|local_rank|get_rank|node_rank|process_index|"
                       r"local_process_index|is_main_process|is_local_main_process|master_process|is_master|"
                       r"is_rank_zero|is_global_zero|is_world_process_zero|is_local_process_zero|main_process|"
                       r"is_main|rank_zero|is_master_process|is_chief|ddp_rank)(?![A-Za-z0-9])", re.I)
MAIN_WORDS = ("main", "master", "zero", "chief")
# a test of whether the job is distributed at all: false, there is one process
DISTRIBUTED_TEST = re.compile(r"distributed|is_initialized|is_dist|world_size|ddp|multi_gpu|n_gpu|num_gpus|"
                              r"num_processes|use_dist", re.I)


class RankCollective(NamedTuple):
    module: object
    node: object            # the collective, or the call that runs one
    what: str
    test_text: str
    through: bool


def collectives_in_rank_branches(program) -> list:
    out = []
    checker = _RankChecker(program)
    from synccheck.analyzer.rules.sc301 import CollectiveInRankBranch as rule
    for module in program.project.linted():
        if not (rule.wants(module.text) or rule.reaches(module.text)):
            continue
        scopes = [module] + list(module.functions.values())
        for scope in scopes:
            body = scope.node.body if isinstance(scope, Function) else \
                [s for s in module.tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            found: list = []
            checker.walk(body, None, None, scope, found)
            out.extend(_unbalanced(module, found))
    return out


def _unbalanced(module, found: list) -> list:
    """Collectives that one side of the rank tests runs more often than the other (the download-first
    idiom runs one barrier on each side, which balances)."""
    out = []
    kinds = {what for _, what, _, _, _ in found}
    for kind in kinds:
        main = [f for f in found if f[1] == kind and f[2] == "main"]
        other = [f for f in found if f[1] == kind and f[2] == "other"]
        if len(main) == len(other):
            continue
        extra = main if len(main) > len(other) else other
        for node, what, side, test, through in extra:
            out.append(RankCollective(module, node, what, test, through))
    return out


class _RankChecker:
    def __init__(self, program) -> None:
        self.program = program
        self.values = program.values
        self._runs: dict = {}

    def walk(self, stmts, side: Optional[str], test: Optional[str], scope, found: list) -> None:
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.If):
                on_true, on_false = self.sides(stmt.test, scope)
                if (on_true is not None or on_false is not None) and side is None:
                    text, negated = ast.unparse(stmt.test), _negation(stmt.test)
                    self.walk(stmt.body, on_true, text, scope, found)
                    self.walk(stmt.orelse, on_false, negated, scope, found)
                    body_exits, else_exits = _exits(stmt.body), _exits(stmt.orelse)
                    if body_exits and not else_exits:
                        # ``if not is_main: return``: the rest of the block runs on the other side only
                        # (``if not fsdp and not is_main: return``: on every rank when ``fsdp`` holds)
                        self.walk(stmts[i + 1:], on_false, negated, scope, found)
                        return
                    if else_exits and not body_exits:
                        self.walk(stmts[i + 1:], on_true, text, scope, found)
                        return
                    continue
                self._calls(stmt.test, side, test, scope, found)
                self.walk(stmt.body, side, test, scope, found)
                self.walk(stmt.orelse, side, test, scope, found)
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for field in ("test", "iter", "value", "exc", "subject"):
                node = getattr(stmt, field, None)
                if isinstance(node, ast.expr):
                    self._calls(node, side, test, scope, found)
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    self._calls(item.context_expr, side, test, scope, found)
            if isinstance(stmt, ast.Expr) or isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)):
                pass
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self.walk(block, side, test, scope, found)
            for handler in getattr(stmt, "handlers", ()):
                self.walk(handler.body, side, test, scope, found)

    def _calls(self, expr, side, test, scope, found: list) -> None:
        for node in walk(expr):
            if not isinstance(node, ast.Call):
                continue
            what = self.collective(node, scope)
            if what:
                found.append((node, what, side, test, False))
                continue
            if side is None:
                continue
            targets = self.program.syntactic_targets(node, scope)
            if targets is None:
                targets = self.program.call_targets(node, scope)
            for fn in targets:
                runs = self.runs(fn, _literal_arguments(node, fn, {}))
                if runs:
                    found.append((node, sorted(runs)[0], side, test, True))
                    break

    def collective(self, call: ast.Call, scope) -> Optional[str]:
        func = call.func
        if not isinstance(func, ast.Attribute):
            vals = self.values.expr(func, scope)
            for v in vals:
                if isinstance(v, Ext) and v.qualname.startswith("torch.distributed.") and \
                        vocab.tail(v.qualname) in vocab.COLLECTIVES:
                    return _kind(vocab.tail(v.qualname))
            return None
        attr = func.attr
        if attr not in vocab.COLLECTIVES and attr not in vocab.FRAMEWORK_COLLECTIVES:
            return None
        receiver = self.values.expr(func.value, scope)
        for v in receiver:
            if isinstance(v, Ext) and (v.qualname in ("torch.distributed", "torch.distributed.distributed_c10d")
                                       or v.qualname.endswith(".distributed")) and attr in vocab.COLLECTIVES:
                return _kind(attr)
            if isinstance(v, Framework) and attr in vocab.FRAMEWORK_COLLECTIVES:
                return _kind(attr)
        text = ast.unparse(func.value)
        if text in ("dist", "torch.distributed", "distributed") and attr in vocab.COLLECTIVES:
            return _kind(attr)
        if text.endswith(("accelerator", "fabric")) and attr in vocab.FRAMEWORK_COLLECTIVES:
            return _kind(attr)
        return None

    def runs(self, fn: Function, binding: frozenset = frozenset()) -> set:
        """The collectives a project function runs on every rank that calls it (transitively), given
        the literal values of some of its parameters (``evaluate=True``, ``rank=-1``): a branch whose
        test those values make false is not taken."""
        key = (fn.uid, binding)
        found = self._runs.get(key)
        if found is not None:
            return found
        self._runs[key] = set()
        out: set = set()
        self._runs_in(fn.node.body, fn, dict(binding), out)
        self._runs[key] = out
        return out

    def _runs_in(self, stmts, fn: Function, binding: dict, out: set) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, (ast.If, ast.While)) and binding:
                value = _fold(stmt.test, binding)
                value = value if value is _UNKNOWN else bool(value)
                self._runs_calls(stmt.test, fn, binding, out)
                if value is not False:
                    self._runs_in(stmt.body, fn, binding, out)
                if value is not True:
                    self._runs_in(stmt.orelse, fn, binding, out)
                continue
            for child in children(stmt):
                if isinstance(child, ast.stmt):
                    self._runs_in([child], fn, binding, out)
                elif isinstance(child, ast.excepthandler):
                    self._runs_in(child.body, fn, binding, out)
                elif isinstance(child, (ast.expr, ast.withitem)):
                    self._runs_calls(child, fn, binding, out)

    def _runs_calls(self, node, fn: Function, binding: dict, out: set) -> None:
        for call in walk(node):
            if not isinstance(call, ast.Call):
                continue
            what = self.collective(call, fn)
            if what:
                out.add(what)
                continue
            for callee in self.program.syntactic_targets(call, fn) or ():
                if callee is not fn:
                    out |= self.runs(callee, _literal_arguments(call, callee, binding))

    def sides(self, test, scope) -> tuple:
        """(ranks where the test holds, ranks where it does not): "main", "other" or None (no
        restriction: every rank may be there)."""
        on_true, on_false = self._sides(test, scope, 0)
        if on_true == on_false:
            return None, None
        return _ranks(on_true), _ranks(on_false)

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
            parts = [self._sides(v, scope, depth + 1) for v in test.values]
            trues, falses = [p[0] for p in parts], [p[1] for p in parts]
            if isinstance(test.op, ast.Or):
                # ``not a or not b`` is ``not (a and b)``
                trues, falses = falses, trues
            # an ``and`` holds only where each of its parts that names the ranks holds; it fails
            # wherever any part fails, so only where every part fails on the same side
            on_true = _agree([t for t in trues if t is not None])
            on_false = _agree(falses) if all(f is not None for f in falses) else None
            if isinstance(test.op, ast.Or):
                on_true, on_false = on_false, on_true
            if "main" not in (on_true, on_false) and "other" not in (on_true, on_false):
                return None, None
            return on_true, on_false
        if isinstance(test, ast.Name) and not _main_name(test.id):
            value, where = self._bound(test, scope)
            if value is not None:
                return self._sides(value, where, depth + 1)
        pol = self.polarity(test, scope, depth)
        if pol is not None:
            return pol, _flip(pol)
        if DISTRIBUTED_TEST.search(ast.unparse(test)):
            return None, "single"
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
            if not RANK_NAME.search(ast.unparse(left)):
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
        return None

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
        body = [s for s in method.node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
            return body[0].value, method
        return None

    def _stored_once(self, klass, attr: str):
        """``self.can_checkpoint = self.is_local_main if ... else self.is_main``: the one expression the
        class's methods store in the attribute, with the method that stores it; None otherwise."""
        found = []
        for method in klass.methods.values():
            if not method.params:
                continue
            for node in ast.walk(method.node):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    if isinstance(target, ast.Attribute) and target.attr == attr and \
                            isinstance(target.value, ast.Name) and target.value.id == method.params[0]:
                        found.append((node.value, method))
        return found[0] if len(found) == 1 else None

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


_UNKNOWN = object()


def _literal_arguments(call: ast.Call, fn: Function, outer: dict) -> frozenset:
    """The literal values a call gives the callee's parameters: its constant arguments, names the
    caller knows the value of, and the literal defaults of the parameters it does not pass."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return frozenset()
    a = fn.node.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if fn.is_method and positional:
        positional = positional[1:]
    values: dict = {}
    for name in positional + [p.arg for p in a.kwonlyargs]:
        default = parameter_default(fn.node, name)
        if default is not None:
            values[name] = default
    for name, arg in zip(positional, call.args):
        values[name] = arg
    for kw in call.keywords:
        values[kw.arg] = kw.value
    out = []
    for name, node in values.items():
        value = _fold(node, outer)
        if value is not _UNKNOWN and isinstance(value, (bool, int, str, type(None), tuple)):
            out.append((name, value))
    return frozenset(out)


def _fold(node, binding: dict):
    """The value of a test given some names' values; _UNKNOWN when it depends on anything else.
    An ``and`` is false as soon as one operand is, an ``or`` true as soon as one is."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return binding.get(node.id, _UNKNOWN)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = tuple(_fold(e, binding) for e in node.elts)
        return _UNKNOWN if any(i is _UNKNOWN for i in items) else items
    if isinstance(node, ast.UnaryOp):
        v = _fold(node.operand, binding)
        if v is _UNKNOWN:
            return _UNKNOWN
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.USub) and isinstance(v, (int, float)):
            return -v
        return _UNKNOWN
    if isinstance(node, ast.BoolOp):
        stop = isinstance(node.op, ast.Or)
        result = not stop
        for v in node.values:
            value = _fold(v, binding)
            if value is _UNKNOWN:
                result = _UNKNOWN
            elif bool(value) == stop:
                return stop
        return result
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _fold(node.left, binding), _fold(node.comparators[0], binding)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        op = node.ops[0]
        try:
            if isinstance(op, (ast.Eq, ast.Is)):
                return left == right
            if isinstance(op, (ast.NotEq, ast.IsNot)):
                return left != right
            if isinstance(op, ast.In):
                return left in right
            if isinstance(op, ast.NotIn):
                return left not in right
            if isinstance(op, ast.Lt):
                return left < right
            if isinstance(op, ast.LtE):
                return left <= right
            if isinstance(op, ast.Gt):
                return left > right
            if isinstance(op, ast.GtE):
                return left >= right
        except TypeError:
            return _UNKNOWN
    return _UNKNOWN


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


def _agree(sides: list) -> Optional[str]:
    """The one side all of these are on ("single" is the main rank), else None."""
    found = {"main" if s == "single" else s for s in sides}
    if len(found) != 1 or None in found:
        return None
    return "single" if all(s == "single" for s in sides) else found.pop()


def _ranks(side: Optional[str]) -> Optional[str]:
    return side if side in ("main", "other") else None


def _is_const(node) -> bool:
    return isinstance(node, ast.Constant) or (isinstance(node, (ast.List, ast.Tuple, ast.Set)) and all(
        isinstance(e, (ast.Constant, ast.UnaryOp)) for e in node.elts)) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def _zeroish(node) -> Optional[bool]:
    """True for 0, [0], [-1, 0] (the main rank, or no distribution); None for anything else."""
    if isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool):
        return True
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


def _exits(stmts) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))
