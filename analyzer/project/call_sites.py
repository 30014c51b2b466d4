"""Stage 5 of the pipeline (values), the call sites of a name: where the text says ``name(``.

The value analysis asks for the calls of a function by its name (its parameters hold what its callers
pass). The text says where they can be before any tree is walked: ``CALL_WORD`` finds ``name(``, and
``_calls_named`` walks only the nodes whose lines hold one. A module's text is read once for the words
it may call (``call_words``), and the lines of one word only when it is asked for (``call_lines``).
"""
from __future__ import annotations

import ast
import bisect
import re
from itertools import repeat

from synccheck.analyzer.project.definitions import Module
from synccheck.analyzer.project.traversal import children

def _calls_named(module: Module, name: str, lines: list) -> list:
    """The calls of ``name`` in a module, with the scope (function or module) each is in: a walk that
    enters only the nodes that span one of ``lines`` (where the text says ``name(``), so a big
    module costs what its matches cost."""
    scopes = module.derived.get("scope by node")
    if scopes is None:
        scopes = module.derived["scope by node"] = {id(fn.node): fn for fn in module.functions.values()}
    out = []
    stack = [(module.tree, module)]
    count, bisect_left = len(lines), bisect.bisect_left
    while stack:
        node, scope = stack.pop()
        for child in children(node):
            first = getattr(child, "lineno", None)
            if first is not None:
                if isinstance(child, _DECORATED):
                    decorators = child.decorator_list
                    if decorators:
                        first = min(first, min(d.lineno for d in decorators))
                i = bisect_left(lines, first)
                if i == count or lines[i] > child.end_lineno:
                    continue
            elif isinstance(child, _LEAVES):
                continue        # a context or an operator: no position, no children
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, scopes.get(id(child), scope)))
                continue
            if isinstance(child, ast.Call):
                func = child.func
                key = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
                if key == name:
                    out.append((scope, child))
            stack.append((child, scope))
    out.reverse()
    return out


_DECORATED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)      # what has a decorator_list
_LEAVES = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)


# ``name(`` in source text: a call of name (or its def), found without a parse. The look-behind changes
# no match (a match never starts right after a letter: it would have started at that letter), only
# the cost: without it every position inside a word began a match that scanned the rest of the word.
CALL_WORD = re.compile(r"(?<![A-Za-z_])([A-Za-z_]\w*)\s*\(")


def _call_lines(module: Module) -> dict:
    """name -> sorted line numbers where the module's text says ``name(``: one scan of the text."""
    table = getattr(module, "_call_lines", None)
    if table is None:
        text = module.text
        starts = [0]
        find = text.find
        i = find("\n")
        while i != -1:
            starts.append(i + 1)
            i = find("\n", i + 1)
        table = {}
        line, nxt = 1, (starts[1] if len(starts) > 1 else len(text) + 1)
        for m in CALL_WORD.finditer(text):
            at = m.start()
            if at >= nxt:
                line = bisect.bisect_right(starts, at)
                nxt = starts[line] if line < len(starts) else len(text) + 1
            bucket = table.setdefault(m.group(1), [])
            if not bucket or bucket[-1] != line:
                bucket.append(line)
        module._call_lines = table
    return table


_NAME_HEAD = re.compile(r"[A-Za-z_]\w*\Z")


def call_lines(module: Module, name: str) -> list:
    """``_call_lines(module).get(name, [])``, the lines of one name only: the words the module calls
    are read once (a set, no line numbers), and the lines of a word it does call from the places the
    text says it, each kept when ``CALL_WORD.finditer`` would match ``name(`` there.

    A match of CALL_WORD is the first ASCII letter or underscore of a run of word characters up to a
    ``(``: ``name`` at ``at`` is one when no such letter is before it in its run (``xname(`` is the
    word ``xname``; ``2name(`` is ``name``), no word character follows it, and ``\\s*(`` does."""
    words = module.derived.get("call words")
    if words is None:
        words = module.derived["call words"] = call_words(module.text)
    if words.__class__ is set:
        if name not in words:
            return []
    elif not name.isascii() or name.encode() not in words:      # the words of an ASCII text, as bytes
        return []
    cache = module.derived.setdefault("call lines", {})
    found = cache.get(name)
    if found is not None:
        return found
    found = []
    text = module.text
    if _NAME_HEAD.match(name):
        pattern = _called.get(name)
        if pattern is None:
            if len(_called) > 4096:
                _called.clear()
            pattern = _called[name] = re.compile(re.escape(name) + r"(?!\w)\s*\(")
        line, counted = 1, 0
        for m in pattern.finditer(text):
            at = m.start()
            if _run_starts(text, at):
                line += text.count("\n", counted, at)
                counted = at
                if not found or found[-1] != line:
                    found.append(line)
    cache[name] = found
    return found


# name -> ``name(`` not followed by a word character, the places call_lines then checks
_called: dict = {}


def call_words(text: str):
    """Every word ``CALL_WORD`` matches in the text (and, in an ASCII text, other words too): a set of
    str, or for an ASCII text a frozenset of bytes. A match is a run of word characters from its
    first letter or underscore, so in ASCII it is a run without its leading digits: the runs come
    from a byte translation and a split, not from the regex tried at every position."""
    if not text.isascii():
        return set(CALL_WORD.findall(text))
    runs = set(text.encode("ascii").translate(_RUNS).split())
    return frozenset(map(bytes.lstrip, runs, repeat(b"0123456789")))


# every byte that is not an ASCII word character becomes a space
_RUNS = bytes(c if chr(c).isascii() and (chr(c).isalnum() or c == ord("_")) else 32 for c in range(256))


def _run_starts(text: str, at: int) -> bool:
    """Is ``at`` where a match of ``[A-Za-z_]\\w*`` scanning the text would begin: no ASCII letter or
    underscore before it in its run of word characters?"""
    i = at - 1
    while i >= 0:
        c = text[i]
        if c.isascii():
            if c.isalpha() or c == "_":
                return False
            if not c.isdigit():
                return True
        elif not (c.isalnum()):
            return True
        i -= 1
    return True
