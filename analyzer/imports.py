"""Stage 2b: which files belong together, read from their import lines (no parse).

A finding in ``engine.py`` can depend on ``main.py`` (which wraps the model and calls the loop), so
files are analysed in *components*: the files that import one another, directly or through project
modules the lint does not parse. Components are independent: they can be analysed in parallel, and
a cached result stays valid until a file of its component (or a module it read) changes.

When the lint is given single files (a pre-commit hook passes only what changed), the files beside
them that import them are added as *context*: read for the values they pass in (the DDP model
``main.py`` hands to ``engine.train_one_epoch``), never reported on.
"""
from __future__ import annotations

import os
import re
from itertools import islice
from typing import Iterable, Optional

_FROM = re.compile(rb"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)", re.M)
_IMPORT = re.compile(rb"^[ \t]*import[ \t]+([^\n#]+)", re.M)
MAX_CONTEXT_SCAN = 300          # files beside a linted file scanned for importers
MAX_FAR_IMPORTERS = 8           # importers elsewhere in the project taken as context
MAX_HOPS = 200                  # project modules read only to connect components


def imported_names(data: bytes) -> list:
    """(level, dotted name) of every module an import line may name: ``from a import b`` gives a and
    a.b (b may be a submodule)."""
    out = []
    for level, module, names in line_matches(_FROM, data, b"from"):
        level = len(level)
        mod = module.decode("ascii", "ignore")
        if mod or level:
            out.append((level, mod))
        for name in re.findall(rb"[A-Za-z_]\w*(?:\s+as\s+\w+)?", names.strip(b"()")):
            name = name.split()[0].decode("ascii", "ignore")
            if name != "as":
                out.append((level, f"{mod}.{name}" if mod else name))
    for names in line_matches(_IMPORT, data, b"import"):
        for part in names.split(b","):
            name = part.strip().split()[0].decode("ascii", "ignore") if part.strip() else ""
            if name:
                out.append((0, name))
    return out


def line_matches(pattern, data, keyword) -> list:
    """``pattern.findall(data)`` for a multi-line pattern that begins ``^[ \\t]*keyword`` (bytes or
    str): the regex is tried only where a line starts with the keyword (found with find), not at
    every character, and a match that spans lines (a parenthesized import) hides the lines it covers,
    as findall's scan would."""
    out = []
    newline, blanks = (b"\n", b" \t") if isinstance(data, bytes) else ("\n", " \t")
    find, match = data.find, pattern.match
    done = 0                    # where the last match ended: findall goes on from there
    at = find(keyword)
    while at != -1:
        start = data.rfind(newline, 0, at) + 1
        if start >= done and not data[start:at].strip(blanks):
            m = match(data, start)
            if m is not None:
                out.append(m.groups() if pattern.groups > 1 else m.group(1))
                done = m.end() if m.end() > start else start + 1
        at = find(keyword, at + 1)
    return out


def module_paths(path: str, level: int, name: str, roots: list) -> list:
    """Files ``import name`` (with ``level`` leading dots) may load, from the file at ``path``. Kept per
    folder (a function of the folder, the arguments and the package roots, which are kept too): the
    files of a folder import the same modules, and the same import lines are looked up for every
    component and every importers() query."""
    here = os.path.dirname(os.path.abspath(path))
    key = (here, level, name, tuple(roots))
    found = _module_paths_cache.get(key)
    if found is None:
        if len(_module_paths_cache) > 50_000:
            _module_paths_cache.clear()
            _targets.clear()
        found = _module_paths_cache[key] = _module_paths(here, level, name, roots)
    return found


_module_paths_cache: dict = {}


def _module_paths(here: str, level: int, name: str, roots: list) -> list:
    if level:
        base = here
        for _ in range(level - 1):
            base = os.path.dirname(base)
        bases = [base]
    else:
        bases = [here] + [r for r in _package_roots(here) if r != here] + roots
    out = []
    for base in bases:
        # the same roots are asked for the same names by every folder: each pair is joined once
        pair = _targets.get((base, name))
        if pair is None:
            pair = _targets[(base, name)] = _target_files(base, name)
        out += pair
    if not level and "." in name:
        # ``import mae_st.util.misc`` in a repository that is itself the package ``mae_st`` (no
        # ``__init__.py``, run from the folder above): the rest of the name, from the folder of
        # that name (a clone may be named ``owner+mae_st@commit`` or ``mae-st``)
        head, rest = name.split(".", 1)
        for base in bases:
            if folder_word(base) == head.lower():
                out += _target_files(base, rest)
    return out


