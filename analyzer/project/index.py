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

The stage's modules: definitions.py (what one parsed file defines, and the symbols), resolution.py
(imports and names resolved on the file system), and this one: ``Project``, the set of indexed
modules, which parses the files of the lint set when the analysis first needs them.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Iterable, Optional

# Project builds on resolution.py; the rest is re-exported: these names have always been importable from here.
from synccheck.analyzer.project.definitions import (FUNCTION_TYPES, Class, External, Function, GlobalRef, Module,
                                                    ModuleRef, _cut, _target_names, qualified_name)
from synccheck.analyzer.project.resolution import (_ROOT_MARKERS, Resolution, _init_file, _root_cache,
                                                   project_root)

# Modules loaded only to resolve imports (not linted): at most this many, each at most this big.
MAX_CONTEXT_MODULES = 400
_INSTALLED = re.compile(r"[/\\\\](?:site|dist)-packages[/\\\\]")
MAX_CONTEXT_BYTES = 2_000_000


# ---------------------------------------------------------------------------------------------------

class Project(Resolution):
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
        self._suffixes: Optional[tuple] = None   # (files counted, path tail -> files): _lint_set_suffix
        self._paths: dict = {}           # (folder, module name parts) -> the file found there, or None
        self._resolved: dict = {}
        self.context_loaded = 0
        self.errors: list = []           # (path, message) for context modules that could not be read
        self._classes_by_base: Optional[dict] = None
        self._classes_table: dict = {}       # the last table built, and the modules it was built from
        self._classes_done: list = []
        # files of the lint set not parsed yet: parsed when an import, a caller or a subclass is looked
        # for in them (abspath -> (path, text or None)); their findings are reported like the others
        self.catalog: dict = {}
        self._context_only: set = set()  # catalogued files read as context only (offer(linted=False))
        self._catalog_imports: dict = {}
        self._importers_done: set = set()
        self._importer_index: Optional[tuple] = None
        self.truncated: set = set()      # importers() queries that matched too many files to parse
        self._searched: set = set()
        self.version = 0                 # bumped at every module added: indexes over modules refresh
        self.single_files = False        # the lint named files only: the modules they use are not in its set

    def offer(self, path: str, text: Optional[str] = None, imports: Optional[list] = None,
              linted: bool = True) -> None:
        """Make a file available, to be parsed only if the analysis needs it. ``imports``: its import
        lines (imports.imported_names), to find who imports a module. ``linted=False``: a file read as
        context only (a lint of single files), whose findings are not reported."""
        apath = os.path.abspath(path)
        if apath not in self.by_path:
            self.catalog[apath] = (path, text)
            if not linted:
                self._context_only.add(apath)
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
        targets = {os.path.abspath(module.path)}
        folder = os.path.dirname(os.path.abspath(module.path))
        if not module.path.endswith("__init__.py"):
            init = os.path.join(folder, "__init__.py")
            if os.path.exists(init):
                targets.add(init)
        chosen = self._chosen_importers(targets, words)
        if words and len(chosen) > MAX_IMPORTERS:
            # a name used all over a code base (a library's base class, ``forward``) is not the
            # model's path into a training loop: parsing every user of it would cost more than the
            # analysis it feeds
            self.truncated.add(key)
            return []
        if words:
            # the packages further up that re-export one of the names (``from ddpm_torch import *``
            # reaches ``ddpm_torch/utils/train.py`` through ``ddpm_torch/__init__.py``), when they
            # bring only a few more files
            above = set()
            folder = os.path.dirname(folder)
            for _ in range(3):
                init = os.path.join(folder, "__init__.py")
                text = self._init_text(init)
                if text is None:
                    break
                if any(w in text for w in words):
                    above.add(init)
                folder = os.path.dirname(folder)
            more = [a for a in self._chosen_importers(above, words) if a not in chosen] if above else []
            if len(more) <= MAX_REEXPORT_IMPORTERS:
                chosen += more
        out = []
        for apath in chosen:
            found = self._from_catalog(apath)
            if found is not None:
                out.append(found)
        return out

    def _init_text(self, path: str):
        """A package's ``__init__.py`` text (None where there is none), read once."""
        from synccheck.analyzer.imports import _read
        cache = self.__dict__.setdefault("_init_texts", {})
        if path not in cache:
            cache[path] = _read(path)
        return cache[path]

    def _chosen_importers(self, targets: set, words: tuple) -> list:
        """The catalogued files, not parsed yet, that import one of ``targets`` (paths) and mention
        one of ``words`` (when given)."""
        from synccheck.analyzer.imports import module_paths
        if self._importer_index is None:
            self._importer_index = self._index_importers()
        by_name, by_path = self._importer_index
        candidates = {a for t in targets for a in by_path.get(t, ())}
        for t in targets:
            # ``import a.b.c`` may name t from any folder above it: look the dotted names up
            stem = t[:-len("/__init__.py")] if t.endswith("/__init__.py") else t[:-3]
            parts = stem.split(os.sep)
            for i in range(max(1, len(parts) - 12), len(parts)):
                name = ".".join(parts[i:])
                for a in by_name.get(name, ()):
                    # (or the one file of the lint set with that path tail, as resolution falls back
                    # to: ``scripts/train.py`` importing ``utils.train_utils`` from the repository's top)
                    if a in candidates:
                        continue
                    paths = module_paths(a, 0, name, self.roots)
                    if t in paths or (self._lint_set_suffix(name) == t and not any(map(os.path.isfile, paths))):
                        candidates.add(a)
        chosen = []
        for apath in [a for a in self._catalog_imports if a in candidates and a in self.catalog]:
            if words:
                text = self.catalog_text(apath)
                if text is None or not any(w in text for w in words):
                    continue
            chosen.append(apath)
        return chosen

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

    def load_calling(self, method: str, limit: int) -> list:
        """Parse the catalogued files whose text calls ``.method(``, when there are at most ``limit``
        of them (a method named all over a code base is nobody's entry point)."""
        key = ("calling", method)
        if key in self._searched or not self.catalog:
            return []
        self._searched.add(key)
        needle = re.compile(r"(?<!self)(?<!super\(\))\." + re.escape(method) + r"\(")
        found = [a for a in list(self.catalog) if needle.search(self.catalog_text(a) or "")]
        if not found or len(found) > limit:
            return []
        return [m for m in map(self._from_catalog, found) if m is not None]

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
        module = self.add(path, text, tree, linted=apath not in self._context_only)
        module.on_demand = True
        return module

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

    def module_at(self, path: str) -> Optional[Module]:
        """The parsed module of a path as the analysis spells it (a site's first part), or None."""
        return self.by_path.get(os.path.abspath(path)) or next((m for m in self.by_path.values() if m.path == path),
                                                               None)

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
            module.derived.clear()
            module.functions.clear()
            module.classes.clear()
            module.top.clear()
        self._classes_by_base = None
        self._classes_table, self._classes_done = {}, []

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


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    from synccheck.analyzer.source import decode_source
    text, error = decode_source(path, data)
    return text


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
MAX_REEXPORT_IMPORTERS = 8    # more files a re-export further up may bring in
