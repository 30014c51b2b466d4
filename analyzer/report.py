"""Stage 6: report. One function a format; they all take the same LintResult."""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import TextIO

from synccheck import __version__
from synccheck.analyzer.ftypes import LintResult

FORMATS = ("full", "concise", "json", "sarif", "github")


def _where(f) -> str:
    cell = f" (cell {f.cell})" if f.cell is not None else ""
    return f"{f.path}:{f.line}:{f.column}{cell}"


def render(result: LintResult, fmt: str, out: TextIO = sys.stdout, statistics: bool = False,
           err: TextIO = sys.stderr, quiet: bool = False) -> None:
    """`statistics`: as ruff, the count per code replaces the findings in the text formats; with a
    machine-readable format the report stays whole on `out` and the counts go to `err`.
    `quiet` (ruff's --quiet): the findings only, without the closing summary or "All checks passed!"."""
    if statistics and fmt in ("full", "concise"):
        _statistics(result, out)
        if not quiet:
            _summary_plain(result, out)
        return
    if fmt == "json":
        out.write(json.dumps(to_json(result), indent=2) + "\n")
    elif fmt == "sarif":
        out.write(json.dumps(to_sarif(result), indent=2) + "\n")
    elif fmt == "github":
        for f in result.findings:
            level = "error" if f.severity == "error" else "warning"
            msg = f"{f.code} {f.name}: {f.message}".replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
            out.write(f"::{level} title=synccheck ({f.code}),file={f.path},line={f.line},col={f.column},"
                      f"endLine={f.end_line},endColumn={f.end_column}::{msg}\n")
        for e in result.errors:
            out.write(f"::error file={e.path}::{e.message}\n")
    elif fmt == "concise":
        for f in result.findings:
            out.write(f"{_where(f)}: {f.code} [{f.severity}] {f.message}\n")
        for e in result.errors:
            out.write(f"{e.path}: error: {e.message}\n")
        if not quiet:
            _summary_plain(result, out)
    else:
        _full(result, out, quiet)
    if statistics:
        _statistics(result, err)


def _summary_plain(result: LintResult, out: TextIO) -> None:
    if result.fixed:
        out.write(_fixed_line(result) + "\n")
    if not result.findings and not result.errors:
        out.write(f"All checks passed! ({_files(result.files)} checked)\n")
        return
    n = len(result.findings)
    errors = sum(1 for f in result.findings if f.severity == "error")
    out.write(f"Found {n} problem{'s' if n != 1 else ''} ({errors} error{'s' if errors != 1 else ''}, "
              f"{n - errors} warning{'s' if n - errors != 1 else ''})"
              f"{f' and {len(result.errors)} file error' + ('s' if len(result.errors) != 1 else '') if result.errors else ''}"
              f" in {_files(result.files)}.\n")
    line = _fixable_line(result)
    if line:
        out.write(line + "\n")


def _options(result):
    options = getattr(result, "fix_options", None)
    if options is None:
        from synccheck.analyzer.fix.apply import FixOptions
        options = result.fix_options = FixOptions()
    return options


def _fixed_line(result) -> str:
    n = result.fixed
    return f"Fixed {n} problem{'s' if n != 1 else ''}."


