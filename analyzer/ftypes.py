"""The small value types the analyzer passes between its stages."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Finding:
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

    def to_json(self) -> dict:
        data = asdict(self)
        if self.cell is None:
            data.pop("cell")
        return data


@dataclass(frozen=True)
class FileError:
    """A file that could not be read or decoded (never a crash: the other files go on)."""
    path: str
    message: str

    def to_json(self) -> dict:
        return {"path": self.path, "message": self.message}


@dataclass
class LintResult:
    files: int = 0
    findings: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    parsed: int = 0          # files that needed a parse (the rest were filtered out by their words)
    cached: int = 0          # files whose result came from the cache
