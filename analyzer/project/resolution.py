"""Stage 4 of the pipeline (project index), part 2: import and name resolution.

``import x`` is resolved the way Python would find it on the file system, without importing anything:
the importer's folder, the root its package hangs from, the folders being linted, the project root
(and its ``src/``); relative imports from the importer's package. A module-level name resolves to a
symbol (definitions.py) through imports, star imports and re-exports, with a visited set for cycles;
a class's bases, method resolution order and subclasses are looked up the same way. ``Resolution`` is
the part of ``index.Project`` that does this.
"""
from __future__ import annotations

import ast
import os
from typing import Optional

from synccheck.analyzer.imports import by_tail, folder_word, path_tails, sys_path_roots
from synccheck.analyzer.project.definitions import Class, External, GlobalRef, Module, ModuleRef
from synccheck.analyzer.project.vocabulary import FRAMEWORK_PACKAGES

# names a library's ``from X import *`` binds that matter to the analysis, and those libraries
_STAR_EXPORTED = frozenset(("DistributedSampler", "DataLoader", "DistributedDataParallel", "FullyShardedDataParallel"))
_STAR_LIBRARIES = frozenset(("torch", "monai", "timm", "accelerate"))


class Resolution:
    """Module resolution on the file system, names to symbols, and class hierarchies (a part of Project)."""

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
        roots = self._search_roots(importer)
        for root in roots:
            found = self._find_path(root, name.split("."))
            if found:
                break
        if found is None and "." in name:
            # ``import mae_st.util.misc`` in the repository that is the package ``mae_st``
            # (imports.folder_word)
            head, rest = name.split(".", 1)
            found = next((f for root in roots if folder_word(root) == head.lower()
                          for f in (self._find_path(root, rest.split(".")),) if f), None)
        if found is None and ("sys.path" in importer.text or "_path" in importer.text):
            # ``import _init_paths`` putting ``../lib`` on sys.path, then ``from dataset import ...``
            found = next((f for root in sys_path_roots(importer.path, importer.text) if root not in roots
                          for f in (self._find_path(root, name.split(".")),) if f), None)
        if found is None:
            found = self._lint_set_suffix(name)
        self._find_cache[key] = found
        return self._load(found) if found else None

    def _lint_set_suffix(self, name: str) -> Optional[str]:
        """imports.by_tail over the files of the lint set."""
        count = len(self.by_path) + len(self.catalog)
        if self._suffixes is None or self._suffixes[0] != count:
            self._suffixes = (count, path_tails(list(self.by_path) + list(self.catalog)))
        return by_tail(self._suffixes[1], name)

    def _find_file(self, directory: str, parts: list) -> Optional[Module]:
        path = self._find_path(directory, parts) if parts else self._init_file(directory)
        return self._load(path) if path else None

    def _find_path(self, root: str, parts: list) -> Optional[str]:
        # the file system is read once per project for each path: many importers ask for the same
        key = (root, tuple(parts))
        if key in self._paths:
            return self._paths[key]
        base = os.path.join(root, *parts)
        if os.path.isfile(base + ".py"):
            found = os.path.abspath(base + ".py")
        else:
            found = self._init_file(base)
        self._paths[key] = found
        return found

    def _init_file(self, directory: str) -> Optional[str]:
        key = (directory, None)
        if key not in self._paths:
            self._paths[key] = _init_file(directory)
        return self._paths[key]

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

    def resolve_import(self, module: Module, imported: tuple, seen: Optional[set] = None):
        """What ``(module name, attribute or None, level)`` imported into ``module`` stands for."""
        seen = set() if seen is None else seen
        mod, attr, level = imported
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

    def _resolve(self, module: Module, name: str, seen: set):
        key = (module.path, name)
        if key in seen:
            return None
        seen.add(key)
        if name in module.top:
            return module.top[name]
        if name in module.imports:
            return self.resolve_import(module, module.imports[name], seen)
        if name in module.globals:
            return GlobalRef(module, name)
        for mod, level in module.stars:
            target = self.find_module(module, mod, level)
            if target is not None:
                found = self._resolve(target, name, seen)
                if found is not None:
                    return found
        if name in _STAR_EXPORTED:
            # ``from monai.data import *`` then ``DistributedSampler(...)`` (VoCo): a library's star import
            # gives the names it exports; only the few whose meaning matters here are taken from it
            for mod, level in module.stars:
                if not level and mod and mod.split(".")[0] in _STAR_LIBRARIES:
                    return External(f"{mod}.{name}")
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
                if isinstance(sym, GlobalRef):
                    # ``AdamW = _adamw.AdamW`` then ``class AdamWFP32Copy(AdamW)``: the class the
                    # module-level alias is bound to (each binding of it, if several)
                    out.extend(found for value in sym.module.globals.get(sym.name, ())
                               if (found := self.resolve_expr(sym.module, value)) is not None
                               and not isinstance(found, GlobalRef) and found is not klass)
                elif sym is not None:
                    out.append(sym)
                elif isinstance(base, ast.Name):
                    out.extend(self._local_base(klass, base.id))
            klass.bases = out
        return klass.bases

    def _local_base(self, klass: Class, name: str) -> list:
        """``class Wrapped(ddp_class)`` inside a function that set ``ddp_class = parallel.Distributed
        DataParallel`` (or another class, on another branch): every class the name is bound to there."""
        line = klass.node.lineno
        enclosing = [fn for fn in klass.module.functions.values()
                     if fn.node.lineno < line <= (fn.node.end_lineno or 0)]
        if not enclosing:
            return []
        fn = max(enclosing, key=lambda f: f.node.lineno)
        out = []
        for node in ast.walk(fn.node):
            if isinstance(node, ast.Assign) and node.lineno < line and \
                    any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                sym = self.resolve_expr(klass.module, node.value)
                if sym is not None and sym is not klass:
                    out.append(sym)
        return out

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

    def method_after(self, klass: Class, after: Class, name: str):
        """The method ``name`` that comes after the class ``after`` in the MRO of ``klass``: what
        ``super().name`` in a method of ``after`` runs on an instance of ``klass``; None if none."""
        mro = self.mro(klass)
        if after not in mro:
            return None
        return next((k.methods[name] for k in mro[mro.index(after) + 1:] if name in k.methods), None)

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
            # resolving a base may load a module (which resets the table): build it aside. The modules
            # the last table was built from are still the first ones (modules are only ever added, and
            # a class's bases are resolved once): only the modules added since are read
            modules = list(self.by_path.values())
            done = self._classes_done
            if len(done) <= len(modules) and all(a is b for a, b in zip(done, modules)):
                table, start = self._classes_table, len(done)
            else:
                table, start = {}, 0
            for module in modules[start:]:
                for k in list(module.classes.values()):
                    for base in self.bases(k):
                        if isinstance(base, Class):
                            table.setdefault(base.uid, []).append(k)
            self._classes_table, self._classes_done = table, modules
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


def _init_file(directory: str) -> Optional[str]:
    init = os.path.join(directory, "__init__.py")
    return os.path.abspath(init) if os.path.isfile(init) else None


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
