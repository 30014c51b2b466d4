"""``[tool.synccheck]`` in ``pyproject.toml``: which rules run, on which files.

Found as ruff finds its own: the nearest ``pyproject.toml`` above the current directory that has a
``[tool.synccheck]`` table (or the file given with ``--config``). Paths in it are relative to the folder
the file is in. Any mistake in it is a usage error (exit 2) naming the file and the key: a config that
is silently half-read lints the wrong things without anyone noticing.

    [tool.synccheck]
    select = ["SC1"]                 # code prefixes, ruff style; default: every rule
    ignore = ["SC102"]
    exclude = ["legacy/", "*_old.py"]   # gitignore-style, on top of the default skips
    extend-exclude = ["scratch/"]
    per-file-ignores = { "tests/*" = ["SC101"], "notebooks/" = ["SC1"] }
    fix = true                       # as --fix; unsafe-fixes = true as --unsafe-fixes
    fixable = ["SC1"]                # the codes --fix may fix (default: all); unfixable = [...] never
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from synccheck.analyzer.files import IgnorePatterns, UsageError

FILENAME = "pyproject.toml"
KEYS = ("select", "ignore", "exclude", "extend-exclude", "per-file-ignores", "fix", "unsafe-fixes", "fixable",
        "unfixable")


class Config:
    # A plain class, not a dataclass: `dataclasses` imports `inspect`, ~25 ms of every lint's start-up.
    def __init__(self, path: Optional[str] = None, root: Optional[str] = None,
                 select: Optional[List[str]] = None, ignore: Optional[List[str]] = None,
                 exclude: Optional[List[str]] = None,
                 per_file_ignores: Optional[Dict[str, List[str]]] = None, fix: Optional[bool] = None,
                 unsafe_fixes: Optional[bool] = None, fixable: Optional[List[str]] = None,
                 unfixable: Optional[List[str]] = None) -> None:
        self.path = path                        # the file it came from; None: no configuration
        self.root = os.path.abspath(root or os.getcwd())
        self.select = select                    # None: not given (every rule)
        self.ignore = list(ignore or [])
        self.exclude = list(exclude or [])
        self.per_file_ignores = dict(per_file_ignores or {})
        self.fix = fix                          # None: not given (the command line decides)
        self.unsafe_fixes = unsafe_fixes
        self.fixable = fixable                  # None: every rule's fix
        self.unfixable = list(unfixable or [])
        self._exclude = IgnorePatterns(self.root, self.exclude) if self.exclude else None
        self._dir_only = any(p.rstrip(" ").endswith("/") for p in self.exclude)
        self._per_file = [(IgnorePatterns(self.root, [pattern.lstrip("!")]), pattern.startswith("!"), tuple(codes))
                          for pattern, codes in self.per_file_ignores.items()]

    def is_excluded(self, path: str) -> bool:
        """Whether ``exclude``/``extend-exclude`` name this path or a folder it is in."""
        if self._exclude is None:
            return False
        absolute = os.path.abspath(path)
        is_dir = self._dir_only and os.path.isdir(absolute)
        return _covers(self._exclude, absolute, is_dir)

    def ignored_codes(self, path: str) -> Tuple[str, ...]:
        """The code prefixes ``per-file-ignores`` turns off for this file."""
        if not self._per_file:
            return ()
        absolute = os.path.abspath(path)
        codes: list = []
        for patterns, negated, prefixes in self._per_file:
            # "!tests/*": the codes are ignored everywhere *but* there (ruff's negated per-file pattern)
            if _covers(patterns, absolute, False) != negated:
                codes.extend(prefixes)
        return tuple(codes)


def _covers(patterns: IgnorePatterns, path: str, is_dir: bool) -> bool:
    """The path, or a folder it is in, is matched: a pattern that names a folder covers what is inside."""
    verdict = patterns.match(path, is_dir, outside=True)
    if verdict is not None:
        return verdict
    here = os.path.dirname(path)
    while here != patterns.base and here != os.path.dirname(here):
        if patterns.match(here, True, outside=True):
            return True
        here = os.path.dirname(here)
    return False


def find_config(start: Optional[str] = None) -> Optional[str]:
    """The nearest ``pyproject.toml`` at or above ``start`` with a ``[tool.synccheck]`` table."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        candidate = os.path.join(here, FILENAME)
        if os.path.isfile(candidate):
            data = _read(candidate)
            # cheap test first: most pyproject.toml files never mention us and need no TOML parse
            if b"synccheck" in data and _table(candidate, data) is not None:
                return candidate
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def load_config(path: Optional[str] = None, start: Optional[str] = None) -> Config:
    """The configuration from ``path`` (``--config``), else the nearest one, else the defaults."""
    if path is not None:
        if os.path.isdir(path):
            raise UsageError(f"--config {path}: a folder, not a file (pass "
                             f"{os.path.join(path, 'pyproject.toml')})")
        if not os.path.isfile(path):
            raise UsageError(f"--config {path}: no such file")
    else:
        path = find_config(start)
        if path is None:
            return Config()
    table = _table(path, _read(path)) or {}
    return Config(path=path, root=os.path.dirname(os.path.abspath(path)), **_validate(path, table))


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _table(path: str, data: bytes) -> Optional[dict]:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python < 3.11
        import tomli as tomllib
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not valid UTF-8 (byte offset {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    tool = document.get("tool")
    table = tool.get("synccheck") if isinstance(tool, dict) else None
    if table is not None and not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.synccheck] must be a table")
    return table


def _validate(path: str, table: dict) -> dict:
    def fail(key: str, message: str):
        raise UsageError(f"{path}: [tool.synccheck] {key}: {message}")

    def strings(key: str, value) -> list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail(key, f"expected a list of strings, got {value!r}")
        return list(value)

    def codes(key: str, value) -> list:
        found = [v.strip().upper() for v in strings(key, value)]
        for code in found:
            if not known_code(code):
                fail(key, f"unknown rule code or prefix {code!r} (see `synccheck rule --all`)")
        return found

    out: dict = {"exclude": []}
    for key, value in table.items():
        if key not in KEYS:
            hint = f" (did you mean {key.replace('_', '-')!r}?)" if key.replace("_", "-") in KEYS else ""
            fail(key, f"unknown key{hint}; known keys: {', '.join(KEYS)}")
        if key in ("select", "ignore"):
            out[key] = codes(key, value)
        elif key in ("fixable", "unfixable"):
            out[key] = codes(key, value)
        elif key in ("fix", "unsafe-fixes"):
            if not isinstance(value, bool):
                fail(key, f"expected true or false, got {value!r}")
            out[key.replace("-", "_")] = value
        elif key in ("exclude", "extend-exclude"):
            patterns = strings(key, value)
            bad = IgnorePatterns(".", patterns).invalid
            if bad:
                fail(key, f"invalid pattern {bad[0]!r}")
            out["exclude"] += patterns
        else:
            if not isinstance(value, dict):
                fail(key, f"expected a table of pattern = [codes], got {value!r}")
            bad = IgnorePatterns(".", [p.lstrip("!") for p in value]).invalid
            if bad:
                fail(key, f"invalid pattern {bad[0]!r}")
            out["per_file_ignores"] = {pattern: codes(f"{key} {pattern!r}", v) for pattern, v in value.items()}
    return out


def known_code(code: str) -> bool:
    from synccheck.analyzer.rules import ALL_RULES

    return code == "ALL" or any(r.code.startswith(code) for r in ALL_RULES)


def resolve_rules(config: Config, select: Optional[Sequence[str]] = None,
                  ignore: Optional[Sequence[str]] = None) -> list:
    """The rules to run: the config's selection, then the command line's on top (ruff's semantics).

    A ``--select`` replaces the configured set (the config's ``ignore`` goes with it); a lone ``--ignore``
    removes from it. Within one layer a more specific code wins (``select = ["SC101"]`` beats
    ``ignore = ["SC1"]``), and at equal specificity ``ignore`` wins.
    """
    from synccheck.analyzer.rules import ALL_RULES

    codes = [r.code for r in ALL_RULES]
    enabled = set(codes)
    carried: list = []
    for layer_select, layer_ignore in ((config.select, config.ignore), (select, ignore or [])):
        ignores, carried = list(layer_ignore) + carried, []
        updates: dict = {}
        for spec in sorted({_specificity(c) for c in list(layer_select or []) + ignores}):
            for prefix in layer_select or ():
                if _specificity(prefix) == spec:
                    updates.update((c, True) for c in codes if _matches(c, prefix))
            for prefix in ignores:
                if _specificity(prefix) == spec:
                    updates.update((c, False) for c in codes if _matches(c, prefix))
        if layer_select is not None:
            enabled = {c for c, on in updates.items() if on}
            if not layer_select and layer_ignore:
                carried = list(layer_ignore)
        else:
            for c, on in updates.items():
                (enabled.add if on else enabled.discard)(c)
    return [r for r in ALL_RULES if r.code in enabled]


def _specificity(prefix: str) -> int:
    return 0 if prefix == "ALL" else len(prefix)


def _matches(code: str, prefix: str) -> bool:
    return prefix == "ALL" or code.startswith(prefix)
