"""What one function (or a module's top level) binds, read once from its ``ast``.

The value analysis asks "what can ``model`` hold here?"; the answer starts from every place the
scope binds the name: assignments (with their tuple-unpacking path), ``for`` and ``with ... as``
targets, parameters, ``self.x = ...`` attribute stores. Nested functions and classes are scopes of
their own and are not entered.
"""
from __future__ import annotations

import ast
from typing import NamedTuple, Optional

from synccheck.analyzer.project.traversal import walk

FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPE_TYPES = FUNCTION_TYPES + (ast.ClassDef, ast.Lambda)


class ScopeInfo:
    __slots__ = ("assigns", "for_names", "with_as", "self_attrs", "obj_attrs", "calls", "returns", "has_yield",
                 "declared_global", "locals", "inplace_wraps", "set_epoch_calls", "spans", "loops", "where", "fors", "item_stores", "imports",
                 "imports_more", "annotated", "first_args", "helper_calls")

    def __init__(self) -> None:
        self.assigns: dict = {}          # name -> [(value expr, unpack path)]
        self.for_names: set = set()
        self.with_as: dict = {}          # name -> [context expr]
        self.self_attrs: dict = {}       # attr -> [(value expr, unpack path)]   (self.attr = value)
        self.obj_attrs: list = []        # (receiver expr, attr, value expr, unpack path)
        self.calls: list = []            # every call node, in source order
        self.returns: list = []          # return value expressions
        self.has_yield = False
        self.declared_global: set = set()
        self.locals: set = set()
        self.inplace_wraps: list = []    # (name, call) for ``fully_shard(model)`` as a statement
        self.helper_calls: list = []     # (name, call) for ``apply_fsdp(model)``, a plain call as a statement
        self.spans: dict = {}            # name -> [Span], one per entry of assigns[name], same order
        self.loops: list = []            # (first line, last line) of every loop in the scope
        self.where = None                # the statement being read (while reading)
        self.fors: dict = {}             # name -> [(iterated expr, unpack path)]   (for name in expr)
        self.item_stores: dict = {}      # name -> [(key or None, value expr)]   (name[key] = value)
        self.imports: dict = {}          # name -> (module, attribute or None, level): imports in the body
        self.imports_more: dict = {}     # name -> the other imports of it (one per branch of a dispatch)
        self.annotated: dict = {}        # name -> the annotation of ``name: T = value``
        self.first_args = None           # name -> [(target, call)] for ``target = f(name, ...)`` (on demand)

    def reaching(self, name: str, line: int) -> Optional[tuple]:
        """Which of ``assigns[name]`` can reach a use of the name on ``line``: (their indexes, whether
        an earlier binding hides the parameter), or None when all of them can (and the parameter too). An assignment that runs on every path before the
        use (not under a branch or a loop) hides the ones before it: after
        ``model = accelerator.prepare(model)`` the name is the wrapper, not the module it was."""
        spans = self.spans.get(name)
        if not spans:
            return None
        loops = [loop for loop in self.loops if loop[0] <= line <= loop[1]]

        def carried(span) -> bool:       # bound later in a loop around the use: reaches it next turn
            return any(first <= span.first and span.last <= last for first, last in loops)

        kill = None
        for i, span in enumerate(spans):
            if span.always and span.last < line and (kill is None or span.first > spans[kill].first):
                kill = i
        out = []
        for i, span in enumerate(spans):
            if kill is not None and i != kill and span.first <= spans[kill].last and not carried(span):
                continue
            if span.last < line or carried(span):
                out.append(i)
        if kill is None and len(out) == len(spans):
            return None
        return tuple(out), kill is not None


ITEM = ("item",)    # the unpack path of a value stored into a container attribute (``self.d[k] = v``)


class Span(NamedTuple):
    first: int       # the binding statement's lines
    last: int
    always: bool     # runs whenever the scope runs this far: not under a branch, a loop or a handler


def _import(info, local: str, spec: tuple) -> None:
    """Bind ``local`` to an import; a name imported again (``if kind == "gan": from .gan import Model
    as M`` ... ``elif ...: from .vae import Model as M``) keeps each import as an alternative."""
    known = info.imports.get(local)
    if known is None:
        info.imports[local] = spec
    elif known != spec and spec not in info.imports_more.get(local, ()):
        info.imports_more.setdefault(local, []).append(spec)