def folder_word(folder: str) -> str:
    """A folder's name as a package name: ``facebookresearch+mae_st@c5dec1b`` and ``mae-st`` are
    ``mae_st``."""
    word = _folder_words.get(folder)
    if word is None:
        word = os.path.basename(folder).split("@", 1)[0].rsplit("+", 1)[-1].replace("-", "_").lower()
        _folder_words[folder] = word
    return word


_folder_words: dict = {}


def _target_files(base: str, name: str) -> tuple:
    """(base/a/b.py, base/a/b/__init__.py) for name ``a.b``, as os.path.join spells them; the joins
    spelled out on POSIX for a folder without a trailing slash and a name without empty parts (an
    import's parts are words: no slash in them)."""
    parts = name.split(".") if name else []
    if _POSIX and not base.endswith("/") and all(parts):
        target = base + "/" + "/".join(parts) if parts else base
        return target + ".py", target + "/__init__.py"
    target = os.path.join(base, *parts) if parts else base
    return target + ".py", os.path.join(target, "__init__.py")


_POSIX = os.path.__name__ == "posixpath"
_targets: dict = {}


_package_roots_cache: dict = {}


def _package_roots(directory: str) -> list:
    found = _package_roots_cache.get(directory)
    if found is None:
        found = _package_roots_cache[directory] = _find_package_roots(directory)
    return found


def _find_package_roots(directory: str) -> list:
    roots = []
    d = directory
    while os.path.isfile(os.path.join(d, "__init__.py")):
        if not os.path.basename(d).isidentifier():
            break           # (``owner+repo@commit/__init__.py``: no import can name it, it is the top)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    roots.append(d)
    from synccheck.analyzer.project.index import project_root
    project = project_root(directory)
    if project:
        roots.append(project)
        src = os.path.join(project, "src")
        if os.path.isdir(src):
            roots.append(src)
    return roots


def path_tails(paths) -> dict:
    """(a, b) -> the files among ``paths`` (absolute) that ``import a.b`` may mean wherever their
    tree is put on ``sys.path``: .../a/b.py and .../a/b/__init__.py (tails of two to five parts)."""
    table: dict = {}
    for apath in paths:
        pieces = apath.split(os.sep)
        if pieces[-1] == "__init__.py":
            pieces = pieces[:-1]
        elif pieces[-1].endswith(".py"):
            pieces[-1] = pieces[-1][:-3]
        for k in range(2, min(len(pieces), 5) + 1):
            table.setdefault(tuple(pieces[-k:]), set()).add(apath)
    return table


def by_tail(table: dict, name: str):
    """The one file of ``table`` (path_tails) a dotted absolute import names, or None: a launcher in
    ``pytorch/launcher/`` importing ``libs.egs`` from ``pytorch/libs/``, which a ``sys.path.insert``
    puts on the path when it runs."""
    if "." not in name:
        return None
    found = table.get(tuple(name.split(".")), ())
    return next(iter(found)) if len(found) == 1 else None


# ``import _init_paths``; ``osp.join(this_dir, '..', 'lib')``: the literal parts of a join
_IMPORTED_WORD = re.compile(r"^[ \t]*import[ \t]+(\w*path\w*)[ \t]*$", re.M)
_JOINED = re.compile(r"\.join\(([^()]*?)\)")
_JOINED_WORD = re.compile(r"""['"]([\w.\-/]+)['"]""")
_sys_paths: dict = {}


def sys_path_roots(path: str, text: Optional[str] = None) -> list:
    """Folders a script puts on sys.path, itself or through a sibling helper it imports
    (``import _init_paths``: ``sys.path.insert(0, osp.join(osp.dirname(__file__), '..', 'lib'))``):
    every ``join`` of the file's folder and literal parts that names an existing folder. Read from
    the text, never run."""
    found = _sys_paths.get(path)
    if found is not None:
        return found
    if text is None:
        text = _read(path) or ""
    here = os.path.dirname(os.path.abspath(path))
    texts = [(path, text)] if "sys.path" in text else []
    for helper in set(_IMPORTED_WORD.findall(text)):
        helper_path = os.path.join(here, helper + ".py")
        helper_text = _read(helper_path) if os.path.isfile(helper_path) else None
        if helper_text:
            texts.append((helper_path, helper_text))
    out: list = []
    for where, body in texts:
        if "sys.path" not in body or "__file__" not in body:
            continue
        folder = os.path.dirname(os.path.abspath(where))
        for parts in _JOINED.findall(body):
            words = _JOINED_WORD.findall(parts)
            if words:
                target = os.path.normpath(os.path.join(folder, *words))
                if target not in out and os.path.isdir(target):
                    out.append(target)
    if len(_sys_paths) > 10_000:
        _sys_paths.clear()
    _sys_paths[path] = out
    return out


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(200_000)
    except OSError:
        return None


