"""Stage 5 of the pipeline (values), a last resort: a method called on an object we cannot trace.

``self.task.train_step(sample, self.model, criterion, optimizer)``: the task comes from a registry
(``tasks.setup_task(args)``), so no assignment says its class. When the call hands it a data-parallel
model, what the method does with it matters (fairseq's tasks run the forward and the backward). If
the project's classes that define the method all derive from one class that defines it, that
class's method is the contract its subclasses keep, and it stands for the call.

The classes are looked for among the parsed modules, the lint set's other files, and, in a package,
the package's files on disk that say ``def <name>(`` (read once per package, capped).
"""
from __future__ import annotations

import ast
import os
import re
from typing import Optional

MAX_SCANNED = 2000        # files of one package read for their ``def`` names
_DEF = re.compile(r"^[ \t]+def (\w+)\(", re.M)


def duck_method(project, name: str, caller_cls=None, call=None):
    """(function, class) of the one family's root definition of method ``name``, or None. The
    calling method's own class family is not a candidate (``Trainer.train_step`` calling
    ``self.task.train_step``), nor a method that cannot take the call's arguments."""
    if name.startswith("__") or len(name) < 4:
        return None
    project.load_matching(f"def {name}(")
    for path in _definers_on_disk(project, name):
        project._load(path)
    excluded = set()
    if caller_cls is not None:
        excluded = {k.uid for k in project.mro(caller_cls) if name in k.methods}
    found = None
    for module in project.modules():
        if f"def {name}(" not in module.text:
            continue
        for klass in module.classes.values():
            if name not in klass.methods or (call is not None and not _accepts(klass.methods[name], call)):
                continue
            root = [k for k in project.mro(klass) if name in k.methods][-1]
            if root.uid in excluded or klass.uid in excluded:
                continue
            if found is not None and found.uid != root.uid:
                return None         # unrelated classes share the name: no contract to go by
            found = root
    return (found.methods[name], found) if found is not None else None


def _accepts(fn, call) -> bool:
    """Can method ``fn`` (self first) be called with ``call``'s arguments?"""
    args = fn.node.args
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return True
    positional = [a.arg for a in args.posonlyargs + args.args][1:]
    if len(call.args) > len(positional) and args.vararg is None:
        return False
    names = set(positional[len(call.args):]) | {a.arg for a in args.kwonlyargs}
    if not (args.kwarg is not None or all(k.arg in names for k in call.keywords)):
        return False
    # the parameters without a default must all be given (``model.train()`` is no call of
    # ``Trainer.train(self, loader, model, optimizer)``)
    required = positional[len(call.args):len(positional) - len(args.defaults)]
    given = {k.arg for k in call.keywords}
    return all(name in given for name in required) and all(
        a.arg in given for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None)


def _definers_on_disk(project, name: str) -> list:
    """Files of the linted modules' packages whose methods include ``name``."""
    if not project.filesystem:
        return []
    index = getattr(project, "_def_index", None)
    if index is None:
        index = project._def_index = {}
        for root in {_package_root(m.path) for m in project.linted()}:
            if root is not None:
                _index_package(root, index)
    return [p for p in index.get(name, ()) if p not in project.by_path]


def _package_root(path: str) -> Optional[str]:
    """The outermost folder above ``path`` that is still a package (has an ``__init__.py``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        return None
    while os.path.isfile(os.path.join(os.path.dirname(folder), "__init__.py")):
        folder = os.path.dirname(folder)
    return folder


def _index_package(root: str, index: dict) -> None:
    scanned = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            scanned += 1
            if scanned > MAX_SCANNED:
                return
            path = os.path.join(folder, file)
            try:
                with open(path, "rb") as fh:
                    text = fh.read(2_000_000).decode("utf-8", "replace")
            except OSError:
                continue
            for name in set(_DEF.findall(text)):
                index.setdefault(name, []).append(path)
