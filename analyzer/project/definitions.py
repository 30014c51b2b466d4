"""Stage 4 of the pipeline (project index), part 1: what one parsed file defines.

A ``Module`` is one file parsed with the stdlib ``ast``: its functions (``Function``, nested ones
included), classes (``Class``, with their base-class expressions and methods), module-level names,
and import bindings (``import x``, ``from .a import b``, star imports). Names resolve (resolution.py)
to a *symbol*: a ``Function`` or ``Class`` of an indexed module, a ``ModuleRef``, a ``GlobalRef`` (a
module-level variable), or an ``External`` qualified name the vocabulary understands.
"""
from __future__ import annotations

import ast
import zlib
from typing import Optional

from synccheck.analyzer.project.scopes import _names as _target_names
from synccheck.analyzer.project.traversal import walk, walk_no_defs

FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)


def _stable_hash(uid: str, node) -> int:
    """The same number in every run: sets of functions and classes (and of the values that hold them)
    are iterated in an order that does not depend on where the objects happen to sit in memory, so
    a cycle among attribute values is entered in the same order every time. Nor on where the project
    sits on the disk: only the last parts of the file's path count (a repository checked out in
    another folder gave other findings, HALOs' SC101)."""
    return zlib.crc32(f"{_path_tail(uid)}:{node.lineno}:{node.col_offset}".encode())


def _path_tail(path: str) -> str:
    """The last three parts of a path (``train/trainers.py:PPOTrainer.train`` of a uid)."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-3:])


class Function:
    """A function or method of an indexed module."""
    __slots__ = ("node", "module", "qualname", "cls", "parent", "params", "contextmanager", "uid", "locals",
                 "nested", "info", "_hash", "_nodes", "__weakref__")

    def __init__(self, node, module: "Module", qualname: str, cls: Optional["Class"], parent: Optional["Function"]):
        self.node = node
        self.module = module
        self.qualname = qualname
        self.cls = cls
        self.parent = parent
        args = node.args
        self.params = [a.arg for a in args.posonlyargs + args.args] + [a.arg for a in args.kwonlyargs]
        self.contextmanager = any(called_name(d) in ("contextmanager", "asynccontextmanager")
                                  for d in node.decorator_list)
        self.uid = f"{module.path}:{qualname}"
        self._hash = _stable_hash(self.uid, node)
        self.locals: Optional[set] = None       # names the function binds (filled by values.py on demand)
        self.nested: dict = {}                   # name -> Function defined inside this one
        self.info = None                         # what it binds (scopes.ScopeInfo, filled on demand)
        self._nodes: Optional[list] = None

    def nodes(self) -> list:
        """Every node of the function, its nested definitions not entered (``traversal.walk_no_defs``,
        walked once)."""
        if self._nodes is None:
            self._nodes = walk_no_defs(self.node)
        return self._nodes

    @property
    def is_method(self) -> bool:
        return self.cls is not None and self.parent is None and not any(
            called_name(d) == "staticmethod" for d in self.node.decorator_list)

    @property
    def is_property(self) -> bool:
        return self.cls is not None and any(called_name(d) in ("property", "cached_property")
                                            for d in self.node.decorator_list)

    @property
    def only_return(self):
        """The expression a function only returns (its body, past docstrings, is one ``return <expr>``:
        an accessor or a predicate); None otherwise."""
        body = [s for s in self.node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Return):
            return body[0].value
        return None

    @property
    def abstract(self) -> bool:
        """A hook for subclasses to fill: its body (past a docstring) only raises NotImplementedError
        (``def compute_forward(self, batch): raise NotImplementedError``). What a call runs is the
        override, which we may not see; the base's raise says nothing about it."""
        body = self.node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
            return False
        exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"

    @property
    def stub(self) -> bool:
        """A hook a base class leaves empty for its subclasses: its body (past a docstring) is only
        ``pass``, ``...`` or a bare ``return`` (``def train_one_step(self, ...): pass``)."""
        body = self.node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            body = body[1:]
        if len(body) != 1:
            return not body
        stmt = body[0]
        return isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                                              and stmt.value.value is Ellipsis) or \
            (isinstance(stmt, ast.Return) and (stmt.value is None or
                                               isinstance(stmt.value, ast.Constant) and stmt.value.value is None))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<Function {self.uid}>"


