"""Stage 2 for Jupyter notebooks: the code cells as one Python text, and findings mapped back to cells.

A notebook runs its cells in one namespace, so the model is wrapped in one cell and trained in another:
the cells are joined into one text (each cell's lines kept as they are, a blank line between cells) and
analysed like a script. IPython syntax that is not Python (``%time x``, ``%%bash`` cells, ``!pip install``,
``x?``) becomes ``pass`` or blank lines, line for line, so the text parses and line numbers still map.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

from synccheck.analyzer.ftypes import FileError

# Cell magics whose body is Python run as usual (timed, captured, profiled): the body is analysed.
PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun", "debug", "memit", "px", "autoreload"}
# At the start of a logical line, IPython reads these as its own syntax; in Python they cannot start one.
ESCAPES = ("%", "!", "?", "/", ",", ";")
# ``files = !ls`` and ``t = %timeit -o f()``: keep the assignment, drop the command.
ASSIGN_MAGIC = re.compile(r"^(\s*[A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*\s*=\s*)[!%]")
# IPython's automagic: a line magic or shell alias written without its ``%`` (``ls /data``, ``cd ..``,
# ``pip install x``), read as such only when the line is no Python statement.
AUTOMAGIC = re.compile(r"^(?:ls|ll|cd|pwd|cat|mkdir|rmdir|rm|cp|mv|pip|conda|env|clear|load_ext|matplotlib|"
                       r"reload_ext|autoreload|run|time|timeit|who|whos|history|reset|pinfo|alias)\s+\S")


class NotebookSource:
    """The joined code of a notebook and where each of its lines came from."""

    def __init__(self, path: str, text: str, origin: List[Optional[Tuple[int, int]]], cells: dict,
                 sources: Optional[dict] = None) -> None:
        self.path = path
        self.text = text
        self.origin = origin        # joined line (0-based) -> (cell number, line in cell), None: separator
        self.cells = cells          # cell number (1-based among all cells) -> its original source lines
        self.sources = sources if sources is not None else {n: "\n".join(c) for n, c in cells.items()}

    def locate(self, line: int) -> Tuple[int, int]:
        """(cell, line in cell) of a line of the joined text; a separator belongs to the cell before it."""
        index = min(max(line, 1), len(self.origin)) - 1
        while index > 0 and self.origin[index] is None:
            index -= 1
        return self.origin[index] if self.origin and self.origin[index] else (1, 1)

    def map_findings(self, findings: list) -> list:
        out = []
        for f in findings:
            cell, line = self.locate(f.line)
            end_cell, end_line = self.locate(f.end_line)
            end_column = f.end_column
            if end_cell != cell:     # a node spanning cells: clip it to the end of the first one
                own = self.cells.get(cell) or [""]
                end_line = len(own)
                end_column = len(own[-1]) + 1
            out.append(f._replace(line=line, end_line=end_line, end_column=end_column, cell=cell,
                                  autofix=self.map_fix(f.autofix)))
        return out

    def map_fix(self, fix: Optional[dict]) -> Optional[dict]:
        """A fix's edits (made on the joined text) as edits of the cells' own sources: each edit names its
        ``cell`` and counts rows and columns in that cell, as a finding's location does. The fix is
        applied alone and mapped back to the cells the way ``--fix`` writes them, so applying these
        edits to the cells gives what ``--fix`` writes; a fix that cannot be mapped (a change across two
        cells, a line IPython syntax was replaced on) is no fix, with the reason."""
        if not fix or not fix.get("edits"):
            return fix
        from synccheck.analyzer.fix.check import Overlap, apply_edits
        from synccheck.analyzer.fix.notebooks import cell_edits, cell_sources

        try:
            new = cell_sources(self, apply_edits(self.text, fix["edits"]))
        except Overlap:
            return {"reason": "its edits overlap"}
        except ValueError as exc:
            return {"reason": str(exc)}
        edits = [dict(edit, cell=number) for number in sorted(new)
                 for edit in cell_edits(self.sources[number], new[number])]
        return dict(fix, edits=edits) if edits else {"reason": "the rewrite changes nothing in the cells"}


def read_notebook(path: str) -> Tuple[Optional[NotebookSource], Optional[FileError]]:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return None, FileError(path, f"cannot read: {exc.strerror or exc}")
    return parse_notebook(path, data)


def parse_notebook(path: str, data: bytes) -> Tuple[Optional[NotebookSource], Optional[FileError]]:
    import json

    try:
        document = json.loads(data)
    except UnicodeDecodeError as exc:
        return None, FileError(path, f"not a notebook: cannot decode as UTF-8 (byte offset {exc.start})")
    except ValueError as exc:
        return None, FileError(path, f"not a notebook: invalid JSON ({exc})")
    except RecursionError:
        return None, FileError(path, "not a notebook: JSON nested too deeply")
    cells = document.get("cells") if isinstance(document, dict) else None
    if not isinstance(cells, list):
        hint = " (nbformat 3 is not supported; re-save it with Jupyter)" if isinstance(document, dict) and \
            "worksheets" in document else ""
        return None, FileError(path, f"not a notebook: no \"cells\" list{hint}")
    if not _is_python(document):
        return NotebookSource(path, "", [], {}), None
    lines: List[str] = []
    origin: List[Optional[Tuple[int, int]]] = []
    sources: dict = {}
    texts: dict = {}
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            return None, FileError(path, f"not a notebook: cell {number}'s \"source\" is neither text nor a "
                                         f"list of lines")
        cell_lines = source.splitlines()
        sources[number] = cell_lines
        texts[number] = source
        for i, code in enumerate(python_lines(cell_lines), start=1):
            lines.append(code)
            origin.append((number, i))
        lines.append("")             # a cell ends its statements: never let one run into the next
        origin.append(None)
    return NotebookSource(path, "\n".join(lines) + "\n", origin, sources, texts), None


def _is_python(document: dict) -> bool:
    metadata = document.get("metadata")
    if not isinstance(metadata, dict):
        return True
    for key in ("language_info", "kernelspec"):
        info = metadata.get(key)
        language = info.get("name" if key == "language_info" else "language") if isinstance(info, dict) else None
        if isinstance(language, str) and language:
            return language.lower() == "python"
    return True


def python_lines(cell: List[str]) -> List[str]:
    """The cell's lines with IPython syntax replaced, one line out for each line in."""
    # (Colab lets comments come before a cell magic: ``# CI checks`` then ``%%shell``)
    lead = 0
    while lead < len(cell) - 1 and (not cell[lead].strip() or cell[lead].lstrip().startswith("#")):
        lead += 1
    if cell and cell[lead].lstrip().startswith("%%"):
        magic = cell[lead].lstrip()[2:]
        name = magic.split(None, 1)[0] if magic.strip() else ""
        if name not in PYTHON_CELL_MAGICS:
            return [""] * len(cell)          # %%bash, %%writefile, %%html...: not Python at all
        return [""] * (lead + 1) + python_lines(cell[lead + 1:])
    out: List[str] = []
    scanner = _Scanner()
    shell_continues = False         # ``!python train.py \`` goes on on the next line
    for line in cell:
        if shell_continues:
            out.append("")
            shell_continues = line.rstrip().endswith("\\")
            continue
        if scanner.at_statement_start():
            stripped = line.lstrip()
            indent = line[:len(line) - len(stripped)]
            assigned = ASSIGN_MAGIC.match(line)
            if assigned:
                out.append(assigned.group(1) + "None")
                continue
            if stripped.startswith(ESCAPES) or _help_suffix(stripped) or _automagic(stripped):
                out.append(indent + "pass")
                shell_continues = stripped.rstrip().endswith("\\")
                continue
        scanner.feed(line)
        out.append(line)
    return out


