"""Code nothing runs: a hook method no one calls, a hook class no one makes or registers.

``sampler.set_epoch(epoch)`` in ``on_epoch_start`` where the trainer calls ``on_epoch_begin``, or in a
``DistSamplerSeedHook`` that ``train.py`` never registers, reseeds nothing (SC302). Read from text
only: a name that appears nowhere in the project but at its own definition is not called. A method of
a class deriving from a library class (a Lightning callback: the library calls it), a class with a
decorator (a registry: a config names it), and anything named in a string are taken to run.
"""
from __future__ import annotations

import os
import re

from synccheck.analyzer.project.definitions import Function

MAX_SCANNED = 3000          # files read looking for a name, beyond those already read


def never_runs(program, fn) -> bool:
    """Is ``fn``, a method of a project class, never called, or its class never made?"""
    if not isinstance(fn, Function) or fn.node.name.startswith("__") or fn.cls is None or fn.node.decorator_list:
        return False        # (a plain function may be a script's entry point, run by a launcher)
    klass = fn.cls
    if klass.node.decorator_list or not _project_bases_only(program.project, klass):
        return False
    if not _named_elsewhere(program, klass.node.name, "class"):
        return True
    return not _named_elsewhere(program, fn.node.name, "def")


def class_never_made(program, fn) -> bool:
    """Is ``fn`` a method of a project class whose name appears nowhere else (never made)?"""
    return isinstance(fn, Function) and fn.cls is not None and not _named_elsewhere(program, fn.cls.node.name, "class")


def _project_bases_only(project, klass) -> bool:
    """Does every class above ``klass`` resolve to a class of the project (no library base that may
    call its hooks)?"""
    from synccheck.analyzer.project.definitions import Class
    for k in project.mro(klass):
        bases = project.bases(k)
        if len(bases) != len(k.node.bases) or not all(isinstance(b, Class) for b in bases):
            return False
    return True


def _named_elsewhere(program, name: str, keyword: str) -> bool:
    """Does ``name`` appear in the project other than right after ``def`` / ``class``?"""
    cache = program.__dict__.setdefault("_named_elsewhere", {})
    found = cache.get(name)
    if found is not None:
        return found
    use = re.compile(r"(?<![\w])(?<!def )(?<!class )" + re.escape(name) + r"(?![\w])")
    project = program.project
    texts = [m.text for m in project.modules()]
    texts += [project.catalog_text(a) or "" for a in list(project.catalog)]
    found = any(use.search(text) for text in texts)
    if not found:
        found = _named_in_files(project, name, use)
    cache[name] = found
    return found


def _named_in_files(project, name: str, use) -> bool:
    """The project's other files (a lint of single files sees only some): read as bytes, the name first."""
    from synccheck.analyzer.imports import _project_folders, _project_top
    read = {os.path.abspath(m.path) for m in project.modules()} | set(project.catalog)
    tops = {t for t in (_project_top(os.path.dirname(os.path.abspath(m.path))) for m in project.modules()) if t}
    word = name.encode()
    scanned = 0
    for top in sorted(tops):
        for folder in _project_folders(top, set()):
            try:
                entries = sorted(os.listdir(folder))
            except OSError:
                continue
            for entry in entries:
                if not entry.endswith(".py"):
                    continue
                path = os.path.join(folder, entry)
                if path in read:
                    continue
                scanned += 1
                if scanned > MAX_SCANNED:
                    return True          # (too large to be sure: taken to run)
                try:
                    with open(path, "rb") as fh:
                        data = fh.read(1_000_000)
                except OSError:
                    continue
                if word in data and use.search(data.decode("utf-8", "replace")):
                    return True
    return False
