"""Stage 1: find the files to check. Never follows directory symlinks (no loops), skips environments,
and honours ``.gitignore`` the way git does (a small matcher here: no dependency for it)."""
from __future__ import annotations

import os
import re
from typing import Callable, Iterable, List, Optional

# Folders that are never user training code (ruff's defaults, plus caches of our own).
SKIP_DIRS = {
    ".bzr", ".direnv", ".eggs", ".git", ".git-rewrite", ".hg", ".ipynb_checkpoints", ".mypy_cache",
    ".nox", ".pants.d", ".pyenv", ".pytest_cache", ".pytype", ".ruff_cache", ".svn", ".tox", ".venv",
    ".vscode", "__pypackages__", "_build", "buck-out", "dist", "node_modules", "site-packages", "venv",
    "__pycache__", ".synccheck_cache", ".ci-venv",
}
SOURCE_SUFFIXES = (".py", ".ipynb")     # not .pyi: stubs hold no training loops


class UsageError(Exception):
    """A mistake on the command line or in the configuration: exit code 2."""


class IgnorePatterns:
    """Gitignore-style patterns, relative to one folder (``base``); the last pattern that matches wins.

    Supported as git documents them: ``#`` comments, ``!`` negation, ``dir/`` (folders only), a slash at
    the start or in the middle anchors the pattern to ``base`` (otherwise it matches a name at any depth),
    ``*``/``?``/``[a-z]`` within one path segment, and ``**/``, ``/**/``, ``/**`` across segments.
    """

    def __init__(self, base: str, lines: Iterable[str], source: str = "") -> None:
        self.base = os.path.abspath(base)
        self.source = source
        self.rules: list = []    # (regex, negate, dir_only, anchored)
        self.invalid: list = []  # patterns no regex can express ("[z-a]"): git never matches them either
        for line in lines:
            try:
                rule = _compile(line)
            except re.error:
                self.invalid.append(line)
                continue
            if rule is not None:
                self.rules.append(rule)

    @classmethod
    def from_file(cls, path: str) -> Optional["IgnorePatterns"]:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return None
        patterns = cls(os.path.dirname(path), lines, path)
        return patterns if patterns.rules else None

    def match(self, path: str, is_dir: bool, outside: bool = False) -> Optional[bool]:
        """True (ignored), False (re-included by ``!``) or None (no pattern says). ``path`` is absolute.

        A path outside ``base`` is never matched, unless ``outside``: then its name alone is tried
        against the unanchored patterns (how a config's ``exclude = ["build"]`` reads anywhere).
        """
        if path == self.base:
            return None            # the folder a configuration lives in is never excluded by it
        rel = _relative(path, self.base)
        if rel is None:
            if not outside:
                return None
            rel = os.path.basename(path)
            candidates = [r for r in self.rules if not r[3]]
        else:
            candidates = self.rules
        name = rel.rsplit("/", 1)[-1]
        verdict = None
        for regex, negate, dir_only, anchored in candidates:
            if dir_only and not is_dir:
                continue
            if regex.fullmatch(rel if anchored else name):
                verdict = not negate
        return verdict


def _relative(path: str, base: str) -> Optional[str]:
    if path == base:
        return None
    prefix = base if base.endswith(os.sep) else base + os.sep
    if not path.startswith(prefix):
        return None
    return path[len(prefix):].replace(os.sep, "/")


def _compile(line: str):
    if not line or line.startswith("#"):
        return None
    # trailing spaces are dropped unless escaped with a backslash
    stripped = line.rstrip(" ")
    if stripped.endswith("\\") and len(stripped) < len(line):
        stripped += " "
    line = stripped
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    elif line.startswith("\\!") or line.startswith("\\#"):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    return re.compile(_translate(line)), negate, dir_only, anchored


