"""What a rule is: metadata, documentation, examples that are also its tests, and a query.

A rule never walks the syntax tree itself. It asks the module's training-loop model (``ctx.model``)
and the accumulation loops walked from it (``ctx.loops``), and reports nodes with ``ctx.report``.
Importing a rule module must stay cheap: no libcst, no torch (``synccheck rule SC101`` needs neither).
"""
from __future__ import annotations

import ast
import re
import textwrap
from typing import ClassVar, Iterable

EXPECT = re.compile(r"#\s*(SC\d{3})\b")


class Rule:
    code: ClassVar[str]
    name: ClassVar[str]
    severity: ClassVar[str]            # error | warning
    summary: ClassVar[str]             # one line, for listings and SARIF
    # A file is parsed for this rule only if it contains every word of ``requires`` and at least one
    # word of ``words`` (when given). Most files of a code base fail this test and are never parsed.
    requires: ClassVar[tuple] = ()
    words: ClassVar[tuple] = ()
    # Documentation, ruff's headings: What it does / Why is this bad? / Example / Use instead / Fix safety /
    # References
    what: ClassVar[str] = ""
    why: ClassVar[str] = ""
    use_instead: ClassVar[str] = ""
    fix_safety: ClassVar[str] = "There is no automatic fix for this rule."
    references: ClassVar[tuple] = ()
    # Examples: VALID must produce no finding of this rule; in INVALID every line that must be
    # reported ends with a ``# SCxxx`` comment. The first of each is the documentation's example.
    VALID: ClassVar[tuple] = ()
    INVALID: ClassVar[tuple] = ()

    def check(self, ctx) -> Iterable:   # pragma: no cover - every rule overrides it
        raise NotImplementedError

    @classmethod
    def gate(cls) -> tuple:
        """Words of which a file must hold at least one for ``wants`` to be true: checked on the raw
        bytes, before a file is even decoded."""
        return cls.requires[:1] if cls.requires else cls.words

    @classmethod
    def wants(cls, text: str) -> bool:
        return all(w in text for w in cls.requires) and (not cls.words or any(w in text for w in cls.words))

    @classmethod
    def reaches(cls, text: str) -> bool:
        """A file this rule's words are not all in, but whose finding may need another file of the
        project (a rank branch calling an imported helper): parsed with the files it imports."""
        return False

    @classmethod
    def documentation(cls) -> str:
        example = textwrap.dedent(cls.INVALID[0]).strip("\n") if cls.INVALID else ""
        fixed = textwrap.dedent(cls.VALID[0]).strip("\n") if cls.VALID else ""
        parts = [f"# {cls.name} ({cls.code})", "", f"Severity: {cls.severity}", "",
                 "## What it does", textwrap.dedent(cls.what).strip(), "",
                 "## Why is this bad?", textwrap.dedent(cls.why).strip(), ""]
        if example:
            parts += ["## Example", "```python", example, "```", ""]
        if cls.use_instead or fixed:
            parts += ["## Use instead"]
            if cls.use_instead:
                parts += [textwrap.dedent(cls.use_instead).strip(), ""]
            if fixed:
                parts += ["```python", fixed, "```", ""]
        parts += ["## Fix safety", textwrap.dedent(cls.fix_safety).strip(), ""]
        if cls.references:
            parts += ["## References"] + [f"- {ref}" for ref in cls.references] + [""]
        return "\n".join(parts)

    @staticmethod
    def expected_lines(source: str) -> set:
        """(line, code) pairs an INVALID example marks with ``# SCxxx``."""
        out = set()
        for number, line in enumerate(textwrap.dedent(source).splitlines(), start=1):
            for code in EXPECT.findall(line):
                out.add((number, code))
        return out


def accumulate_calls_around(tree, node) -> list:
    """The ``x.accumulate(...)`` calls that the ``with`` statements of ``tree`` whose lines hold
    ``node`` enter, outermost first (SC101 names the context, SC201 asks what its Accelerator was given)."""
    out = []
    for w in ast.walk(tree):
        if isinstance(w, (ast.With, ast.AsyncWith)) and w.lineno <= node.lineno <= (w.end_lineno or w.lineno):
            out += [i.context_expr for i in w.items if isinstance(i.context_expr, ast.Call) and
                    isinstance(i.context_expr.func, ast.Attribute) and i.context_expr.func.attr == "accumulate"]
    return out
