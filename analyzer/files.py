"""Stage 1: find the files to check. Never follows directory symlinks (no loops), skips environments."""
from __future__ import annotations

import os
from typing import Iterable

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


def discover(paths: Iterable[str], is_excluded=lambda path: False) -> list:
    """Every file to lint, in a stable order. A path that does not exist is a usage error."""
    found: list = []
    seen: set = set()

    def add(path: str) -> None:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            found.append(path)

    for root in paths:
        if not os.path.lexists(root):
            raise UsageError(f"{root}: no such file or directory")
        if not os.path.isdir(root):
            add(root)          # a file named explicitly is checked whatever its name
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(
                d for d in dirnames
                if d not in SKIP_DIRS and not d.endswith(".egg-info")
                and not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))
                and not is_excluded(os.path.join(dirpath, d))
            )
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(dirpath, name)
                    if not is_excluded(path):
                        add(path)
    return found