class Class:
    __slots__ = ("node", "module", "qualname", "methods", "uid", "bases", "mro", "attrs", "_hash", "__weakref__")

    def __init__(self, node: ast.ClassDef, module: "Module", qualname: str):
        self.node = node
        self.module = module
        self.qualname = qualname
        self.methods: dict = {}
        self.uid = f"{module.path}:{qualname}"
        self._hash = _stable_hash(self.uid, node)
        self.bases = None           # resolved once (Project.bases)
        self.mro = None
        self.attrs = None           # attr -> [(method, value, unpack path)] of self.attr = value (values.py)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<Class {self.uid}>"


class Module:
    """One parsed file."""

    def __init__(self, path: str, name: str, package: str, tree: ast.Module, text: str, linted: bool) -> None:
        self.path = path
        self.name = name             # dotted module name, e.g. "engine" or "pkg.sub.mod"
        self.package = package       # for relative imports: "pkg.sub" ("" at the top)
        self.tree = tree
        self.text = text
        self.linted = linted
        self.on_demand = False       # parsed only because the analysis needed it (index.Project.importers)
        # a file that imports a linted one, read as context for a lint of single files (its training
        # loop may run the linted file's functions: their findings are the linted file's)
        self.context = False
        self._lines = None
        self.info = None             # what its top level binds (values.py fills it on demand)
        self.imports: dict = {}      # local name -> (module, attribute or None, level)
        self.stars: list = []        # (module, level) of ``from m import *``
        self.functions: dict = {}    # qualname -> Function (top level, methods, nested)
        self.classes: dict = {}      # qualname -> Class
        self.top: dict = {}          # top-level name -> Function | Class
        self.globals: dict = {}      # top-level name -> [value expressions]
        self.derived: dict = {}      # what the analysis read off the tree and text once, kept with them
        self._hash = zlib.crc32(_path_tail(path).encode())
        self._index()

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<Module {self.name} {self.path}>"

    def script_body(self) -> list:
        """The top level's statements, not the functions and classes it defines: what running the
        file as a script executes."""
        return [s for s in self.tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]

    def call_at(self, line: int, col: int) -> Optional[ast.Call]:
        """The call that starts at ``line``, ``col`` (a value's site), the outermost where calls share
        a start (``make(cfg)(model)``). The module's calls are indexed by position once."""
        calls = self.derived.get("calls by position")
        if calls is None:
            calls = self.derived["calls by position"] = {}
            for node in walk(self.tree):        # breadth first: an outer call before the calls it holds
                if isinstance(node, ast.Call):
                    calls.setdefault((node.lineno, node.col_offset), node)
        return calls.get((line, col))

    def segment(self, node) -> str:
        """The source text of a node (ast.get_source_segment splits the whole file at every call)."""
        lines = self._lines
        if lines is None:
            lines = self._lines = self.text.splitlines(keepends=True)
        try:
            first, last = node.lineno - 1, node.end_lineno - 1
            start, end = node.col_offset, node.end_col_offset
        except AttributeError:
            return ""
        if not 0 <= first <= last < len(lines):
            return ""
        if first == last:
            return _cut(lines[first], start, end)
        parts = [_cut(lines[first], start, None)] + lines[first + 1:last] + [_cut(lines[last], 0, end)]
        return "".join(parts)

    def _index(self) -> None:
        self._walk(self.tree.body, cls=None, parent=None, prefix="", top=True)

    def _walk(self, body, cls, parent, prefix: str, top: bool) -> None:
        for stmt in body:
            if isinstance(stmt, FUNCTION_TYPES):
                qual = prefix + stmt.name
                fn = Function(stmt, self, qual, cls, parent)
                self.functions.setdefault(qual, fn)
                if cls is not None and parent is None:
                    cls.methods.setdefault(stmt.name, fn)
                elif parent is not None:
                    parent.nested.setdefault(stmt.name, fn)
                elif top:
                    self.top[stmt.name] = fn
                self._walk(stmt.body, cls=None if parent is None and cls is None else cls, parent=fn,
                           prefix=qual + ".<locals>.", top=False)
            elif isinstance(stmt, ast.ClassDef):
                qual = prefix + stmt.name
                klass = Class(stmt, self, qual)
                self.classes.setdefault(qual, klass)
                if top:
                    self.top[stmt.name] = klass
                self._walk(stmt.body, cls=klass, parent=None, prefix=qual + ".", top=False)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self._import(stmt)
            else:
                if top and isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    for t in targets:
                        for name in _target_names(t):
                            self.globals.setdefault(name, []).append(stmt.value)
                # definitions and imports under if / try / with / for at any level
                for field in ("body", "orelse", "finalbody"):
                    block = getattr(stmt, field, None)
                    if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                        before = dict(self.top) if top and field == "orelse" and isinstance(stmt, ast.If) else None
                        self._walk(block, cls, parent, prefix, top)
                        if before is not None:
                            self._keep_the_fuller(before, stmt)
                for handler in getattr(stmt, "handlers", ()):
                    self._walk(handler.body, cls, parent, prefix, top)
                if isinstance(stmt, ast.Match):
                    for case in stmt.cases:
                        self._walk(case.body, cls, parent, prefix, top)
        return None

    def _keep_the_fuller(self, before: dict, stmt: ast.If) -> None:
        """A function defined on both sides of a module-level ``if`` (``if parallel_method == "DDP": def
        reduce_mean(t, n): dist.all_reduce(...)`` / ``else: def reduce_mean(t, n): return t``): one name,
        two bodies, and which runs is the configuration's. The fuller one is kept: a fallback that does
        nothing hides what the other side does (Ocean-E2E's all-reduce under a rank-0 test)."""
        body_defs = {n.name for n in stmt.body if isinstance(n, FUNCTION_TYPES)}
        for name in body_defs:
            first, now = before.get(name), self.top.get(name)
            if isinstance(first, Function) and isinstance(now, Function) and now is not first and \
                    _size(first.node) >= _size(now.node):
                self.top[name] = first

    def _import(self, stmt) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    self.imports.setdefault(alias.asname, (alias.name, None, 0))
                else:
                    head = alias.name.split(".")[0]
                    self.imports.setdefault(head, (head, None, 0))
            return
        module = stmt.module or ""
        for alias in stmt.names:
            if alias.name == "*":
                self.stars.append((module, stmt.level))
            else:
                self.imports.setdefault(alias.asname or alias.name, (module, alias.name, stmt.level))


