"""Carry out a plan on a libcst tree and report the change as ruff-style text edits.

libcst keeps everything the plan does not touch byte for byte (comments, blank lines, quotes, the
file's line endings), and re-indents the statements a new ``with`` takes in without touching the
inside of their string literals. Statements and expressions are found by the start (and end) position
the ``ast`` model recorded, converted to libcst's character columns.

A plan is a tuple of operations, plain tuples so findings stay picklable and JSON-friendly:

* ``("wrap", first, last, header)``: the statements ``first``..``last`` of one block go into
  ``with <header>:``;
* ``("before", stmt, code)`` / ``("after", stmt, code)``: a new statement next to ``stmt``;
* ``("remove", stmt)``; ``("unwrap", with_stmt)``: a ``with`` replaced by its body;
* ``("move", stmt, to)``: ``stmt`` (with its comment) moves up, before ``to`` of the same block;
* ``("replace", start, end, code)``: the expression spanning start..end becomes ``code``;
* ``("kwarg", start, end, name, code)``: the call spanning start..end gets ``name=code``;
* ``("import", module)``: ``import module`` in the module's import block, unless already there.

Positions are (line, column) pairs, 1-based lines and 0-based character columns.
"""
from __future__ import annotations

import difflib
import re
from typing import Optional

_LINES = re.compile(r"[^\r\n]*(?:\r\n|\n|\r|$)")


def split_lines(text: str) -> list:
    """Lines with their endings, as the tokenizer counts them (``\\r\\n``, ``\\n`` or a lone ``\\r``)."""
    out = _LINES.findall(text)
    if out and out[-1] == "":
        out.pop()
    return out


def render(text: str, plan: tuple, parsed: Optional[tuple] = None) -> str:
    """The module's new source; raises ValueError when the plan does not fit the code. ``parsed``:
    (libcst module, positions) of ``text`` from ``parse`` (several plans for one file parse it once)."""
    module, positions = parsed if parsed is not None else parse(text)
    transformer = _Transformer(plan, positions, module)
    new = module.visit(transformer)
    missing = transformer.pending()
    if missing:
        raise ValueError(f"the code at line {missing[0]} is not where the analysis saw it")
    return new.code


def parse(text: str) -> tuple:
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
    return wrapper.module, wrapper.resolve(PositionProvider)


def edits(old: str, new: str) -> list:
    """Ruff's edit objects (content, location, end_location; 1-based rows and columns) turning
    ``old`` into ``new``, whole lines at a time."""
    a, b = split_lines(old), split_lines(new)
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.append({"content": "".join(b[j1:j2]), "location": {"row": i1 + 1, "column": 1},
                    "end_location": {"row": i2 + 1, "column": 1}})
    return out


def plan_edits(text: str, plan: tuple, parsed: Optional[tuple] = None) -> list:
    return edits(text, render(text, plan, parsed))


