"""Results cache: a warm run over an unchanged tree reads no file and parses nothing.

One JSON file per (synccheck version, rule set) under ``.synccheck_cache/``. Entries are keyed by the
file's content hash; the path's (mtime, size) only says whether the content can be trusted unread.
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


def content_key(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class Cache:
    def __init__(self, directory: str, codes: tuple) -> None:
        ruleset = hashlib.blake2b(",".join(sorted(codes)).encode(), digest_size=8).hexdigest()
        self.file = os.path.join(directory, __version__, f"{ruleset}.json")
        self.directory = directory
        self.by_path: dict = {}       # path -> [mtime_ns, size, key]
        self.by_key: dict = {}        # key -> {"findings": [...], "errors": [...]}
        self.dirty = False
        try:
            with open(self.file, encoding="utf-8") as fh:
                data = json.load(fh)
            self.by_path, self.by_key = data["paths"], data["results"]
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def fresh(self, path: str) -> Optional[tuple]:
        """The cached (findings, errors) of ``path`` if its mtime and size are unchanged."""
        entry = self.by_path.get(path)
        if entry is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        if [st.st_mtime_ns, st.st_size] != entry[:2]:
            return None
        return self._load(path, entry[2])

    def get(self, path: str, key: str) -> Optional[tuple]:
        """The cached result for this content, wherever it was seen."""
        return self._load(path, key) if key in self.by_key else None

    def _load(self, path: str, key: str) -> Optional[tuple]:
        result = self.by_key.get(key)
        if result is None:
            return None
        findings = [Finding(path=path, **f) for f in result["findings"]]
        errors = [FileError(path, message) for message in result["errors"]]
        return findings, errors

    def put(self, path: str, key: str, findings: list, errors: list) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        self.by_path[path] = [st.st_mtime_ns, st.st_size, key]
        rows = []
        for f in findings:
            row = f.to_json()
            row.pop("path")
            rows.append(row)
        self.by_key[key] = {"findings": rows, "errors": [e.message for e in errors]}
        self.dirty = True

    def save(self) -> None:
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
                json.dump({"paths": self.by_path, "results": self.by_key}, fh)
            os.replace(tmp, self.file)
        except OSError:
            pass