def _automagic(stripped: str) -> bool:
    """``ls /kaggle/working/dataset/``: a magic or alias without its ``%``, on a line that is no Python."""
    if not AUTOMAGIC.match(stripped) or stripped.rstrip().endswith(("\\", ":", "(", "[", "{", ",")):
        return False
    try:
        compile(stripped, "<cell>", "exec")
    except SyntaxError:
        return True
    return False


def _help_suffix(stripped: str) -> bool:
    """``obj?`` / ``obj??``: IPython's help. A ``?`` ending a Python line can only be in a comment."""
    if not stripped.rstrip().endswith("?") or stripped.startswith("#"):
        return False
    return "#" not in stripped and "'" not in stripped and '"' not in stripped


class _Scanner:
    """Just enough of the tokenizer to know whether a line starts a new statement: open brackets, open
    triple-quoted strings and backslash continuations mean it does not (``% 4`` there is a modulo)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote: Optional[str] = None    # an open triple-quoted string
        self.continued = False

    def at_statement_start(self) -> bool:
        return self.depth == 0 and self.quote is None and not self.continued

    def feed(self, line: str) -> None:
        i, n = 0, len(line)
        self.continued = False
        while i < n:
            if self.quote is not None:
                end = line.find(self.quote, i)
                while end > 0 and _escaped(line, end):
                    end = line.find(self.quote, end + 1)
                if end < 0:
                    return
                i = end + 3
                self.quote = None
                continue
            c = line[i]
            if c == "#":
                return
            if c in "\"'":
                if line.startswith(c * 3, i):
                    self.quote = c * 3
                    i += 3
                    continue
                j = i + 1
                while j < n and line[j] != c:
                    j += 2 if line[j] == "\\" else 1
                i = j + 1
                continue
            if c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth = max(0, self.depth - 1)
            elif c == "\\" and line[i + 1:].strip() == "":
                self.continued = True
                return
            i += 1


def _escaped(line: str, index: int) -> bool:
    backslashes = 0
    while index - backslashes - 1 >= 0 and line[index - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1
