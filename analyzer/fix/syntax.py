"""Questions a fix asks of one module's ``ast`` tree: which block holds a statement, what a loop's
step is gated on, whether a condition can be evaluated earlier than where the code wrote it."""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project.traversal import walk

LOOPS = (ast.For, ast.AsyncFor, ast.While)
BLOCK_FIELDS = ("body", "orelse", "finalbody")


class NoFix(Exception):
    """The rewrite cannot be proven right; the message says why (shown in the finding)."""


class Tree:
    """Parents and blocks of one module, computed once per module."""

    def __init__(self, module) -> None:
        # no reference back to the module: it holds this Tree, and a cycle would keep both alive
        # until the collector runs (the analysis turns it off; see engine._analyse_component)
        self.parent: dict = {}
        self.block_of: dict = {}      # statement -> (owner node, field name)
        for node in walk(module.tree):
            for field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    for child in value:
                        if isinstance(child, ast.AST):
                            self.parent[child] = node
                            if isinstance(child, ast.stmt) and field in BLOCK_FIELDS + ("handlers",):
                                self.block_of[child] = (node, field)
                elif isinstance(value, ast.AST):
                    self.parent[value] = node
            if isinstance(node, ast.ExceptHandler):
                for child in node.body:
                    self.block_of[child] = (node, "body")

    @staticmethod
    def of(module) -> "Tree":
        tree = getattr(module, "_fix_tree", None)
        if tree is None:
            tree = Tree(module)
            module._fix_tree = tree
        return tree

    def statement(self, node) -> Optional[ast.stmt]:
        while node is not None and not isinstance(node, ast.stmt):
            node = self.parent.get(node)
        return node

    def block(self, stmt) -> list:
        owner, field = self.block_of[stmt]
        return getattr(owner, field)

    def ancestors(self, node) -> list:
        out = []
        node = self.parent.get(node)
        while node is not None:
            out.append(node)
            node = self.parent.get(node)
        return out

    def enclosing_loop(self, node):
        for a in self.ancestors(node):
            if isinstance(a, LOOPS):
                return a
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                return None
        return None

    def inside(self, node, outer) -> bool:
        return outer in self.ancestors(node)

    def sibling_range(self, first, last) -> tuple:
        """The statements of one block that hold ``first`` and ``last`` (in that order): (a, b)."""
        chain_a = [self.statement(first)] + [a for a in self.ancestors(first) if isinstance(a, ast.stmt)]
        chain_b = [self.statement(last)] + [b for b in self.ancestors(last) if isinstance(b, ast.stmt)]
        for a in chain_a:
            if a not in self.block_of:
                continue
            block = self.block(a)
            for b in chain_b:
                if b in self.block_of and self.block(b) is block:
                    i, j = block.index(a), block.index(b)
                    if i <= j:
                        return a, b
                    raise NoFix("the forward runs after the backward in the loop's text")
        raise NoFix("the forward and the backward are not in one block of the loop")

    def gate(self, step, loop) -> tuple:
        """(condition node, negated) of the one ``if`` between ``loop`` and the optimizer step ``step``,
        or (None, False) when the step runs on every trip through ``loop``."""
        found = []
        child = self.statement(step)
        for a in self.ancestors(step):
            if a is loop:
                break
            if isinstance(a, ast.If):
                found.append((a, child in a.orelse))
            elif isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                raise NoFix("the optimizer step is in another function than the loop")
            elif isinstance(a, LOOPS):
                raise NoFix("the optimizer step is in a nested loop")
            child = a
        else:
            raise NoFix("the optimizer step is outside the accumulation loop")
        if len(found) > 1:
            raise NoFix("the optimizer step sits under several conditions")
        if not found:
            return None, False
        node, negated = found[0]
        return node, negated

    def top_of(self, node, loop):
        """The statement of ``loop``'s body that holds ``node``."""
        stmt = self.statement(node)
        while stmt is not None and self.parent.get(stmt) is not loop:
            stmt = self.statement(self.parent.get(stmt))
        if stmt is None or stmt not in loop.body:
            raise NoFix("the code is not in the loop's body")
        return stmt


