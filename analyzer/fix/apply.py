"""``--fix``, ``--diff``: choose the fixes, apply them file by file, check them, write them safely.

Per file, in rounds (as ruff does): the file is analysed again from the text about to be rewritten,
the enabled fixes that do not overlap are applied together, and the result must pass ``check.verdict``
(it parses, the fixed findings are gone, nothing new is reported). A set that fails is retried one fix
at a time; a fix that fails alone is left out and its finding says why. Fixes that overlapped one
applied are tried again in the next round, on the new text. Nothing is written unless the file on
disk is still the one that was read, and it is written in its own encoding, BOM and line endings.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional

from synccheck.analyzer.fix.check import Overlap, added, analyse_text, apply_edits, span, verdict
from synccheck.analyzer.ftypes import FileError
from synccheck.analyzer.source import replace_file

MAX_ROUNDS = 6


class FixOptions:
    def __init__(self, unsafe: bool = False, fixable: Optional[List[str]] = None,
                 unfixable: Optional[List[str]] = None) -> None:
        self.unsafe = unsafe
        self.fixable = fixable            # code prefixes; None: every rule
        self.unfixable = list(unfixable or [])

    def selected(self, code: str) -> bool:
        if any(code.startswith(p) or p == "ALL" for p in self.unfixable):
            return False
        return self.fixable is None or any(code.startswith(p) or p == "ALL" for p in self.fixable)

    def enabled(self, finding) -> bool:
        fix = finding.autofix
        return offered(fix) and self.selected(finding.code) and (fix.get("applicability") == "safe" or self.unsafe)

    def hidden(self, finding) -> bool:
        fix = finding.autofix
        return offered(fix) and self.selected(finding.code) and fix.get("applicability") == "unsafe" and \
            not self.unsafe


def offered(fix: Optional[dict]) -> bool:
    """Does this finding have an automatic fix: its edits, or (a plain lint) the promise of them."""
    return bool(fix and (fix.get("edits") or fix.get("deferred")))


class Outcome:
    """What fixing one file did."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.old = self.new = ""
        self.fixed: list = []         # findings whose fix was applied
        self.remaining: Optional[list] = None    # the file's findings after the fixes (None: unchanged)
        self.error: Optional[str] = None
        self.notebook = None          # a notebook's new bytes
        self.cells: list = []         # a notebook's changed cells: (number, old source, new source)
        self.failed: dict = {}        # (code, message) -> why its fix was not applied


def fix_result(result, rules: list, options: FixOptions, write: bool = True,
               before_write: Optional[Callable[[str], None]] = None) -> list:
    """Apply the enabled fixes of ``result``'s findings; update ``result`` in place (findings left,
    ``fixed``, errors). Returns the Outcome of every file a fix was tried on (``--diff`` prints them)."""
    paths = []
    for f in result.findings:
        if options.enabled(f) and f.path not in paths:
            paths.append(f.path)
    outcomes = []
    for path in paths:
        if path.endswith(".ipynb"):
            from synccheck.analyzer.fix.notebooks import fix_notebook
            outcome = fix_notebook(path, rules, options)
        else:
            outcome = fix_file(path, rules, options)
        if outcome.error is None and outcome.fixed and write:
            outcome.error = write_back(outcome, before_write)
        outcomes.append(outcome)
    done = {o.path: o for o in outcomes}
    findings = []
    for f in result.findings:
        o = done.get(f.path)
        if o is None or o.remaining is None or o.error:      # not written: the findings stand
            if o is not None and o.error and options.enabled(f):
                f = _not_applied(f, o.error)
            elif o is not None and (f.code, f.message) in o.failed and options.enabled(f):
                f = _not_applied(f, o.failed[(f.code, f.message)])
            findings.append(f)
    for o in outcomes:
        if o.remaining is not None and not o.error:
            findings.extend(o.remaining)
        if o.error:
            result.errors.append(FileError(o.path, o.error))
    findings.sort(key=lambda f: (f.path, f.cell or 0, f.line, f.column, f.code))
    result.findings = findings
    result.fixed += sum(len(o.fixed) for o in outcomes if o.error is None)
    return outcomes


def _not_applied(finding, why: str):
    why = why[len("not fixed: "):] if why.startswith("not fixed: ") else why
    return finding._replace(fix=f"fix not applied: {why}; {finding.fix}" if finding.fix else f"fix not applied: {why}",
                            autofix={"reason": f"fix not applied: {why}"})


