"""Suppression comments: the user's word that a finding is intended.

* ``# synccheck: ignore[SC101]`` (or bare ``# synccheck: ignore``) on the finding's line, or on the
  header of a ``with`` / ``for`` / ``while`` that holds it: a finding points at the backward, but the
  decision "this loop syncs every micro-step on purpose" belongs to the loop.
* ``# synccheck: ignore-file`` anywhere: nothing in the file is reported; ``ignore-file[SC101]``: that code.

Codes are prefixes, as everywhere (``ignore[SC1]``).
"""
from __future__ import annotations

import ast
import re
from typing import Optional, Tuple

from synccheck.analyzer.project.traversal import walk

_CODES = r"(?:\[([A-Za-z0-9_,\s-]*)\])?"
SUPPRESS = re.compile(r"#\s*synccheck:\s*ignore(?!-)" + _CODES)
SUPPRESS_FILE = re.compile(r"#\s*synccheck:\s*ignore-file" + _CODES)
ALL = ("",)      # every code starts with the empty prefix


def _prefixes(group: Optional[str]) -> Tuple[str, ...]:
    if group is None:
        return ALL
    return tuple(c.strip().upper() for c in group.split(",") if c.strip())


def file_ignores(text: str) -> Tuple[str, ...]:
    """Code prefixes the file turns off for itself: ``()`` none, ``ALL`` every one."""
    if "ignore-file" not in text:
        return ()
    found: list = []
    for match in SUPPRESS_FILE.finditer(text):
        codes = _prefixes(match.group(1))
        if codes == ALL:
            return ALL
        found.extend(codes)
    return tuple(found)


def ignored(code: str, prefixes: Tuple[str, ...]) -> bool:
    return any(code.startswith(p) for p in prefixes)


def suppressed(text: str, findings: list, tree: Optional[ast.AST] = None) -> list:
    """The findings no comment suppresses. ``tree``: the text's ``ast`` (to find the enclosing blocks)."""
    if not findings or "synccheck" not in text:
        return findings
    whole_file = file_ignores(text)
    lines = text.splitlines()

    def line_says(number: int, code: str) -> bool:
        if not 0 < number <= len(lines) or "synccheck" not in lines[number - 1]:
            return False
        match = SUPPRESS.search(lines[number - 1])
        return bool(match) and ignored(code, _prefixes(match.group(1)))

    headers = None
    kept = []
    for f in findings:
        if ignored(f.code, whole_file) or line_says(f.line, f.code):
            continue
        if tree is not None:
            if headers is None:
                headers = _block_headers(tree, lines)
            if any(start <= f.line <= end and any(line_says(n, f.code) for n in range(start, head_end + 1))
                   for start, head_end, end in headers):
                continue
        kept.append(f)
    return kept


def _block_headers(tree: ast.AST, lines: list) -> list:
    """(first line, last header line, last line) of every ``with`` / ``for`` / ``while`` block."""
    out = []
    for node in walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            parts = [node.target, node.iter]
        elif isinstance(node, ast.While):
            parts = [node.test]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            parts = [item.optional_vars or item.context_expr for item in node.items]
        else:
            continue
        head_end = max([node.lineno] + [getattr(p, "end_lineno", None) or node.lineno for p in parts])
        # ``with (\n a(),\n b(),\n):``: the closing bracket and the colon sit on a line of their own
        while head_end < len(lines) and lines[head_end].lstrip().startswith((")", ":")):
            head_end += 1
        out.append((node.lineno, head_end, node.end_lineno or node.lineno))
    return out