def _fixable_line(result) -> str:
    """ruff's "[*] N fixable with the --fix option (M hidden fixes can be enabled with ...)"."""
    if not result.findings:
        return ""
    options = _options(result)
    fixable = sum(1 for f in result.findings if options.enabled(f))
    hidden = sum(1 for f in result.findings if options.hidden(f))
    more = f"{hidden} hidden fix{'es' if hidden != 1 else ''} can be enabled with --unsafe-fixes"
    if fixable:
        return f"[*] {fixable} fixable with --fix" + (f" ({more})" if hidden else "")
    return f"No fixes available ({more})." if hidden else ""


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _full(result: LintResult, out: TextIO, quiet: bool = False) -> None:
    if not result.findings and not result.errors:
        # a clean run must stay fast (pre-commit): no rich import for one line
        if not quiet:
            if result.fixed:
                out.write(_fixed_line(result) + "\n")
            out.write(f"All checks passed! ({_files(result.files)} checked)\n")
        return
    options = _options(result)
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=not out.isatty(),
                      force_terminal=None if out.isatty() else False)
    # Source lines are cut to this many cells, as ruff does: the terminal's width, or (a file, a pipe,
    # CI logs) $COLUMNS when set, else 140, ruff's default.
    code_width = console.width if out.isatty() or os.environ.get("COLUMNS") else SNIPPET_WIDTH
    sources: dict = {}
    for f in result.findings:
        color = "red" if f.severity == "error" else "yellow"
        head = Text()
        head.append(_where(f), style="bold")
        head.append(": ")
        head.append(f.code, style=f"bold {color}")
        head.append(f" {f.name}", style=color)
        head.append(f" [{f.severity}]", style="dim")
        console.print(head)
        console.print(Text("  " + f.message))
        lines = _source_lines(f, sources)
        if lines and f.line <= len(lines):
            width = len(str(f.line))
            gutter = len(f"  {'':>{width}} | ")
            shown, (caret_at, caret_len) = snippet(lines, f, code_width - gutter)
            for number, text in shown:
                console.print(Text(f"  {number:>{width}} | ", style="dim") + Text(text))
            caret = " " * caret_at + "^" * caret_len
            console.print(Text(f"  {'':>{width}} | ", style="dim") + Text(caret, style=f"bold {color}"))
        if f.fix:
            console.print(Text("  fix: ", style="bold cyan") + Text(f.fix))
        auto = f.autofix or {}
        if options.enabled(f):
            console.print(Text("  [*] ", style="bold cyan") + Text(f"{auto['message']} (fixable with --fix)"))
        elif options.hidden(f):
            console.print(Text("  [*] ", style="dim") + Text(f"{auto['message']} (unsafe fix: --fix --unsafe-fixes)"))
        elif auto.get("reason") and options.selected(f.code):
            console.print(Text("  no automatic fix: ", style="dim") + Text(auto["reason"]))
        console.print()
    for e in result.errors:
        console.print(Text(f"{e.path}: ", style="bold") + Text("error: ", style="bold red") + Text(e.message))
    if quiet:
        return
    buf = Text()
    if result.fixed:
        buf.append(_fixed_line(result) + "\n", style="bold")
    n, errors = len(result.findings), sum(1 for f in result.findings if f.severity == "error")
    if n:
        buf.append(f"Found {n} problem{'s' if n != 1 else ''}", style="bold")
        buf.append(f" ({errors} error{'s' if errors != 1 else ''}, {n - errors} warning{'s' if n - errors != 1 else ''})")
    if result.errors:
        buf.append((" and " if n else "") + f"{len(result.errors)} file error{'s' if len(result.errors) != 1 else ''}",
                   style="bold")
    buf.append(f" in {_files(result.files)}.")
    line = _fixable_line(result)
    if line:
        buf.append("\n" + line)
    console.print(buf)


SNIPPET_WIDTH = 140
CUT = "..."                 # ASCII, like ruff's: any terminal shows it in 3 cells
MIN_CODE_WIDTH = 40         # never cut narrower than this, even in a very narrow terminal
# Shown as nothing: bidirectional overrides and zero-width joiners would reorder or hide what the terminal
# shows (the "Trojan Source" characters), as ruff's renderer drops them.
_INVISIBLE = dict.fromkeys(map(ord, "\u200d\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"), "")


def _cell_text(char: str) -> str:
    """What one source character is shown as: a tab as 4 spaces (ruff's), another control character as
    its Unicode control picture (an ESC in a string literal must not drive the terminal)."""
    if char == "\t":
        return "    "
    code = ord(char)
    if code < 0x20 or code == 0x7f:
        return chr(0x2400 + code) if code < 0x20 else "\u2421"
    return char.translate(_INVISIBLE)


