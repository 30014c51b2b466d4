"""Before a fix is written: apply its edits, and lint the result as the project sees it.

``analyse_text`` runs the same pipeline ``synccheck lint`` runs on a file (the files it imports are read
from disk, the files beside it that import it come along as context) on a text that is not on disk
yet, so a rewrite is judged by the whole-program model, not by the file alone.
"""
from __future__ import annotations

import ast
import os
from collections import Counter
from typing import Optional

from synccheck.analyzer.fix.rewrite import split_lines


class Overlap(Exception):
    pass


def apply_edits(text: str, edits: list) -> str:
    """The text with ruff-style edits applied (1-based rows and columns); Overlap if two touch."""
    lines = split_lines(text)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(loc) -> int:
        row, col = loc["row"], loc["column"]
        if row > len(lines):
            return len(text)
        return min(starts[row - 1] + col - 1, starts[row])

    spans = sorted(((offset(e["location"]), offset(e["end_location"]), e["content"]) for e in edits),
                   key=lambda s: (s[0], s[1]))
    out, at = [], 0
    for start, end, content in spans:
        if start < at:
            raise Overlap()
        out.append(text[at:start])
        out.append(content)
        at = end
    out.append(text[at:])
    return "".join(out)


def span(fix: dict) -> tuple:
    """(first row, last row) a fix touches: two fixes overlap when these ranges meet."""
    rows = [(e["location"]["row"], max(e["location"]["row"], e["end_location"]["row"] - 1)) for e in fix["edits"]]
    return min(r[0] for r in rows), max(r[1] for r in rows)


def analyse_text(path: str, text: str, rules: list, notebook=None) -> list:
    """The findings of ``path`` if it held ``text`` (no cache, nothing written)."""
    from synccheck.analyzer.engine import _analyse_files, _read
    from synccheck.analyzer.imports import imported_names, importers_beside
    from synccheck.analyzer.cache import content_key

    codes = tuple(r.code for r in rules)
    apath = os.path.abspath(path)
    members = [(path, text, notebook, True, True, imported_names(text.encode("utf-8", "surrogatepass")))]
    for other in importers_beside(apath, {apath}):
        entry, error = _read(other, content_key, imported_names, rules)
        if entry is not None and entry.gated:
            members.append((entry.path, entry.text if entry.eager else None, None, False, entry.eager, entry.imports))
    findings, errors, _, _ = _analyse_files(members, codes)
    return [f for f in findings if os.path.abspath(f.path) == apath]


def verdict(path: str, old: str, new: str, fixed: list, rules: list, before: Optional[list] = None,
            fixable=lambda finding: False) -> tuple:
    """(None, findings after) when ``new`` may replace ``old``, else (why not, None): the new text
    parses, the fixed findings are gone and no finding was added -- except one that ``fixable`` says
    the next round will fix (moving ``zero_grad`` out of the micro-steps reveals that they all-reduce;
    ``apply.fix_text`` then checks the end result against the file as it was)."""
    try:
        ast.parse(new, path)
    except (SyntaxError, ValueError) as exc:
        return f"the fixed code would not parse ({getattr(exc, 'msg', exc)})", None
    except RecursionError:
        return "the fixed code is nested too deeply to check", None
    before = analyse_text(path, old, rules) if before is None else before
    after = analyse_text(path, new, rules)
    was, now, gone = Counter(f.code for f in before), Counter(f.code for f in after), Counter(f.code for f in fixed)
    for code in sorted(set(now) | set(gone)):
        if now[code] > was[code] - gone[code] and not all(fixable(f) for f in after if f.code == code):
            added = now[code] - (was[code] - gone[code])
            if code in gone and now[code] >= was[code]:
                return f"{code} is still reported after the fix", None
            return f"the fix would add {added} {code} finding{'s' if added != 1 else ''}", None
    return None, after


def added(original: list, final: list, fixed: list) -> Optional[str]:
    """What the fixes added, all rounds together, to the file's findings as they were."""
    was, now, gone = Counter(f.code for f in original), Counter(f.code for f in final), Counter(f.code for f in fixed)
    for code in sorted(now):
        if now[code] > was[code] - min(gone[code], was[code]):
            return f"the fixes would leave a new {code} finding"
    return None
