"""Where reported nodes are, 1-based, without measuring the whole file.

A finding's node belongs to a function or a top-level statement (the model records which). That
statement alone is measured with libcst's PositionProvider, and its stdlib-ast twin (from the narrowing
stage) gives the line and indentation it starts at in the file.
"""
from __future__ import annotations

import ast
from typing import Optional

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from synccheck.analyzer.narrow import first_line


def locate(model, tree: Optional[ast.Module], nodes: list, line_map: Optional[list] = None) -> list:
    """[((line, column), (end_line, end_column)) | None] for each node.

    ``line_map``: the original line of each line of the (narrowed) parsed text, for the slow path."""
    twins = _twins(model, tree, line_map) if tree is not None else {}
    cache: dict = {}
    whole = None
    out = []
    for node in nodes:
        holder = model.owner.get(id(node))
        twin = twins.get(id(holder)) if holder is not None else None
        pos = None
        if twin is not None:
            if id(holder) not in cache:
                cache[id(holder)] = _measure(model.module, holder)
            positions, start = cache[id(holder)]
            rel = positions.get(node)
            if rel is not None:
                shift_line = twin.lineno - start.line
                shift_col = twin.col_offset - start.column
                # every line of the holder is indented by the holder's own indentation in the file
                pos = ((rel.start.line + shift_line, rel.start.column + shift_col + 1),
                       (rel.end.line + shift_line, rel.end.column + shift_col + 1))
        if pos is None:
            if whole is None:
                whole = MetadataWrapper(model.module, unsafe_skip_copy=True).resolve(PositionProvider)
            rel = whole.get(node)
            if rel is not None:
                def original(n: int) -> int:
                    return line_map[min(n, len(line_map)) - 1] if line_map else n
                pos = ((original(rel.start.line), rel.start.column + 1),
                       (original(rel.end.line), rel.end.column + 1))
        out.append(pos)
    return out


def _measure(module: cst.Module, holder) -> tuple:
    mini = module.with_changes(body=[holder], header=[], footer=[])
    positions = MetadataWrapper(mini, unsafe_skip_copy=True).resolve(PositionProvider)
    return positions, positions[holder].start


def _twins(model, tree: ast.Module, line_map: Optional[list] = None) -> dict:
    """id(libcst statement) -> its ast statement, for top-level statements and every def the model knows.

    ``line_map``: the text was narrowed. Its top-level statements are the original ones whose first line
    it kept (a dropped run of them left one ``...`` on the first one's line, and no line of the others).
    """
    twins: dict = {}
    ast_defs: dict = {}

    def collect(body, class_name) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                ast_defs.setdefault(f"{class_name}.{node.name}" if class_name else node.name, node)
            elif isinstance(node, ast.ClassDef):
                collect(node.body, node.name)
            elif isinstance(node, ast.If):
                collect(node.body, class_name)
                collect(node.orelse, class_name)
            elif isinstance(node, ast.Try):
                collect(node.body, class_name)

    collect(tree.body, None)
    del collect    # a recursive closure's cycle through its own cell would hold ast_defs (see engine._analyse)
    for qual, (fdef, _) in model.defs.items():
        twin = ast_defs.get(qual)
        if twin is not None:
            twins[id(fdef)] = twin
    top = tree.body
    if line_map:
        kept = set(line_map)
        top = [n for n in top if first_line(n) in kept]
    i = 0
    for stmt in model.module.body:
        if i >= len(top):
            break
        if not isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or not getattr(stmt, "decorators", None):
            twins.setdefault(id(stmt), top[i])
        i += len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
    return twins