class _Transformer:
    """A libcst transformer written against ``on_leave`` so that one pass handles every op."""

    def __new__(cls, plan, positions, module):
        import libcst as cst

        class Impl(cst.CSTTransformer):
            def __init__(self) -> None:
                super().__init__()
                self.ops: dict = {}
                self.done: set = set()
                self.imports: list = []
                for op in plan:
                    kind = op[0]
                    if kind == "import":
                        self.imports.append(op[1])
                    elif kind in ("replace", "kwarg"):
                        self.ops.setdefault((kind, op[1], op[2]), []).append(op)
                    else:
                        self.ops.setdefault((kind, op[1]), []).append(op)

            def pending(self) -> list:
                return sorted(key[1][0] for key in self.ops if key not in self.done)

            def _start(self, node):
                r = positions.get(node)
                return (r.start.line, r.start.column) if r is not None else None

            def _span(self, node):
                r = positions.get(node)
                return ((r.start.line, r.start.column), (r.end.line, r.end.column)) if r is not None else None

            def on_leave(self, original, updated):
                updated = super().on_leave(original, updated)
                if isinstance(original, cst.BaseExpression):
                    span = self._span(original)
                    if span is not None:
                        key = ("replace",) + span
                        if key in self.ops:
                            self.done.add(key)
                            new = cst.parse_expression(self.ops[key][0][3])
                            if getattr(updated, "lpar", None) and not new.lpar:
                                new = new.with_changes(lpar=updated.lpar, rpar=updated.rpar)
                            return new
                        key = ("kwarg",) + span
                        if key in self.ops and isinstance(updated, cst.Call):
                            self.done.add(key)
                            args = list(updated.args)
                            for op in self.ops[key]:
                                args.append(cst.Arg(keyword=cst.Name(op[3]), value=cst.parse_expression(op[4]),
                                                    equal=cst.AssignEqual(cst.SimpleWhitespace(""),
                                                                          cst.SimpleWhitespace(""))))
                            if len(args) > 1 and isinstance(args[-2].comma, cst.MaybeSentinel):
                                args[-2] = args[-2].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                            return updated.with_changes(args=args)
                if isinstance(original, (cst.IndentedBlock, cst.Module)):
                    body = self._body(original.body, updated.body)
                    if isinstance(original, cst.Module) and self.imports:
                        body = self._add_imports(body)
                    if not body:
                        body = [cst.SimpleStatementLine([cst.Pass()])]
                    return updated.with_changes(body=body)
                return updated

            def _take(self, kind, pos):
                key = (kind, pos)
                if key in self.ops:
                    self.done.add(key)
                    return self.ops[key]
                return []

            def _body(self, originals, updates) -> list:
                out: list = []
                wrapping: Optional[list] = None
                wrap_op = None
                carry: list = []        # comment lines of a removed statement: kept for the next one
                moving: dict = {}       # target position -> statements moved before it
                for orig, upd in zip(originals, updates):
                    for op in self._take("move", self._start(orig)):
                        moving.setdefault(op[2], []).append(upd.with_changes(leading_lines=()))
                        self.done.add(("move", op[1]))
                for orig, upd in zip(originals, updates):
                    pos = self._start(orig)
                    if ("move", pos) in self.ops:      # it now stands before its target
                        carry = list(upd.leading_lines)
                        continue
                    target = out if wrapping is None else wrapping
                    if carry:
                        upd = upd.with_changes(leading_lines=carry + list(upd.leading_lines))
                        carry = []
                    inserted = moving.pop(pos, []) + [s for op in self._take("before", pos) for s in _statements(op[2])]
                    if inserted:
                        # the comments above a statement stay above what now comes first
                        inserted[0] = inserted[0].with_changes(leading_lines=upd.leading_lines)
                        upd = upd.with_changes(leading_lines=())
                    starts = self._take("wrap", pos)
                    if starts:
                        if wrapping is not None:
                            raise ValueError("overlapping wraps")
                        wrap_op, wrapping = starts[0], []
                        target = wrapping
                    target.extend(inserted)
                    if self._take("remove", pos):
                        carry = list(upd.leading_lines)
                    elif self._take("unwrap", pos) and isinstance(upd, cst.With):
                        inner = list(upd.body.body)
                        if inner:
                            # the with line's own comment is kept, above what was its body
                            header = upd.body.header
                            own = [cst.EmptyLine(comment=header.comment)] if header.comment is not None else []
                            inner[0] = inner[0].with_changes(leading_lines=list(upd.leading_lines) + own +
                                                             list(inner[0].leading_lines))
                        target.extend(inner)
                    else:
                        target.append(upd)
                    for op in self._take("after", pos):
                        target.extend(_statements(op[2]))
                    if wrap_op is not None and pos == wrap_op[2]:
                        first = wrapping[0]
                        lead = first.leading_lines
                        wrapping[0] = first.with_changes(leading_lines=())
                        out.append(cst.With(items=[cst.WithItem(cst.parse_expression(wrap_op[3]))],
                                            body=cst.IndentedBlock(body=wrapping), leading_lines=lead))
                        self.done.add(("wrap", wrap_op[1]))
                        wrapping, wrap_op = None, None
                if wrapping is not None or moving:
                    raise ValueError("the statements to wrap or move are not in one block")
                return out

            def _add_imports(self, body: list) -> list:
                """``import x`` once, in the module's first group of imports, where a sorted block
                would have it (before the first import that sorts after it), else at the group's end."""
                present, first, at = set(), None, None
                for i, stmt in enumerate(body):
                    if not (isinstance(stmt, cst.SimpleStatementLine) and
                            all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)):
                        if first is None and i == 0 and _is_docstring(stmt):
                            continue
                        if first is None and isinstance(stmt, cst.SimpleStatementLine):
                            continue
                        break
                    names = []
                    for s in stmt.body:
                        if isinstance(s, cst.Import):
                            names += [_dotted(a.name) for a in s.names]
                            present |= {_dotted(a.name) for a in s.names if a.asname is None}
                        else:
                            names.append(_dotted(s.module) if s.module is not None else "")
                    if names == ["__future__"]:
                        continue
                    if first is not None and any(isinstance(line, cst.EmptyLine) for line in stmt.leading_lines):
                        at = i if at is None else at
                    if first is None:
                        first = i
                    if at is None and min(names) > min(self.imports):
                        at = i
                if first is None:
                    at = 1 if body and _is_docstring(body[0]) else 0
                elif at is None:
                    at = first + 1
                    while at < len(body) and isinstance(body[at], cst.SimpleStatementLine) and all(
                            isinstance(s, (cst.Import, cst.ImportFrom)) for s in body[at].body) and \
                            not any(isinstance(line, cst.EmptyLine) for line in body[at].leading_lines):
                        at += 1
                new = [cst.parse_statement(f"import {name}\n") for name in dict.fromkeys(self.imports)
                       if name not in present]
                if not new:
                    return body
                if at < len(body) and first is not None and at != first + 0 and at <= len(body) - 1 and \
                        body[at].leading_lines and at > first and \
                        any(isinstance(line, cst.EmptyLine) for line in body[at].leading_lines):
                    pass        # the end of the first group: the blank line stays after the new import
                elif at < len(body) and body[at].leading_lines:
                    # the comments and blank lines above the statement now stand above the import
                    new[0] = new[0].with_changes(leading_lines=body[at].leading_lines)
                    body = list(body)
                    body[at] = body[at].with_changes(leading_lines=())
                return list(body[:at]) + new + list(body[at:])

        return Impl()


def _statements(code: str) -> list:
    import libcst as cst

    return list(cst.parse_module(code if code.endswith("\n") else code + "\n").body)


def _is_docstring(stmt) -> bool:
    import libcst as cst

    return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) \
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))


def _dotted(node) -> str:
    import libcst as cst

    return cst.Module([]).code_for_node(node) if node is not None else ""