def scope_info(body: list, params: list, self_name: Optional[str]) -> ScopeInfo:
    info = ScopeInfo()
    info.locals.update(params)
    _statements(body, info, self_name, True)
    info.locals -= info.declared_global
    return info


def _statements(body, info: ScopeInfo, self_name, always: bool) -> None:
    for stmt in body:
        info.where = Span(stmt.lineno, getattr(stmt, "end_lineno", None) or stmt.lineno, always)
        if isinstance(stmt, FUNCTION_TYPES) or isinstance(stmt, ast.ClassDef):
            info.locals.add(stmt.name)
            for deco in stmt.decorator_list:
                _expr(deco, info)
            continue
        if isinstance(stmt, ast.Assign):
            _expr(stmt.value, info)
            for target in stmt.targets:
                _bind(target, stmt.value, (), info, self_name)
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                _expr(stmt.value, info)
                _bind(stmt.target, stmt.value, (), info, self_name)
                if isinstance(stmt.target, ast.Name):
                    info.annotated[stmt.target.id] = stmt.annotation
            elif isinstance(stmt.target, ast.Name):
                info.locals.add(stmt.target.id)
        elif isinstance(stmt, ast.AugAssign):
            _expr(stmt.value, info)
            if isinstance(stmt.target, ast.Name):
                info.locals.add(stmt.target.id)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            _expr(stmt.iter, info)
            for name in _names(stmt.target):
                info.for_names.add(name)
                info.locals.add(name)
            _bind_for(stmt.target, stmt.iter, (), info)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                _expr(item.context_expr, info)
                if item.optional_vars is not None:
                    for name in _names(item.optional_vars):
                        info.with_as.setdefault(name, []).append(item.context_expr)
                        info.locals.add(name)
        elif isinstance(stmt, ast.Return):
            if stmt.value is not None:
                _expr(stmt.value, info)
                info.returns.append(stmt.value)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                local = alias.asname or alias.name.split(".")[0]
                info.locals.add(local)
                _import(info, local, (alias.name, None, 0) if alias.asname else (local, None, 0))
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if alias.name != "*":
                    local = alias.asname or alias.name
                    info.locals.add(local)
                    _import(info, local, (stmt.module or "", alias.name, stmt.level))
        elif isinstance(stmt, ast.Global):
            info.declared_global.update(stmt.names)
        elif isinstance(stmt, ast.Expr):
            _expr(stmt.value, info)
            call = stmt.value
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Name):
                func = call.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name in ("fully_shard", "replicate"):
                    info.inplace_wraps.append((call.args[0].id, call))
                elif isinstance(func, ast.Name):
                    info.helper_calls.append((call.args[0].id, call))
        else:
            for field in ("test", "value", "exc", "subject", "msg"):
                node = getattr(stmt, field, None)
                if isinstance(node, ast.expr):
                    _expr(node, info)
        for field in ("body", "orelse", "finalbody"):
            block = getattr(stmt, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                _statements(block, info, self_name, always and _unconditional(stmt, field))
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            info.loops.append((stmt.lineno, stmt.end_lineno or stmt.lineno))
        for handler in getattr(stmt, "handlers", ()):
            if handler.name:
                info.locals.add(handler.name)
            _statements(handler.body, info, self_name, False)
        if isinstance(stmt, ast.Match):
            for case in stmt.cases:
                _statements(case.body, info, self_name, False)


class AttributeStores:
    """What ``scope_info`` reads of attribute stores, read alone: ``self_attrs`` and ``obj_attrs`` of
    the scope's ScopeInfo, from the same statements in the same order (assignments only; nested
    functions and classes are not entered, nor are expressions, where no attribute is stored)."""
    __slots__ = ("self_attrs", "obj_attrs")

    def __init__(self, body: list, self_name: Optional[str]) -> None:
        self.self_attrs: dict = {}
        self.obj_attrs: list = []
        self._statements(body, self_name)

    def _statements(self, body, self_name) -> None:
        for stmt in body:
            t = type(stmt)
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef:
                continue
            if t is ast.Assign:
                for target in stmt.targets:
                    self._target(target, stmt.value, (), self_name)
            elif t is ast.AnnAssign:
                if stmt.value is not None:
                    self._target(stmt.target, stmt.value, (), self_name)
            elif t is ast.Expr or t is ast.Return or t is ast.AugAssign or t is ast.Pass or t is ast.Import or \
                    t is ast.ImportFrom:
                continue
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self._statements(block, self_name)
            for handler in getattr(stmt, "handlers", ()):
                self._statements(handler.body, self_name)
            if isinstance(stmt, ast.Match):
                for case in stmt.cases:
                    self._statements(case.body, self_name)

    def _target(self, target, value, path: tuple, self_name) -> None:
        """The attribute parts of ``_bind``."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for i, el in enumerate(target.elts):
                if not isinstance(el, ast.Starred):
                    self._target(el, value, path + (i,), self_name)
        elif isinstance(target, ast.Attribute):
            _store_attribute(target, value, path, self_name, self)
        elif isinstance(target, ast.Starred):
            self._target(target.value, value, path, self_name)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and not path and \
                self_name and isinstance(target.value.value, ast.Name) and target.value.value.id == self_name:
            self.self_attrs.setdefault(target.value.attr, []).append((value, ITEM))


def scope_attribute_stores(scope):
    """The attribute stores of a function or module (project.definitions): its ScopeInfo when that
    was read already (it has the same ``self_attrs`` and ``obj_attrs``), else an AttributeStores."""
    if scope.info is not None:
        return scope.info
    node = getattr(scope, "node", None)
    if node is None:
        return AttributeStores(scope.tree.body, None)
    return AttributeStores(node.body, scope.params[0] if scope.is_method and scope.params else None)


def _unconditional(stmt, field: str) -> bool:
    """Does this block of ``stmt`` run whenever ``stmt`` does? (``with`` bodies, ``try`` bodies and
    ``finally``, the body of ``if __name__ == "__main__":``.)"""
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return True
    if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
        return field in ("body", "finalbody")
    if isinstance(stmt, ast.If) and field == "body":
        test = stmt.test
        return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
    return False


def _store_attribute(target: ast.Attribute, value, path: tuple, self_name, into) -> None:
    """``self.x = v`` into ``into.self_attrs``, ``obj.x = v`` into ``into.obj_attrs`` (a ScopeInfo or an
    AttributeStores)."""
    if self_name and isinstance(target.value, ast.Name) and target.value.id == self_name:
        into.self_attrs.setdefault(target.attr, []).append((value, path))
    else:
        into.obj_attrs.append((target.value, target.attr, value, path))


def _bind(target, value, path: tuple, info: ScopeInfo, self_name) -> None:
    if isinstance(target, ast.Name):
        info.assigns.setdefault(target.id, []).append((value, path))
        info.spans.setdefault(target.id, []).append(info.where)
        info.locals.add(target.id)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for i, el in enumerate(target.elts):
            if isinstance(el, ast.Starred):
                for name in _names(el.value):
                    info.locals.add(name)
                continue
            _bind(el, value, path + (i,), info, self_name)
    elif isinstance(target, ast.Attribute):
        _store_attribute(target, value, path, self_name, info)
    elif isinstance(target, ast.Starred):
        _bind(target.value, value, path, info, self_name)
    elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and not path:
        key = target.slice.value if isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str) \
            else None
        info.item_stores.setdefault(target.value.id, []).append((key, value))
    elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and not path and \
            self_name and isinstance(target.value.value, ast.Name) and target.value.value.id == self_name:
        # ``self.modules[name] = DDP(module)``: an element of the container ``self.modules``
        info.self_attrs.setdefault(target.value.attr, []).append((value, ITEM))


def _bind_for(target, iterated, path: tuple, info: ScopeInfo) -> None:
    if isinstance(target, ast.Name):
        info.fors.setdefault(target.id, []).append((iterated, path))
    elif isinstance(target, (ast.Tuple, ast.List)):
        for i, el in enumerate(target.elts):
            _bind_for(el, iterated, path + (i,), info)


def _names(target) -> list:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for el in target.elts for n in _names(el)]
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return []


def _expr(node, info: ScopeInfo) -> None:
    """Calls (for the call-site index), yields and walrus bindings of an expression; lambdas and
    comprehensions' own scopes are still walked for calls (a call is a call wherever it sits)."""
    for sub in walk(node):
        t = type(sub)
        if t is ast.Call:
            info.calls.append(sub)
        elif t is ast.NamedExpr and isinstance(sub.target, ast.Name):
            info.assigns.setdefault(sub.target.id, []).append((sub.value, ()))
            info.spans.setdefault(sub.target.id, []).append(Span(sub.lineno, sub.end_lineno or sub.lineno, False))
            info.locals.add(sub.target.id)
        elif t in (ast.Yield, ast.YieldFrom):
            info.has_yield = True