def _cut(line: str, start, end) -> str:
    """A line cut at UTF-8 byte offsets (what ast's col_offset counts)."""
    if line.isascii():
        return line[start:end]
    data = line.encode("utf-8")
    return data[start:end].decode("utf-8", errors="replace")


def enclosing_function(module, node) -> Optional["Function"]:
    """The innermost function of ``module`` whose lines hold ``node``; None if none does."""
    line = getattr(node, "lineno", None)
    if module is None or line is None:
        return None
    best = None
    for fn in module.functions.values():
        start = fn.node.lineno
        if start <= line <= (fn.node.end_lineno or start) and (best is None or start >= best.node.lineno):
            best = fn
    return best


def is_super_call(node, method: str) -> bool:
    """Is ``node`` the call ``super().<method>(...)``?"""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method and \
        isinstance(node.func.value, ast.Call) and called_name(node.func.value) == "super"


def called_name(node) -> str:
    """The last name of a name or attribute, or of a call's callee: ``torch.no_grad()`` -> ``no_grad``,
    ``@dataclasses.dataclass`` -> ``dataclass``; "" for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


# ---------------------------------------------------------------------------------------------------
# Symbols

class External:
    """A name from outside the project: ``torch.nn.parallel.DistributedDataParallel``."""
    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __eq__(self, other) -> bool:
        return isinstance(other, External) and other.qualname == self.qualname

    def __hash__(self) -> int:
        return hash(("ext", self.qualname))

    def __repr__(self) -> str:
        return f"<External {self.qualname}>"


class ModuleRef:
    __slots__ = ("module",)

    def __init__(self, module: Module) -> None:
        self.module = module

    def __eq__(self, other) -> bool:
        return isinstance(other, ModuleRef) and other.module is self.module

    def __hash__(self) -> int:
        return hash(("mod", self.module.path))


class GlobalRef:
    """A module-level variable of an indexed module."""
    __slots__ = ("module", "name")

    def __init__(self, module: Module, name: str) -> None:
        self.module = module
        self.name = name


def qualified_name(symbol) -> str:
    """What the vocabulary matches: an external's name, or a project definition's full dotted name."""
    if isinstance(symbol, External):
        return symbol.qualname
    if isinstance(symbol, (Function, Class)):
        return f"{symbol.module.name}.{symbol.qualname}"
    if isinstance(symbol, ModuleRef):
        return symbol.module.name
    return ""


def _size(fn_node) -> int:
    return sum(1 for _ in ast.walk(fn_node))
