"""Stage 4 of the pipeline: the project index.

The linted files, and the modules of the same project they import (sibling modules, packages,
relative imports: found on the file system, parsed with the stdlib ``ast``, never imported), with
their functions, classes (and base classes) and import bindings. Real training code spreads one loop
over files: ``main.py`` wraps the model and calls ``engine.train_one_epoch``; the index is what lets
the analysis follow it.

Names resolve to a *symbol*: a function or class of some indexed module, a module, or an external
qualified name (``torch.nn.parallel.DistributedDataParallel``) that the vocabulary understands.
Import cycles, missing modules, star imports and two files with the same module name are all
ordinary here: resolution keeps a visited set and a missing module is simply external.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Iterable, Optional

from synccheck.analyzer.project.vocabulary import FRAMEWORK_PACKAGES

# Modules loaded only to resolve imports (not linted): at most this many, each at most this big.
MAX_CONTEXT_MODULES = 400
_INSTALLED = re.compile(r"[/\\\\](?:site|dist)-packages[/\\\\]")
MAX_CONTEXT_BYTES = 2_000_000
FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)


class Function:
    """A function or method of an indexed module."""
    __slots__ = ("node", "module", "qualname", "cls", "parent", "params", "contextmanager", "uid", "locals",
                 "nested", "info", "__weakref__")

    def __init__(self, node, module: "Module", qualname: str, cls: Optional["Class"], parent: Optional["Function"]):
        self.node = node
        self.module = module
        self.qualname = qualname
        self.cls = cls
        self.parent = parent
        args = node.args
        self.params = [a.arg for a in args.posonlyargs + args.args] + [a.arg for a in args.kwonlyargs]
        self.contextmanager = any(_decorator_name(d) in ("contextmanager", "asynccontextmanager")
                                  for d in node.decorator_list)
        self.uid = f"{module.path}:{qualname}"
        self.locals: Optional[set] = None       # names the function binds (filled by values.py on demand)
        self.nested: dict = {}                   # name -> Function defined inside this one
        self.info = None                         # what it binds (scopes.ScopeInfo, filled on demand)

    @property
    def is_method(self) -> bool:
        return self.cls is not None and self.parent is None and not any(
            _decorator_name(d) == "staticmethod" for d in self.node.decorator_list)

    def __repr__(self) -> str:
        return f"<Function {self.uid}>"


class Class:
    __slots__ = ("node", "module", "qualname", "methods", "uid", "bases", "mro", "attrs", "__weakref__")

    def __init__(self, node: ast.ClassDef, module: "Module", qualname: str):
        self.node = node
        self.module = module
        self.qualname = qualname
        self.methods: dict = {}
        self.uid = f"{module.path}:{qualname}"
        self.bases = None           # resolved once (Project.bases)
        self.mro = None
        self.attrs = None           # attr -> [(method, value, unpack path)] of self.attr = value (values.py)

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
        self._lines = None
        self.info = None             # what its top level binds (values.py fills it on demand)
        self.imports: dict = {}      # local name -> (module, attribute or None, level)
        self.stars: list = []        # (module, level) of ``from m import *``
        self.functions: dict = {}    # qualname -> Function (top level, methods, nested)
        self.classes: dict = {}      # qualname -> Class
        self.top: dict = {}          # top-level name -> Function | Class
        self.globals: dict = {}      # top-level name -> [value expressions]
        self._index()

    def __repr__(self) -> str:
        return f"<Module {self.name} {self.path}>"

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
                        self._walk(block, cls, parent, prefix, top)
                for handler in getattr(stmt, "handlers", ()):
                    self._walk(handler.body, cls, parent, prefix, top)
                if isinstance(stmt, ast.Match):
                    for case in stmt.cases:
                        self._walk(case.body, cls, parent, prefix, top)
        return None

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


def _decorator_name(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _target_names(target) -> list:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for el in target.elts for n in _target_names(el)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


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


# ---------------------------------------------------------------------------------------------------

class Project:
    """The indexed modules, and module resolution on the file system."""

    def __init__(self, roots: Iterable[str] = (), filesystem: bool = True) -> None:
        self.filesystem = filesystem     # False: resolve only among the modules added (one text alone)
        self.by_path: dict = {}
        self.by_name: dict = {}          # dotted name -> [Module]
        # folders an absolute import may start from, beyond each file's own folder and package root
        # (see imports.module_paths): a folder inside a package adds nothing its package root does not
        dirs = dict.fromkeys(os.path.abspath(r if os.path.isdir(r) else os.path.dirname(r) or ".") for r in roots)
        self.roots = [d for d in dirs if not os.path.isfile(os.path.join(d, "__init__.py"))] or list(dirs)[:1]
        self._find_cache: dict = {}
        self._resolved: dict = {}
        self.context_loaded = 0
        self.errors: list = []           # (path, message) for context modules that could not be read
        self._classes_by_base: Optional[dict] = None
        # files of the lint set not parsed yet: parsed when an import, a caller or a subclass is looked
        # for in them (abspath -> (path, text or None)); their findings are reported like the others
        self.catalog: dict = {}
        self._catalog_imports: dict = {}
        self._importers_done: set = set()
        self._importer_index: Optional[tuple] = None
        self.truncated: set = set()      # importers() queries that matched too many files to parse
        self._searched: set = set()
        self.version = 0                 # bumped at every module added: indexes over modules refresh

    def offer(self, path: str, text: Optional[str] = None, imports: Optional[list] = None) -> None:
        """Make a file of the lint set available, to be parsed only if the analysis needs it.
        ``imports``: its import lines (imports.imported_names), to find who imports a module."""
        apath = os.path.abspath(path)
        if apath not in self.by_path:
            self.catalog[apath] = (path, text)
            if imports is not None:
                self._catalog_imports[apath] = imports

    def importers(self, module: Module, words: tuple = ()) -> list:
        """Parse the catalogued files that import ``module`` (or its package, which may re-export it)
        and, when ``words`` are given, mention one of them: where the callers of a function named so,
        or the subclasses of a class named so, can be. A file that does not import a module cannot
        call into it; one that never writes a function's name cannot call it by that name."""
        key = (module.path, words)
        if key in self._importers_done:
            return []
        self._importers_done.add(key)
        if not self._catalog_imports:
            return []
        from synccheck.analyzer.imports import module_paths
        targets = {os.path.abspath(module.path)}
        if not module.path.endswith("__init__.py"):
            init = os.path.join(os.path.dirname(os.path.abspath(module.path)), "__init__.py")
            if os.path.exists(init):
                targets.add(init)
        if self._importer_index is None:
            self._importer_index = self._index_importers()
        by_name, by_path = self._importer_index
        candidates = {a for t in targets for a in by_path.get(t, ())}
        for t in targets:
            # ``import a.b.c`` may name t from any folder above it: look the dotted names up
            stem = t[:-len("/__init__.py")] if t.endswith("/__init__.py") else t[:-3]
            parts = stem.split(os.sep)
            for i in range(max(1, len(parts) - 12), len(parts)):
                for a in by_name.get(".".join(parts[i:]), ()):
                    if a not in candidates and t in module_paths(a, 0, ".".join(parts[i:]), self.roots):
                        candidates.add(a)
        chosen = []
        for apath in [a for a in self._catalog_imports if a in candidates and a in self.catalog]:
            if words:
                text = self.catalog_text(apath)
                if text is None or not any(w in text for w in words):
                    continue
            chosen.append(apath)
        if words and len(chosen) > MAX_IMPORTERS:
            # a name used all over a code base (a library's base class, ``forward``) is not the
            # model's path into a training loop: parsing every user of it would cost more than the
            # analysis it feeds
            self.truncated.add(key)
            return []
        out = []
        for apath in chosen:
            found = self._from_catalog(apath)
            if found is not None:
                out.append(found)
        return out

    def _index_importers(self) -> tuple:
        """The catalogued files by the dotted names they import (absolute imports) and by the files
        their relative imports may load: built once, so asking for the importers of many modules costs
        one pass over the import lines, not one per module."""
        from synccheck.analyzer.imports import module_paths
        by_name: dict = {}
        by_path: dict = {}
        for apath, imports in self._catalog_imports.items():
            for level, name in imports:
                if level == 0:
                    by_name.setdefault(name, set()).add(apath)
                else:
                    for c in module_paths(apath, level, name, self.roots):
                        by_path.setdefault(c, set()).add(apath)
        return by_name, by_path

    def load_matching(self, word: str) -> list:
        """Parse the catalogued files whose text holds ``word`` (a callee's or a class's name)."""
        if word in self._searched or not self.catalog:
            return []
        self._searched.add(word)
        out = []
        for apath in list(self.catalog):
            if apath not in self.catalog:
                continue
            text = self.catalog_text(apath)
            if text is not None and word in text:
                module = self._from_catalog(apath)
                if module is not None:
                    out.append(module)
        return out

    def catalog_text(self, apath: str) -> Optional[str]:
        """A catalogued file's text, read on first use; a file that cannot be read leaves the catalog."""
        path, text = self.catalog[apath]
        if text is None:
            text = _read_text(apath)
            if text is None:
                del self.catalog[apath]
                return None
            self.catalog[apath] = (path, text)
        return text

    def _from_catalog(self, apath: str) -> Optional[Module]:
        path, text = self.catalog.pop(apath)
        if text is None:
            text = _read_text(apath)
            if text is None:
                return None
        try:
            tree = ast.parse(text, path)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        return self.add(path, text, tree, linted=True)

    # -- adding modules -----------------------------------------------------------------------------
    def add(self, path: str, text: str, tree: ast.Module, linted: bool = True) -> Module:
        apath = os.path.abspath(path)
        name, package = module_name(apath)
        module = Module(path, name, package, tree, text, linted)
        self.by_path[apath] = module
        self.by_name.setdefault(name, []).append(module)
        self._classes_by_base = None
        self._resolved.clear()
        self.catalog.pop(apath, None)
        self.version += 1
        return module

    def modules(self) -> list:
        return list(self.by_path.values())

    def close(self) -> None:
        """Break the references between modules, classes and functions, so that reference counting
        frees every tree as soon as the analysis lets go of the project (no collector pass)."""
        for module in self.by_path.values():
            for klass in module.classes.values():
                klass.methods.clear()
                klass.bases = klass.mro = klass.attrs = None
            for fn in module.functions.values():
                fn.nested.clear()
                fn.parent = None
                fn.info = None
            module.info = None
            module.functions.clear()
            module.classes.clear()
            module.top.clear()
        self._classes_by_base = None

    def linted(self) -> list:
        return [m for m in self.by_path.values() if m.linted]

    def _load(self, apath: str) -> Optional[Module]:
        if apath in self.by_path:
            return self.by_path[apath]
        if apath in self.catalog:
            return self._from_catalog(apath)
        if not self.filesystem:
            return None
        if self.context_loaded >= MAX_CONTEXT_MODULES or _INSTALLED.search(apath):
            return None     # an installed third-party package is not the project: not read as context
        self.context_loaded += 1
        try:
            if os.path.getsize(apath) > MAX_CONTEXT_BYTES:
                return None
            with open(apath, "rb") as fh:
                data = fh.read()
            from synccheck.analyzer.source import decode_source
            text, error = decode_source(apath, data)
            if error is not None:
                return None
            tree = ast.parse(text, apath)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        return self.add(apath, text, tree, linted=False)

    # -- module resolution --------------------------------------------------------------------------
    def find_module(self, importer: Module, name: str, level: int = 0) -> Optional[Module]:
        """The indexed (or indexable) module ``import name`` means in ``importer``, or None."""
        if not self.filesystem:
            found = self.by_name.get(name) if not level else None
            return found[0] if found else None
        if level:
            here = os.path.dirname(os.path.abspath(importer.path))
            for _ in range(level - 1):
                here = os.path.dirname(here)
            return self._find_file(here, name.split(".") if name else [])
        if not name or name.partition(".")[0] in FRAMEWORK_PACKAGES:
            return None
        key = (importer.path, name)
        if key in self._find_cache:
            path = self._find_cache[key]
            return self._load(path) if path else None
        found = None
        for root in self._search_roots(importer):
            found = self._find_path(root, name.split("."))
            if found:
                break
        self._find_cache[key] = found
        return self._load(found) if found else None

    def _find_file(self, directory: str, parts: list) -> Optional[Module]:
        path = self._find_path(directory, parts) if parts else _init_file(directory)
        return self._load(path) if path else None

    @staticmethod
    def _find_path(root: str, parts: list) -> Optional[str]:
        base = os.path.join(root, *parts)
        if os.path.isfile(base + ".py"):
            return os.path.abspath(base + ".py")
        init = _init_file(base)
        return init

    def _search_roots(self, importer: Module) -> list:
        """Where ``import x`` may find x: the importer's own folder (a script's folder is on sys.path),
        the root its package hangs from, the folders being linted, and the project root (and its src/)."""
        here = os.path.dirname(os.path.abspath(importer.path))
        roots = [here]
        depth = importer.name.count(".")
        top = here
        for _ in range(depth):
            top = os.path.dirname(top)
        if top not in roots:
            roots.append(top)
        for r in self.roots:
            if r not in roots:
                roots.append(r)
        project = project_root(here)
        if project:
            for r in (project, os.path.join(project, "src")):
                if r not in roots and os.path.isdir(r):
                    roots.append(r)
        return roots

    # -- names ---------------------------------------------------------------------------------------
    def resolve(self, module: Module, name: str, _seen: Optional[set] = None):
        """The symbol a module-level name stands for: Function, Class, ModuleRef, GlobalRef, External or None."""
        if _seen is None:
            key = (module.path, name)
            if key in self._resolved:
                return self._resolved[key]
            found = self._resolve(module, name, set())
            self._resolved[key] = found
            return found
        return self._resolve(module, name, _seen)

    def _resolve(self, module: Module, name: str, seen: set):
        key = (module.path, name)
        if key in seen:
            return None
        seen.add(key)
        if name in module.top:
            return module.top[name]
        if name in module.imports:
            mod, attr, level = module.imports[name]
            if attr is None:
                target = self.find_module(module, mod, level)
                return ModuleRef(target) if target is not None else External(mod)
            target = self.find_module(module, mod, level)
            if target is not None:
                found = self._resolve(target, attr, seen)
                if found is not None:
                    return found
                sub = self.find_module(target, attr, 1) if os.path.basename(target.path) == "__init__.py" else None
                if sub is not None:
                    return ModuleRef(sub)
                return None
            if level:
                return None
            return External(f"{mod}.{attr}" if mod else attr)
        if name in module.globals:
            return GlobalRef(module, name)
        for mod, level in module.stars:
            target = self.find_module(module, mod, level)
            if target is not None:
                found = self._resolve(target, name, seen)
                if found is not None:
                    return found
        return None

    def attribute(self, symbol, attr: str):
        """``symbol.attr`` for a module or class symbol."""
        if isinstance(symbol, ModuleRef):
            found = self.resolve(symbol.module, attr)
            if found is None and os.path.basename(symbol.module.path) == "__init__.py":
                sub = self.find_module(symbol.module, attr, 1)
                return ModuleRef(sub) if sub is not None else None
            return found
        if isinstance(symbol, External):
            return External(f"{symbol.qualname}.{attr}")
        if isinstance(symbol, Class):
            for klass in self.mro(symbol):
                if attr in klass.methods:
                    return klass.methods[attr]
        return None

    # -- classes ------------------------------------------------------------------------------------
    def bases(self, klass: Class) -> list:
        """The base classes of a class: project Classes and External names."""
        if klass.bases is None:
            klass.bases = []          # a class that derives from itself through an alias ends here
            out = []
            for base in klass.node.bases:
                sym = self.resolve_expr(klass.module, base)
                if sym is not None:
                    out.append(sym)
            klass.bases = out
        return klass.bases

    def resolve_expr(self, module: Module, expr):
        """A module-level dotted expression (``a.b.C``) to a symbol."""
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        sym = self.resolve(module, expr.id)
        for attr in reversed(parts):
            if sym is None:
                return None
            sym = self.attribute(sym, attr)
        return sym

    def mro(self, klass: Class) -> list:
        """The class and its project base classes, depth first (cycles cut)."""
        if klass.mro is None:
            klass.mro = self._mro(klass)
        return klass.mro

    def _mro(self, klass: Class) -> list:
        out, todo, seen = [], [klass], set()
        while todo:
            k = todo.pop(0)
            if k.uid in seen:
                continue
            seen.add(k.uid)
            out.append(k)
            todo.extend(b for b in self.bases(k) if isinstance(b, Class))
        return out

    def external_bases(self, klass: Class) -> list:
        """Qualified names of the external classes somewhere above ``klass``."""
        return [b.qualname for k in self.mro(klass) for b in self.bases(k) if isinstance(b, External)]

    def subclasses(self, klass: Class) -> list:
        """Indexed classes that derive from ``klass`` (itself included)."""
        self.importers(klass.module, (klass.node.name,))
        if self._classes_by_base is None:
            # resolving a base may load a module (which resets the table): build it aside
            table: dict = {}
            for module in list(self.by_path.values()):
                for k in list(module.classes.values()):
                    for base in self.bases(k):
                        if isinstance(base, Class):
                            table.setdefault(base.uid, []).append(k)
            self._classes_by_base = table
        out, todo, seen = [], [klass], set()
        while todo:
            k = todo.pop()
            if k.uid in seen:
                continue
            seen.add(k.uid)
            out.append(k)
            todo.extend(self._classes_by_base.get(k.uid, ()))
        return out


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    from synccheck.analyzer.source import decode_source
    text, error = decode_source(path, data)
    return text


def _init_file(directory: str) -> Optional[str]:
    init = os.path.join(directory, "__init__.py")
    return os.path.abspath(init) if os.path.isfile(init) else None


def module_name(path: str) -> tuple:
    """(dotted module name, package) of a file: its folders count while they hold an ``__init__.py``."""
    directory, filename = os.path.split(path)
    stem = filename[:-3] if filename.endswith(".py") else filename.rsplit(".", 1)[0]
    parts = [] if stem == "__init__" else [stem]
    while directory and os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, pkg = os.path.split(directory)
        parts.insert(0, pkg)
        if not pkg:
            break
    name = ".".join(parts) or stem
    package = ".".join(parts[:-1]) if stem != "__init__" else ".".join(parts)
    return name, package


# at most this many files are parsed to find the callers or subclasses of one name
MAX_IMPORTERS = 32

_ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
_root_cache: dict = {}


def project_root(directory: str) -> Optional[str]:
    """The nearest folder at or above ``directory`` that looks like a project root."""
    if directory in _root_cache:
        return _root_cache[directory]
    d, found = directory, None
    for _ in range(12):
        if any(os.path.exists(os.path.join(d, m)) for m in _ROOT_MARKERS):
            found = d
            break
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    _root_cache[directory] = found
    return found