class Components:
    """Union-find over the files being linted (and the project files that connect them)."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = [os.path.abspath(r if os.path.isdir(r) else os.path.dirname(r) or ".") for r in roots]
        self.parent: dict = {}

    def find(self, x: str) -> str:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while self.parent.get(x, x) != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def build(self, files: dict, read_imports) -> list:
        """Components of ``files`` (abspath -> imports list), following non-linted project modules
        (``read_imports(abspath)`` gives theirs, or None) for at most MAX_HOPS files."""
        known = dict(files)
        todo = list(files)
        hops = 0
        is_file: dict = {}          # the same candidates come up for many files: each is looked at once
        tails = None
        while todo:
            path = todo.pop()
            self.parent.setdefault(path, path)
            for level, name in known.get(path) or ():
                for candidate in module_paths(path, level, name, self.roots):
                    if candidate in known:
                        self.union(path, candidate)
                        break
                    if hops < MAX_HOPS and (is_file[candidate] if candidate in is_file else
                                            is_file.setdefault(candidate, os.path.isfile(candidate))):
                        hops += 1
                        imports = read_imports(candidate)
                        known[candidate] = imports
                        if imports is not None:
                            todo.append(candidate)
                        self.union(path, candidate)
                        break
                else:
                    if not level and "." in name:
                        tails = path_tails(files) if tails is None else tails
                        target = by_tail(tails, name)
                        if target is not None:
                            self.union(path, target)
                            continue
                    if not level and (any("path" in n for _, n in known.get(path) or ()) or
                                      any(n == "sys" for _, n in known.get(path) or ())):
                        # ``import _init_paths`` then ``from dataset import ...`` found under ``../lib``;
                        # or ``sys.path.append(os.path.join(BASE_DIR, '..'))`` in the script itself
                        for root in sys_path_roots(path):
                            target = next((t for t in _target_files(root, name) if t in known or os.path.isfile(t)), None)
                            if target is not None:
                                if target not in known and hops < MAX_HOPS:
                                    hops += 1
                                    known[target] = read_imports(target)
                                    if known[target] is not None:
                                        todo.append(target)
                                if target in known:
                                    self.union(path, target)
                                break
        groups: dict = {}
        for path in known:
            if path in files or path in self.parent:
                groups.setdefault(self.find(path), []).append(path)
        return [g for g in groups.values() if any(p in files for p in g)]


    def join(self, groups: list, others: dict) -> list:
        """``groups`` (from build), joined by the files of ``others`` (abspath -> imports: linted files
        with none of our words) that import files of two or more of them (``class Trainer(LoopMixin,
        DeviceMixin)``: the loop in one, the DDP wrapper in the other); such a file joins the group."""
        members = [p for group in groups for p in group]
        where = set(members)
        joiners = []
        # (a library's package, torch's own: its test files subclass the classes of every module; a
        # training project's user code fills a framework's hooks)
        small = len(members) + len(others) <= MAX_SUBCLASSING_PROJECT
        # a package's __init__ that imports a member first (it is how ``from models import build_model``
        # reaches ``models/sr_model.py``), then the files that import members or those
        ordered = sorted(others.items(), key=lambda item: not item[0].endswith("__init__.py"))
        for path, imports in ordered:
            if path in where:
                continue
            hit, files = set(), []
            for level, name in imports:
                for target in module_paths(path, level, name, self.roots):
                    if target in where:
                        hit.add(self.find(target))
                        files.append(target)
                        break
            if len(hit) >= 2 or (hit and (path.endswith("__init__.py") or driver_script(path) or
                                          small and _subclasses_one(path, files))):
                # (or a script whose loop may drive the one it imports: ``model.optimize_parameters(...)``
                # in train.py, which says none of our words; parsed only if the analysis finds it drives
                # a training function nothing else calls, program.drivers_of; or a file that subclasses
                # a class of the group, ``class MyTask(Runner)`` filling the hook the loop calls: read
                # only when the analysis asks for the subclasses)
                for root in hit:
                    self.union(path, root)
                joiners.append(path)
                where.add(path)
        if not joiners:
            return groups
        out: dict = {}
        for path in members + joiners:
            out.setdefault(self.find(path), []).append(path)
        return list(out.values())


MAX_SUBCLASSING_PROJECT = 400
_CLASS_WITH_BASE = re.compile(r"^[ \t]*class[ \t]+\w+[ \t]*\([ \t]*([\w.]+)", re.M)


def _subclasses_one(path: str, imported: list) -> bool:
    """Does the file define a class on a base that a file it imports (of the group) defines?"""
    data = _read(path)
    if not data or "class " not in data:
        return False
    bases = {b.rpartition(".")[2] for b in _CLASS_WITH_BASE.findall(data)} - {"object"}
    if not bases:
        return False
    defines = re.compile(r"^[ \t]*class[ \t]+(?:" + "|".join(map(re.escape, sorted(bases))) + r")\b", re.M)
    return any(defines.search(_read(target) or "") for target in imported)


_SCRIPT_NAME = re.compile(r"(?:^|_)(?:train|main|run|finetune|pretrain)(?:_|\.py$)", re.I)


def training_script_name(path: str) -> bool:
    """Is the file named like a training script (``train.py``, ``main_finetune.py``, ``run_clm.py``)?"""
    return bool(_SCRIPT_NAME.search(os.path.basename(path)))


def driver_script(path: str) -> bool:
    """A script (``__main__`` or a training script's name) with a loop, or a training script's name
    (``train.py``'s ``main`` may only call ``setup(...)`` and ``conduct_train(model, ...)``, VALOR)."""
    data = _read(path)
    if not data:
        return False
    return training_script_name(path) or (("for " in data or "while " in data) and "__main__" in data)


def importers_beside(path: str, linted: set, limit: int = MAX_CONTEXT_SCAN) -> list:
    """Files that import ``path``: context for a lint of single files. Those in the folder of ``path``,
    its package root and the folder above, then up to MAX_FAR_IMPORTERS in the rest of the project
    (``scripts/train.py`` importing ``utils.train_utils``), nearest folders first; at most ``limit``
    files read in each of the two searches."""
    here = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem == "__init__":
        stem = os.path.basename(here)
    near = list(dict.fromkeys([here] + _package_roots(here)[:1] + [os.path.dirname(here)]))
    found = _importers_in(near, (stem,), path, linted, limit)
    top = _project_top(here)
    folders = []
    if top is not None:
        # nearest in the tree first: ``src/pkg/pipeline/`` before ``examples/*/`` for ``src/pkg/utils/x.py``
        here_parts = here.split(os.sep)
        folders = list(islice(_project_folders(top, set(near)), MAX_FAR_FOLDERS))
        folders.sort(key=lambda d: -_shared_parts(here_parts, d.split(os.sep)))
        found += _importers_in(folders, (stem,), path, linted, limit)[:MAX_FAR_IMPORTERS]
    names = _reexported(here, stem) if os.path.basename(path) != "__init__.py" else ()
    init = os.path.join(here, "__init__.py")
    if names and not [f for f in found if f != init]:
        # ``from lib.train.trainers import LTRTrainer`` where the package's __init__ re-exports it: only
        # when nothing imports the module itself, and the few nearest that name what it re-exports
        package = (os.path.basename(here),)
        says = [n.encode() for n in names]
        for directories in (near, folders):
            found += [f for f in _importers_in(directories, package, path, linted, limit,
                                               also=lambda data: any(w in data for w in says))
                      if f not in found][:max(0, MAX_REEXPORT_IMPORTERS + 1 - len(found))]
    return found


MAX_REEXPORT_IMPORTERS = 2


def _reexported(folder: str, stem: str) -> tuple:
    """The names ``folder/__init__.py`` imports from its module ``stem`` (``from .ltr_trainer import
    LTRTrainer``); () when it imports none."""
    text = _read(os.path.join(folder, "__init__.py"))
    found = re.search(r"^[ \t]*from[ \t]+\.[ \t]*" + re.escape(stem) + r"[ \t]+import[ \t]+\(?([\w, \t\r\n]+|\*)",
                      text, re.M) if text else None
    if found is None:
        return ()
    if found.group(1) == "*":
        # ``from .train_utils import *`` (nanoT5): the module's public functions and classes
        module = _read(os.path.join(folder, stem + ".py")) or ""
        return tuple(dict.fromkeys(n for n in _TOP_DEFINED.findall(module) if not n.startswith("_")))[:MAX_STAR_NAMES]
    return tuple(w for w in re.findall(r"\w+", found.group(1)) if w != "as")


_TOP_DEFINED = re.compile(r"^(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)", re.M)
MAX_STAR_NAMES = 64


MAX_FAR_FOLDERS = 2000

# ``def train_epoch(self, epoch, model, data_loader, ...)``: a method that trains a model it is handed
_ENTRY_METHOD_DEF = re.compile(rb"^[ \t]+def[ \t]+((?:train|fit)\w*|\w*_epoch)[ \t]*\([ \t\r\n]*self\b[^)]*?\bmodel\b",
                               re.M)


def entry_methods(data: bytes) -> tuple:
    """The training methods a file's classes define that take the model as a parameter."""
    if b"model" not in data:
        return ()
    return tuple(dict.fromkeys(m.decode() for m in _ENTRY_METHOD_DEF.findall(data)))


def method_callers_beside(path: str, names: tuple, linted: set, limit: int = MAX_CONTEXT_SCAN) -> list:
    """Files of the project that call one of ``names`` as a method (``self.task.train_epoch(...)``
    on a task a registry made: LAVIS's runner, which does not import the task's module): context for
    a lint of single files, at most MAX_FAR_IMPORTERS of them, nearest folders first."""
    here = os.path.dirname(os.path.abspath(path))
    # (not ``self.training_step(...)`` in a subclass: that is the class's own call, through its imports)
    needles = [re.compile(rb"(?<!self)(?<!super\(\))\." + re.escape(n.encode()) + rb"\(") for n in names]
    near = list(dict.fromkeys([here] + _package_roots(here)[:1] + [os.path.dirname(here)]))
    folders = list(near)
    top = _project_top(here)
    if top is not None:
        here_parts = here.split(os.sep)
        far = list(islice(_project_folders(top, set(near)), MAX_FAR_FOLDERS))
        far.sort(key=lambda d: -_shared_parts(here_parts, d.split(os.sep)))
        folders += far
    return _files_saying(folders, lambda data: any(n.search(data) for n in needles), path, linted,
                         limit)[:MAX_FAR_IMPORTERS]


def _shared_parts(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _importers_in(directories, stems: tuple, path: str, linted: set, limit: int, also=None) -> list:
    """The files that import a module whose last name is one of ``stems`` (and of whose bytes
    ``also`` holds, when given)."""
    words = [stem.encode() for stem in stems]

    def imports_it(data: bytes) -> bool:
        return any(word in data for word in words) and (also is None or also(data)) and \
            any(mod.rsplit(".", 1)[-1] in stems for level, mod in imported_names(data))
    return _files_saying(directories, imports_it, path, linted, limit)


def _files_saying(directories, says, path: str, linted: set, limit: int) -> list:
    """The .py files of ``directories`` (not tests, not the linted ones, not ``path``) whose bytes
    ``says(data)`` holds of, at most ``limit`` files read."""
    out = []
    scanned = 0
    for directory in directories:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if not name.endswith(".py") or _TEST_FILE.match(name):
                continue            # (a test builds toy objects: not how the training runs)
            candidate = os.path.join(directory, name)
            if candidate in linted or candidate == os.path.abspath(path):
                continue
            scanned += 1
            if scanned > limit:
                return out
            try:
                with open(candidate, "rb") as fh:
                    data = fh.read(1_000_000)
            except OSError:
                continue
            if says(data):
                out.append(candidate)
    return out


def _project_top(directory: str):
    """The project a file belongs to: the folder that holds its topmost package (or the file's own
    folder), or the nearest folder above that with a project marker (``pyproject.toml``, ``setup.py``,
    ``.git``: ``src/pkg/engine.py`` beside ``scripts/``), at most two levels up."""
    from synccheck.analyzer.project.index import project_root
    top = _package_roots(directory)[0]
    marked = project_root(top)
    if marked is not None and marked != top and top.startswith(marked + os.sep) and \
            top[len(marked) + 1:].count(os.sep) < 2:
        top = marked
    # (a file straight in a home folder or a filesystem root is no project)
    if os.path.dirname(top) == top or top == os.path.expanduser("~"):
        return None
    return top


_SKIPPED_FOLDERS = frozenset(("node_modules", "site-packages", "dist-packages", "build", "dist", "venv", "env",
                              "__pycache__", "docs", "doc", "tests", "test", "unittests", "testing"))
_TEST_FILE = re.compile(r"test_\w*\.py$|\w*_test\.py$|conftest\.py$|setup\.py$")


def _project_folders(top: str, done: set, depth: int = 4):
    """The project's folders, the shallowest first, skipping hidden ones, virtual environments and
    build output (and ``done``)."""
    level = [top]
    for _ in range(depth):
        following = []
        for directory in level:
            if directory not in done:
                yield directory
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and \
                        e.name not in _SKIPPED_FOLDERS and not os.path.exists(os.path.join(e.path, "pyvenv.cfg")):
                    following.append(e.path)
        level = following


def read_imports(path: str) -> Optional[list]:
    try:
        with open(path, "rb") as fh:
            return imported_names(fh.read(2_000_000))
    except OSError:
        return None
