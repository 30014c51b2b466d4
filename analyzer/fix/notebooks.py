"""Fixing a notebook cell by cell: the fixes run on the joined code of its cells (what the analysis
saw), and each changed line goes back to the cell it came from. A change that would touch a line
IPython syntax was replaced on (``%time``, ``!pip``), or straddle two cells, is not written."""
from __future__ import annotations

import difflib
import json

from synccheck.analyzer.fix.apply import Outcome, fix_text


def fix_notebook(path: str, rules: list, options) -> Outcome:
    from synccheck.analyzer.notebook import parse_notebook

    outcome = Outcome(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        outcome.error = f"cannot read: {exc.strerror or exc}"
        return outcome
    notebook, error = parse_notebook(path, data)
    if notebook is None:
        outcome.error = error.message
        return outcome
    outcome.data = data
    outcome.old = notebook.text
    new, fixed, remaining = fix_text(path, notebook.text, rules, options)
    if not fixed:
        return outcome
    try:
        payload = _rebuild(data, notebook, new)
    except ValueError as exc:
        outcome.error = f"not fixed: {exc}"
        return outcome
    again, _ = parse_notebook(path, payload)
    if again is None or again.text != new:
        outcome.error = "not fixed: the fix cannot be mapped back to the notebook's cells"
        return outcome
    outcome.new = new
    outcome.notebook = payload
    outcome.fixed = fixed
    outcome.remaining = again.map_findings(remaining)
    return outcome


def _rebuild(data: bytes, notebook, new_text: str) -> bytes:
    old_lines = notebook.text.split("\n")
    new_lines = new_text.split("\n")
    origin = notebook.origin
    cells = {n: list(lines) for n, lines in notebook.cells.items()}
    ops = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in reversed(ops):
        if tag == "equal":
            continue
        if i2 > i1:
            where = [origin[r] if r < len(origin) else None for r in range(i1, i2)]
            if any(w is None for w in where) or len({w[0] for w in where}) != 1:
                raise ValueError("a fix would change lines of two cells at once")
            cell = where[0][0]
            for r, (_, line) in zip(range(i1, i2), where):
                if cells[cell][line - 1] != old_lines[r]:
                    raise ValueError(f"a fix would change IPython syntax in cell {cell}")
            cells[cell][where[0][1] - 1:where[-1][1]] = new_lines[j1:j2]
            continue
        if i1 < len(origin) and origin[i1] is not None:
            cell, line = origin[i1]
            cells[cell][line - 1:line - 1] = new_lines[j1:j2]
        else:
            cell, line = notebook.locate(i1)        # after the last line of the cell before
            cells[cell][line:line] = new_lines[j1:j2]
    document = json.loads(data)
    for number, cell in enumerate(document["cells"], start=1):
        if number not in cells or cells[number] == notebook.cells[number]:
            continue
        source = cell.get("source", "")
        old = "".join(source) if isinstance(source, list) else source
        text = "\n".join(cells[number]) + ("\n" if old.endswith("\n") else "")
        cell["source"] = text.splitlines(keepends=True) if isinstance(source, list) else text
    indent = _indent(data)
    out = json.dumps(document, indent=indent, ensure_ascii=False)
    return (out + ("\n" if data.endswith(b"\n") else "")).encode("utf-8")


def _indent(data: bytes) -> int:
    """The notebook's own JSON indent (Jupyter writes 1)."""
    for line in data.split(b"\n")[1:3]:
        stripped = line.lstrip(b" ")
        if stripped.startswith(b'"'):
            return len(line) - len(stripped)
    return 1