def fix_file(path: str, rules: list, options: FixOptions) -> Outcome:
    from synccheck.analyzer.source import decode_source, read_bytes

    outcome = Outcome(path)
    data, error = read_bytes(path)
    if data is None:
        outcome.error = error.message
        return outcome
    text, error = decode_source(path, data)
    if text is None:
        outcome.error = error.message
        return outcome
    outcome.data = data
    outcome.old = text
    outcome.new, outcome.fixed, outcome.remaining = fix_text(path, text, rules, options, failed=outcome.failed)
    if not outcome.fixed:
        outcome.remaining = None
    return outcome


def fix_text(path: str, text: str, rules: list, options: FixOptions, notebook=None,
             failed: Optional[dict] = None, accept: Optional[Callable[[str], Optional[str]]] = None) -> tuple:
    """(new text, fixed findings, findings left) for one file's text. ``failed`` is filled with the
    reason each fix that was tried and left out failed. ``accept(new text)``: why a result cannot be
    written (a notebook's cells), or None."""
    current = text
    findings = analyse_text(path, current, rules, notebook)
    original = findings
    fixed: list = []
    failed = {} if failed is None else failed
    states = [(current, findings, [])]
    for _ in range(MAX_ROUNDS):
        todo = [f for f in findings if options.enabled(f) and (f.code, f.message) not in failed]
        if not todo:
            break
        chosen, last = [], 0
        for f in sorted(todo, key=lambda f: span(f.autofix)):
            first_row, last_row = span(f.autofix)
            if first_row > last or not chosen:
                chosen.append(f)
                last = last_row
        tried = len(failed)
        applied = _try(path, current, chosen, rules, findings, failed, options.enabled, accept)
        if applied is None:
            if len(failed) > tried:
                continue            # the others may still apply
            break
        current, findings, done = applied
        fixed.extend(done)
        states.append((current, findings, list(fixed)))
    # the end result may not hold a finding the file did not have (a revealed one left unfixed):
    # fall back to the last round that was clean in that sense
    for current, findings, fixed in reversed(states):
        if added(original, findings, fixed) is None:
            break
    for i, f in enumerate(findings):
        if options.enabled(f):
            why = failed.get((f.code, f.message), "it overlaps another fix; run --fix again")
            findings[i] = _not_applied(f, why)
    return current, fixed, findings


def _try(path, current, chosen, rules, findings, failed, fixable, accept=None) -> Optional[tuple]:
    """Apply ``chosen`` together, else the first of them that passes alone."""
    groups = [chosen] + ([[f] for f in chosen] if len(chosen) > 1 else [])
    for group in groups:
        try:
            new = apply_edits(current, [e for f in group for e in f.autofix["edits"]])
        except Overlap:
            continue
        why = accept(new) if accept is not None else None
        if why is None:
            why, after = verdict(path, current, new, group, rules, findings, fixable)
        if why is None:
            return new, after, group
        if len(group) == 1:
            failed[(group[0].code, group[0].message)] = why
    return None


def encoding_of(data: bytes) -> str:
    import io
    import tokenize

    return tokenize.detect_encoding(io.BytesIO(data).readline)[0]


def write_back(outcome: Outcome, before_write=None) -> Optional[str]:
    """Write the fixed text over the file, or say why not (the file is then left as it was)."""
    path = outcome.path
    if outcome.notebook is not None:
        payload = outcome.notebook
    else:
        try:
            payload = outcome.new.encode(encoding_of(outcome.data))
        except (UnicodeEncodeError, LookupError, SyntaxError):
            return "not fixed: the fixed text cannot be written in the file's encoding"
    if before_write is not None:
        before_write(path)
    try:
        with open(path, "rb") as fh:
            now = fh.read()
    except OSError as exc:
        return f"not fixed: cannot read it again before writing: {exc.strerror or exc}"
    if now != outcome.data:
        return "not fixed: the file changed on disk while synccheck was fixing it (run again)"
    # marked read-only (no write bit for anyone) is respected even by a user who could write it anyway
    if not os.access(path, os.W_OK) or not os.stat(path).st_mode & 0o222:
        return "not fixed: the file is read-only"
    try:
        replace_file(path, payload)
    except OSError as exc:
        return f"not fixed: cannot write it: {exc.strerror or exc}"
    return None


def unified_diff(outcome: Outcome) -> str:
    if outcome.notebook is not None:     # a notebook: one diff per changed cell, as ruff prints them
        return "".join(_diff(old, new, f"{outcome.path}:cell {number}") for number, old, new in outcome.cells)
    return _diff(outcome.old, outcome.new, outcome.path)


def _diff(old: str, new: str, name: str) -> str:
    import difflib

    from synccheck.analyzer.fix.rewrite import split_lines

    lines = difflib.unified_diff([_nl(x) for x in split_lines(old)], [_nl(x) for x in split_lines(new)],
                                 fromfile=name, tofile=name)
    return "".join(lines)


def _nl(line: str) -> str:
    return line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"