def text(module, node) -> str:
    return (module.segment(node) or ast.unparse(node)).strip()


SAFE_CALLS = ("len", "min", "max", "int", "abs")


def check_pure(cond) -> None:
    """A condition that may be evaluated once more, earlier: no call with effects, no assignment."""
    for n in walk(cond):
        if isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda)):
            raise NoFix("the step's condition has side effects")
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in SAFE_CALLS):
            raise NoFix("the step's condition calls a function, which synccheck will not evaluate twice")


def stored(stmts) -> set:
    """Dotted names (``i``, ``self.step``) assigned anywhere in these statements."""
    out = set()
    for stmt in stmts:
        for n in walk(stmt):
            targets = []
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            elif isinstance(n, (ast.For, ast.AsyncFor)):
                targets = [n.target]
            elif isinstance(n, ast.NamedExpr):
                targets = [n.target]
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                targets = [i.optional_vars for i in n.items if i.optional_vars is not None]
            for t in targets:
                for sub in walk(t):
                    if isinstance(sub, (ast.Name, ast.Attribute)):
                        dotted = _dotted(sub)
                        if dotted:
                            out.add(dotted)
    return out


def used(cond) -> set:
    return {d for d in (_dotted(n) for n in walk(cond) if isinstance(n, (ast.Name, ast.Attribute))) if d}


def check_stable(cond, stmts) -> None:
    """The condition has the same value before ``stmts`` run as after: they assign none of its names."""
    changed = used(cond) & stored(stmts)
    if changed:
        raise NoFix(f"the step's condition reads `{sorted(changed)[0]}`, which changes between the forward and "
                    f"the step")


def between(tree: Tree, loop, first_stmt, gate_stmt) -> list:
    """The statements of the loop body from the one holding ``first_stmt`` up to (not including) the
    one holding ``gate_stmt``: what runs between the new sync control and the step's test."""
    a = tree.top_of(first_stmt, loop)
    b = tree.top_of(gate_stmt, loop)
    i, j = loop.body.index(a), loop.body.index(b)
    if j < i:
        raise NoFix("the step's test runs before the forward")
    return loop.body[i:j] if j > i else [a]


def negate(cond_text: str, node) -> str:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return cond_text[len("not"):].strip() if cond_text.startswith("not") else f"not ({cond_text})"
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        flip = {ast.Eq: "!=", ast.NotEq: "==", ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">"}
        op = flip.get(type(node.ops[0]))
        if op is not None:
            return f"{ast.unparse(node.left)} {op} {ast.unparse(node.comparators[0])}"
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        return f"not {cond_text}"
    return f"not ({cond_text})"


def in_cond(cond_text: str, node) -> str:
    """The condition as the test of a conditional expression (``a if <test> else b``)."""
    if isinstance(node, (ast.IfExp, ast.Lambda, ast.NamedExpr)) or "\n" in cond_text:
        return f"({cond_text})"
    return cond_text


def position(module, node) -> tuple:
    """(line, column) of a node as libcst counts them: 1-based line, 0-based column in characters."""
    lines = getattr(module, "_fix_lines", None)
    if lines is None:
        lines = module._fix_lines = module.text.split("\n")
    line, col = node.lineno, node.col_offset
    if 0 < line <= len(lines) and not lines[line - 1].isascii():
        col = len(lines[line - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore"))
    return line, col


def end_position(module, node) -> tuple:
    lines = getattr(module, "_fix_lines", None) or module.text.split("\n")
    line, col = node.end_lineno, node.end_col_offset
    if 0 < line <= len(lines) and not lines[line - 1].isascii():
        col = len(lines[line - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore"))
    return line, col
