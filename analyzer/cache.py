"""Results cache: a warm run over an unchanged tree reads no file and parses nothing.

One JSON file per (synccheck version, rule set and the analyzer's files) under ``.synccheck_cache/``. It remembers, per file,
its content hash, whether it holds any word the analysis needs and its import lines (so a warm run
can form the components without reading it; a file's (mtime, size) says whether that memory can be
trusted), and per *component* (files analysed together, see imports.py) the findings, keyed by the
hashes of all its files. A component's result also lists the project modules the analysis read
beyond it, with their (mtime, size): a change there invalidates it too.
A corrupt or unwritable cache is ignored: the cache may make a run faster, never fail it.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Optional

from synccheck import __version__
from synccheck.analyzer.ftypes import FileError, Finding

DEFAULT_DIR = ".synccheck_cache"
MAX_COMPONENTS = 4096


ANALYZER_DIR = os.path.dirname(os.path.abspath(__file__))


def code_stamp(folder: str) -> str:
    """The names, sizes and modification times of the ``.py`` files under ``folder``: what a results
    cache keyed on the version alone would miss (the analyzer edited in place)."""
    parts = []
    for top, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py"):
                try:
                    st = os.stat(os.path.join(top, name))
                except OSError:
                    continue
                parts.append(f"{os.path.relpath(os.path.join(top, name), folder)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def content_key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def component_key(entries: list) -> str:
    """The key of a component: its files' paths and content hashes (and whether each is linted)."""
    digest = hashlib.blake2b(digest_size=16)
    for path, key, linted in sorted(entries):
        digest.update(f"{path}\0{key}\0{int(linted)}\n".encode())
    return digest.hexdigest()


class Cache:
    def __init__(self, directory: str, codes: tuple, edits: bool = True) -> None:
        # "fix1": findings carry their automatic fix since then; older entries would lack it.
        # "lazy": a lint that did not build the fixes' edits (engine.lint(edits=False)) keeps its own
        # and the analyzer's own files: an editable or git install changes them without a new version
        ruleset = hashlib.blake2b((",".join(sorted(codes)) + ";fix1" + ("" if edits else ";lazy") + ";" +
                                   code_stamp(ANALYZER_DIR)).encode(), digest_size=8).hexdigest()
        self.file = os.path.join(directory, __version__, f"{ruleset}.json")
        self.directory = directory
        self.files: dict = {}         # path -> [mtime_ns, size, key, gated, imports, eager]
        self.components: dict = {}    # component key -> {"findings": [...], "errors": [...], "deps": [...]}
        self.used: set = set()
        self.dirty = False
        try:
            with open(self.file, encoding="utf-8") as fh:
                data = json.load(fh)
            if isinstance(data.get("files"), dict) and isinstance(data.get("components"), dict):
                self.files, self.components = data["files"], data["components"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass

    def fresh(self, path: str) -> Optional[tuple]:
        """(content key, gated, imports) remembered for ``path`` if its mtime and size are unchanged."""
        entry = self.files.get(path)
        if not isinstance(entry, list) or len(entry) != 6:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        if [st.st_mtime_ns, st.st_size] != entry[:2]:
            return None
        return entry[2], entry[3], [tuple(i) for i in entry[4]], entry[5]

    def note(self, path: str, key: str, gated: bool, imports: list, eager: bool = False) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        entry = [st.st_mtime_ns, st.st_size, key, gated, [list(i) for i in imports], eager]
        if self.files.get(path) != entry:
            self.files[path] = entry
            self.dirty = True

    def component(self, key: str) -> Optional[tuple]:
        """(findings, errors) of a component analysed before, if the modules it read are unchanged."""
        entry = self.components.get(key)
        if not isinstance(entry, dict):
            return None
        try:
            for path, mtime, size in entry["deps"]:
                st = os.stat(path)
                if [st.st_mtime_ns, st.st_size] != [mtime, size]:
                    return None
            findings = [Finding(**f) for f in entry["findings"]]
            errors = [FileError(path, message) for path, message in entry["errors"]]
        except (OSError, KeyError, TypeError, ValueError):
            return None
        self.used.add(key)
        return findings, errors

    def put(self, key: str, findings: list, errors: list, deps: list) -> None:
        rows = []
        for f in findings:
            row = f.to_json()
            row.setdefault("cell", None)
            rows.append(row)
        stamped = []
        for path in deps:
            try:
                st = os.stat(path)
            except OSError:
                continue
            stamped.append([path, st.st_mtime_ns, st.st_size])
        self.components[key] = {"findings": rows, "errors": [[e.path, e.message] for e in errors], "deps": stamped}
        self.used.add(key)
        self.dirty = True

    def save(self) -> None:
        # bounded: the oldest components not used in this run go first
        excess = len(self.components) - MAX_COMPONENTS
        if excess > 0:
            for k in [k for k in self.components if k not in self.used][:excess]:
                del self.components[k]
            self.dirty = True
        if not self.dirty:
            return
        try:
            os.makedirs(os.path.dirname(self.file), exist_ok=True)
            gitignore = os.path.join(self.directory, ".gitignore")
            if not os.path.exists(gitignore):
                with open(gitignore, "w") as fh:
                    fh.write("# created by synccheck\n*\n")
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.file), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"files": self.files, "components": self.components}, fh)
            os.replace(tmp, self.file)
        except OSError:
            pass
