"""Fixing a notebook cell by cell: the fixes run on the joined code of its cells (what the analysis
saw), and each changed line goes back to the cell it came from; only those cells' ``source`` changes in
the file, which is written back with its own JSON formatting. A change that would touch a line IPython
syntax was replaced on (``%time``, ``!pip``), straddle two cells, or leave a cell that does not compile
on its own, is not made. ``cell_sources`` is that mapping; ``--format json`` uses it too
(``NotebookSource.map_fix``), so a fix's edits there are the cells' edits ``--fix`` would make.
"""
from __future__ import annotations

import difflib
import json

from synccheck.analyzer.fix.apply import Outcome, fix_text


def fix_notebook(path: str, rules: list, options) -> Outcome:
    from synccheck.analyzer.notebook import parse_notebook
    from synccheck.analyzer.source import read_bytes

    outcome = Outcome(path)
    data, error = read_bytes(path)
    if data is None:
        outcome.error = error.message
        return outcome
    notebook, error = parse_notebook(path, data)
    if notebook is None:
        outcome.error = error.message
        return outcome
    outcome.data = data
    outcome.old = notebook.text
    new, fixed, remaining = fix_text(path, notebook.text, rules, options, failed=outcome.failed,
                                     accept=lambda text: _unmappable(notebook, text))
    if not fixed:
        return outcome
    try:
        changed = cell_sources(notebook, new)
    except ValueError as exc:
        outcome.error = f"not fixed: {exc}"
        return outcome
    payload = _rebuild(data, changed)
    again, _ = parse_notebook(path, payload)
    if again is None or again.text != new:
        outcome.error = "not fixed: the fix cannot be mapped back to the notebook's cells"
        return outcome
    outcome.new = new
    outcome.notebook = payload
    outcome.cells = [(number, notebook.sources[number], changed[number]) for number in sorted(changed)]
    outcome.fixed = fixed
    outcome.remaining = again.map_findings(remaining)
    return outcome


def _unmappable(notebook, text: str):
    """Why the joined code ``text`` cannot be written back to the notebook's cells, or None."""
    try:
        cell_sources(notebook, text)
    except ValueError as exc:
        return str(exc)
    return None


def cell_sources(notebook, new_text: str) -> dict:
    """The new source of every code cell that ``new_text`` (the joined code, changed) changes, as
    ``--fix`` writes it: cell number -> text. ValueError (saying why) when a change cannot be mapped
    back: it spans two cells, or touches a line whose IPython syntax the analysis replaced."""
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
                raise ValueError("the fix would change lines of two notebook cells at once")
            cell = where[0][0]
            for r, (_, line) in zip(range(i1, i2), where):
                if cells[cell][line - 1] != old_lines[r]:
                    raise ValueError(f"the fix would change a line of IPython syntax in cell {cell}")
            cells[cell][where[0][1] - 1:where[-1][1]] = new_lines[j1:j2]
            continue
        if i1 < len(origin) and origin[i1] is not None:
            cell, line = origin[i1]
            cells[cell][line - 1:line - 1] = new_lines[j1:j2]
        else:
            cell, line = notebook.locate(i1)        # after the last line of the cell before
            cells[cell][line:line] = new_lines[j1:j2]
    out = {}
    for number, lines in cells.items():
        if lines != notebook.cells[number]:
            _runs_alone(number, lines)
            old = notebook.sources[number]
            out[number] = "\n".join(lines) + ("\n" if old.endswith("\n") else "")
    return out


def _runs_alone(number: int, lines: list) -> None:
    """Jupyter compiles each cell on its own: a fixed cell must too. The joined code may hold a block
    that runs on from one cell into the next (Jupyter refuses such a cell; the joined text does not),
    and a rewrite of that block would have to change two cells as one."""
    import ast

    from synccheck.analyzer.notebook import python_lines

    try:
        compile("\n".join(python_lines(lines)) + "\n", f"<cell {number}>", "exec",
                ast.PyCF_ONLY_AST | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0), dont_inherit=True)
    except (SyntaxError, ValueError):
        raise ValueError(f"the fix would change a statement that runs across two notebook cells "
                         f"(cell {number} is not valid Python on its own)") from None
    except RecursionError:
        raise ValueError(f"cell {number} is nested too deeply to check") from None


def cell_edits(old: str, new: str) -> list:
    """Ruff-style edits turning one cell's source ``old`` into ``new``, whole lines at a time (as the
    edits of a script are); a cell's last line may lack its newline, so the end of the text is the
    end of that line."""
    from synccheck.analyzer.fix.rewrite import split_lines

    a, b = split_lines(old), split_lines(new)

    def at(index: int) -> dict:
        if index < len(a) or not a or a[-1].endswith(("\n", "\r")):
            return {"row": index + 1, "column": 1}
        return {"row": len(a), "column": len(a[-1]) + 1}

    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.append({"content": "".join(b[j1:j2]), "location": at(i1), "end_location": at(i2)})
    return out


def _rebuild(data: bytes, changed: dict) -> bytes:
    """The notebook ``data`` with the sources of the ``changed`` cells replaced; nothing else changes."""
    document = json.loads(data)
    for number, cell in enumerate(document["cells"], start=1):
        if number not in changed:
            continue
        source = cell.get("source", "")
        text = changed[number]
        cell["source"] = text.splitlines(keepends=True) if isinstance(source, list) else text
    return dump(document, data)


def dump(document, data: bytes) -> bytes:
    """``document`` written the way the notebook ``data`` was: its indent (Jupyter writes 1; none for a
    one-line file), non-ASCII characters as they were (escaped or not), its line endings, BOM and final
    newline."""
    bom = data.startswith(b"\xef\xbb\xbf")
    data = data[3:] if bom else data
    indent = _indent(data)
    text = data.decode("utf-8")
    original = json.loads(data)
    ensure_ascii = False
    if json.dumps(original, indent=indent, ensure_ascii=False) != text.rstrip("\n") and \
            json.dumps(original, indent=indent, ensure_ascii=True) == text.rstrip("\n"):
        ensure_ascii = True
    out = json.dumps(document, indent=indent, ensure_ascii=ensure_ascii)
    if b"\r\n" in data:
        out = out.replace("\n", "\r\n")      # JSON text holds no raw newline but between its tokens
    return (b"\xef\xbb\xbf" if bom else b"") + (out + ("\n" if data.endswith(b"\n") else "")).encode("utf-8")


def _indent(data: bytes):
    """The notebook's own JSON indent (Jupyter writes 1); None when it is all on one line."""
    lines = data.strip().split(b"\n")
    if len(lines) < 2:
        return None
    for line in lines[1:3]:
        stripped = line.lstrip(b" ")
        if stripped.startswith(b'"'):
            return len(line) - len(stripped)
    return 1
