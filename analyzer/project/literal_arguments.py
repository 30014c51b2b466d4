"""What a call's literal arguments decide in the function it calls (``evaluate=True``, ``rank=-1``):
the tests of the callee that those values fold (rank_branches.py reads a helper's collectives so)."""
from __future__ import annotations

import ast

from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.values import parameter_default


_UNKNOWN = object()


def _fallback_test(test, fn: Function) -> bool:
    """``if name is None:`` where the function first binds ``name = None`` and then binds it again
    inside a loop (a search that may find nothing)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is) and
            isinstance(test.left, ast.Name) and isinstance(test.comparators[0], ast.Constant) and
            test.comparators[0].value is None):
        return False
    name = test.left.id
    first = next((s for s in fn.node.body if isinstance(s, ast.Assign) and
                  any(isinstance(t, ast.Name) and t.id == name for t in s.targets)), None)
    if first is None or not (isinstance(first.value, ast.Constant) and first.value.value is None):
        return False
    return any(isinstance(loop, (ast.For, ast.While)) and any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        for n in ast.walk(loop)) for loop in fn.node.body)


def _functions_tested(fn: Function) -> list:
    """Names a function's tests read that are none of its own but the module's functions or classes:
    ``if args.local_rank not in [-1, 0] and not evaluate:`` once the parameter ``evaluate`` was renamed
    (BERT-NER-Pytorch) tests the module's function ``evaluate``, always true."""
    tests = [n.test for n in ast.walk(fn.node) if isinstance(n, (ast.If, ast.While))]
    if not tests:
        return []
    own = set(fn.params) | {n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    module = fn.module
    return [n.id for t in tests for n in ast.walk(t) if isinstance(n, ast.Name) and n.id not in own and (
        n.id in module.classes or n.id in module.functions and module.functions[n.id].parent is None)]


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
        elif value is _UNKNOWN and isinstance(node, _OBJECTS):
            # ``get_file(path, dest, object_store=logger)``: an object, for the callee's
            # ``if object_store is None:`` (composer); what else it is, we do not know
            out.append((name, _NOT_NONE))
    return frozenset(out)


_NOT_NONE = object()
_OBJECTS = (ast.Name, ast.Attribute, ast.Call, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr, ast.Lambda)


def _fold(node, binding: dict):
    """The value of a test given some names' values; _UNKNOWN when it depends on anything else.
    An ``and`` is false as soon as one operand is, an ``or`` true as soon as one is."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        value = binding.get(node.id, _UNKNOWN)
        return _UNKNOWN if value is _NOT_NONE else value
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) and \
            isinstance(node.left, ast.Name) and binding.get(node.left.id) is _NOT_NONE and \
            isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None:
        return isinstance(node.ops[0], ast.IsNot)
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
