"""The small value types the analyzer passes between its stages.

Named tuples and a plain class, not dataclasses: `dataclasses` imports `inspect`, which would add
~25 ms to every lint's start-up (a pre-commit hook runs it on every commit).
"""
from __future__ import annotations

from typing import NamedTuple, Optional


class Finding(NamedTuple):
    code: str
    name: str
    severity: str            # error | warning
    path: str
    line: int                # 1-based
    column: int              # 1-based
    end_line: int
    end_column: int
    message: str
    fix: str = ""
    cell: Optional[int] = None   # notebooks: 1-based cell number; line is then the line in the cell
    # the automatic fix (analyzer/fix/): {"applicability", "message", "edits"} in ruff's shape, or
    # {"reason"} when none can be proven right; None for a rule that has no fix
    autofix: Optional[dict] = None

    def to_json(self) -> dict:
        data = dict(self._asdict())
        if self.cell is None:
            data.pop("cell")
        return data


class FileError(NamedTuple):
    """A file that could not be read or decoded (never a crash: the other files go on)."""
    path: str
    message: str

    def to_json(self) -> dict:
        return {"path": self.path, "message": self.message}


class LintResult:
    def __init__(self, files: int = 0) -> None:
        self.files = files
        self.findings: list = []
        self.errors: list = []
        self.parsed = 0          # files that needed a parse (the rest were filtered out by their words)
        self.cached = 0          # files whose result came from the cache
        self.fixed = 0           # findings --fix fixed
        self.fix_options = None  # analyzer.fix.apply.FixOptions: which fixes are enabled (for the report)
