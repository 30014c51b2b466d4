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
           err: TextIO = sys.stderr) -> None:
    """`statistics`: as ruff, the count per code replaces the findings in the text formats; with a
    machine-readable format the report stays whole on `out` and the counts go to `err`."""
    if statistics and fmt in ("full", "concise"):
        _statistics(result, out)
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
        _summary_plain(result, out)
    else:
        _full(result, out)
    if statistics:
        _statistics(result, err)


def _summary_plain(result: LintResult, out: TextIO) -> None:
    if not result.findings and not result.errors:
        out.write(f"All checks passed! ({_files(result.files)} checked)\n")
        return
    n = len(result.findings)
    errors = sum(1 for f in result.findings if f.severity == "error")
    out.write(f"Found {n} problem{'s' if n != 1 else ''} ({errors} error{'s' if errors != 1 else ''}, "
              f"{n - errors} warning{'s' if n - errors != 1 else ''})"
              f"{f' and {len(result.errors)} unreadable file' + ('s' if len(result.errors) != 1 else '') if result.errors else ''}"
              f" in {_files(result.files)}.\n")


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _full(result: LintResult, out: TextIO) -> None:
    if not result.findings and not result.errors:
        # a clean run must stay fast (pre-commit): no rich import for one line
        out.write(f"All checks passed! ({_files(result.files)} checked)\n")
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=not out.isatty(),
                      force_terminal=None if out.isatty() else False)
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
        if lines:
            width = len(str(f.line))
            start = max(1, f.line - 1)
            for number in range(start, min(f.line, len(lines)) + 1):
                text = lines[number - 1].rstrip("\n")
                console.print(Text(f"  {number:>{width}} | ", style="dim") + Text(text))
            end = f.end_column if f.end_line == f.line else len(lines[f.line - 1].rstrip()) + 1
            caret = " " * (f.column - 1) + "^" * max(1, end - f.column)
            console.print(Text(f"  {'':>{width}} | ", style="dim") + Text(caret, style=f"bold {color}"))
        if f.fix:
            console.print(Text("  fix: ", style="bold cyan") + Text(f.fix))
        console.print()
    for e in result.errors:
        console.print(Text(f"{e.path}: ", style="bold") + Text("error: ", style="bold red") + Text(e.message))
    buf = Text()
    n, errors = len(result.findings), sum(1 for f in result.findings if f.severity == "error")
    if n:
        buf.append(f"Found {n} problem{'s' if n != 1 else ''}", style="bold")
        buf.append(f" ({errors} error{'s' if errors != 1 else ''}, {n - errors} warning{'s' if n - errors != 1 else ''})")
    if result.errors:
        buf.append((" and " if n else "") + f"{len(result.errors)} unreadable file{'s' if len(result.errors) != 1 else ''}",
                   style="bold")
    buf.append(f" in {_files(result.files)}.")
    console.print(buf)


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
            "findings": [f.to_json() for f in result.findings],
            "errors": [e.to_json() for e in result.errors]}


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