def _translate(pattern: str) -> str:
    out: List[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        at_segment_start = i == 0 or pattern[i - 1] == "/"
        if c == "*" and pattern.startswith("**", i) and at_segment_start and (i + 2 == n or pattern[i + 2] == "/"):
            if i + 2 == n:
                out.append(".*")                   # "x/**": everything inside x; "**": everything
                i += 2
            else:
                out.append("(?:.*/)?")             # "**/": zero or more folders
                i += 3
            continue
        elif c == "*":
            while i < n and pattern[i] == "*":
                i += 1
            out.append("[^/]*")
            continue
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape(c))            # no closing bracket: a literal "["
            else:
                body = pattern[i + 1:j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def git_root(start: str) -> Optional[str]:
    """The nearest folder at or above ``start`` that holds ``.git`` (a folder, or a file in a worktree)."""
    here = os.path.abspath(start)
    while True:
        if os.path.exists(os.path.join(here, ".git")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _inherited_gitignores(root: str) -> list:
    """The ``.gitignore`` files above a walked folder, from the repository root down (outside a git
    repository none: a stray ``~/.gitignore`` is often a global excludes file, not this project's)."""
    top = git_root(root)
    if top is None or top == root:
        return []
    chain = []
    here = os.path.dirname(root)
    while True:
        chain.append(here)
        if here == top:
            break
        here = os.path.dirname(here)
    found = []
    for folder in reversed(chain):
        patterns = IgnorePatterns.from_file(os.path.join(folder, ".gitignore"))
        if patterns is not None:
            found.append(patterns)
    return found


def _ignored(stack: list, path: str, is_dir: bool) -> bool:
    verdict = None
    for patterns in stack:          # shallowest first: a deeper .gitignore overrides its parents
        said = patterns.match(path, is_dir)
        if said is not None:
            verdict = said
    return bool(verdict)


def discover(paths: Iterable[str], is_excluded: Callable[[str], bool] = lambda path: False,
             respect_gitignore: bool = True) -> list:
    """Every file to lint, in a stable order. A path that does not exist is a usage error.

    ``is_excluded`` (the configuration's ``exclude``) applies to named files too, so a pre-commit run,
    which names every file, honours it; ``.gitignore`` applies to folder walks only.
    """
    found: list = []
    seen: set = set()

    real_dirs: dict = {}

    def add(path: str) -> None:
        # realpath walks every component with lstat: resolve each folder once, and a file itself only
        # when it is a link
        if os.path.islink(path):
            real = os.path.realpath(path)
        else:
            folder, name = os.path.split(path)
            real_dir = real_dirs.get(folder)
            if real_dir is None:
                real_dir = real_dirs[folder] = os.path.realpath(folder or ".")
            real = os.path.join(real_dir, name)
        if real not in seen:
            seen.add(real)
            found.append(path)

    for root in paths:
        if not os.path.lexists(root):
            raise UsageError(f"{root}: no such file or directory")
        if is_excluded(root):
            continue
        if not os.path.isdir(root):
            add(root)          # a file named explicitly is checked whatever its name
            continue
        absolute_root = os.path.abspath(root)
        stacks = {absolute_root: _inherited_gitignores(absolute_root) if respect_gitignore else []}
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            absolute = os.path.normpath(os.path.join(absolute_root, os.path.relpath(dirpath, root)))
            stack = stacks.pop(absolute, [])
            if respect_gitignore and ".gitignore" in filenames:
                own = IgnorePatterns.from_file(os.path.join(dirpath, ".gitignore"))
                if own is not None:
                    stack = stack + [own]
            kept = []
            for d in sorted(dirnames):
                if (d in SKIP_DIRS or d.endswith(".egg-info")
                        or os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
                        or is_excluded(os.path.join(dirpath, d))):
                    continue
                if stack and _ignored(stack, os.path.join(absolute, d), True):
                    continue
                kept.append(d)
                stacks[os.path.join(absolute, d)] = stack
            dirnames[:] = kept
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(dirpath, name)
                    if path.startswith("./"):
                        path = path[2:]        # `lint .` reports `train.py`, as ruff does, not `./train.py`
                    if stack and _ignored(stack, os.path.join(absolute, name), False):
                        continue
                    if not is_excluded(path):      # a broken symlink is kept: reading it says so
                        add(path)
    return found