def snippet(lines: list, f, code_width: int) -> tuple:
    """The source lines of finding `f` as shown: ``([(number, text), ...], (caret_offset, caret_len))``.

    Lines longer than `code_width` terminal cells are cut around the reported span, the same window
    for every line shown so they stay aligned, with ``...`` where text was cut (ruff's renderer does
    the same). Offsets are in terminal cells: tabs, wide (CJK) characters and control characters are
    measured as the terminal shows them, so the caret stays under the reported column."""
    from rich.cells import cell_len

    code_width = max(MIN_CODE_WIDTH, code_width)
    numbers = list(range(max(1, f.line - 1), f.line + 1))
    # per line: the shown text of each character, and its width in cells
    cells = []
    for number in numbers:
        pieces = [_cell_text(ch) for ch in lines[number - 1].rstrip("\r\n")]
        cells.append((pieces, [cell_len(p) for p in pieces]))
    pieces, widths = cells[-1]
    start_char = min(max(f.column - 1, 0), len(pieces))
    end_char = f.end_column - 1 if f.end_line == f.line else len(pieces)
    end_char = min(max(end_char, start_char + 1), max(len(pieces), start_char + 1))
    span_left = sum(widths[:start_char])
    span_right = max(span_left + 1, sum(widths[:end_char]))
    longest = max(sum(w) for _, w in cells)
    if longest <= code_width:
        left, right = 0, longest
    else:
        # Room for the markers on both sides; the span as near the middle as the line allows, and
        # when even the span does not fit, its start with a little context before it.
        room = code_width - 2 * len(CUT)
        left = span_left - max((room - (span_right - span_left)) // 2, min(6, span_left))
        left = max(0, min(left, longest - room))
        right = left + room
    shown = []
    for number, (pieces, widths) in zip(numbers, cells):
        text, at, first_at = [], 0, None
        for piece, w in zip(pieces, widths):
            if at >= left and at + w <= right:
                first_at = at if first_at is None else first_at
                text.append(piece)
            at += w
        # a wide character cut by the left edge leaves its cell blank, so the columns stay put
        pad = " " * (first_at - left) if first_at is not None else ""
        shown.append((number, (CUT if left > 0 else "") + pad + "".join(text) + (CUT if at > right else "")))
    caret_at = (len(CUT) if left > 0 else 0) + max(0, span_left - left)
    caret_len = max(1, min(span_right, right) - max(span_left, left))
    return shown, (caret_at, caret_len)


def _source_lines(f, cache: dict) -> list:
    if f.cell is not None:
        if (f.path, f.cell) not in cache:
            from synccheck.analyzer.notebook import read_notebook
            notebook, _ = read_notebook(f.path) if os.path.isfile(f.path) else (None, None)
            cache[(f.path, f.cell)] = notebook.cells.get(f.cell, []) if notebook else []
        return cache[(f.path, f.cell)]
    if f.path not in cache:
        from synccheck.analyzer.source import read_source
        text, _ = read_source(f.path) if os.path.isfile(f.path) else (None, None)
        cache[f.path] = text.splitlines() if text else []
    return cache[f.path]


def _statistics(result: LintResult, out: TextIO) -> None:
    counts = Counter((f.code, f.name) for f in result.findings)
    for (code, name), count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        out.write(f"{count:>5}  {code}  {name}\n")


def to_json(result: LintResult) -> dict:
    return {"version": 1, "files": result.files,
            "findings": [_public(f) for f in result.findings],
            "errors": [e.to_json() for e in result.errors]}


def _public(f) -> dict:
    """A finding as JSON: ``fix`` in ruff's shape. A finding with no automatic fix keeps its advice as
    a fix that is only displayed ("display-only", ruff's third applicability), with the reason."""
    row = f.to_json()
    auto = row.pop("autofix", None) or {}
    if auto.get("edits"):
        row["fix"] = {"applicability": auto["applicability"], "message": auto["message"], "edits": auto["edits"]}
    else:
        reason = auto.get("reason")
        message = f.fix + (f" (no automatic fix: {reason})" if reason else "")
        row["fix"] = {"applicability": "display-only", "message": message, "edits": []}
    return row


def _artifact(path: str) -> dict:
    """Relative to the checkout (what code scanning matches against), or an absolute file URI."""
    rel = os.path.relpath(os.path.abspath(path))
    if not rel.startswith(".."):
        return {"uri": rel.replace(os.sep, "/"), "uriBaseId": "%SRCROOT%"}
    from pathlib import Path
    return {"uri": Path(path).resolve().as_uri()}


def to_sarif(result: LintResult) -> dict:
    from synccheck.analyzer.rules import ALL_RULES

    rules = [{
        "id": r.code, "name": r.name,
        "shortDescription": {"text": r.summary},
        "fullDescription": {"text": " ".join(r.what.split())},
        "help": {"text": r.documentation(), "markdown": r.documentation()},
        "helpUri": f"https://github.com/synccheck/synccheck/blob/main/analyzer/rules/{r.code.lower()}.py",
        "defaultConfiguration": {"level": "error" if r.severity == "error" else "warning"},
        "properties": {"tags": ["pytorch", "distributed"]},
    } for r in ALL_RULES]
    index = {r.code: i for i, r in enumerate(ALL_RULES)}
    results = []
    for f in result.findings:
        results.append({
            "ruleId": f.code, "ruleIndex": index.get(f.code, 0),
            "level": "error" if f.severity == "error" else "warning",
            "message": {"text": f"{f.message}. Fix: {f.fix}" if f.fix else f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": _artifact(f.path),
                "region": {"startLine": f.line, "startColumn": f.column,
                           "endLine": f.end_line, "endColumn": f.end_column},
            }}],
        })
    notifications = [{"level": "error", "message": {"text": e.message},
                      "locations": [{"physicalLocation": {"artifactLocation": {"uri": e.path}}}]}
                     for e in result.errors]
    run = {"tool": {"driver": {"name": "synccheck", "version": __version__, "semanticVersion": __version__,
                               "informationUri": "https://github.com/synccheck/synccheck", "rules": rules}},
           "results": results}
    if notifications:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notifications}]
    return {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0", "runs": [run]}
