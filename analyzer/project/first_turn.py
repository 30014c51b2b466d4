"""What a test says on the first iteration of a loop (DDP's ``static_graph`` needs training's very first
micro-step to sync, SC106; ``micro_step == 0`` resets a window): a mixin of conditions.Conditions.

``i == 0`` on a counted loop's counter, ``global_step == 0`` on a count bound once before the loop and
only moved on inside it, ``self.global_step == 0`` on a count the object starts in ``__init__``.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.guards import COMPARISONS, MASKS, TRUE

# a comparison with its sides swapped (``0 < i`` is ``i > 0``), for a loop counter's first value (guards.COMPARISONS)
_MIRRORED = {ast.Gt: ast.Lt, ast.Lt: ast.Gt, ast.GtE: ast.LtE, ast.LtE: ast.GtE}


class FirstTurn:
    """The first-iteration reading of a comparison (needs ``self.flow`` and ``self.atoms``)."""

    def _first(self, atom, node, fr) -> None:
        """``micro_step == 0`` on a counted loop's counter: true on its first iteration only, so
        never together with its last (a loop of micro-steps runs more than once, as the mod forms
        assume). ``i > 0``, ``i >= 1``, ``i < 1``: what they say on the first iteration is known too."""
        if len(node.ops) != 1 or type(node.ops[0]) not in COMPARISONS:
            return
        left, right, op = node.left, node.comparators[0], type(node.ops[0])
        if isinstance(left, ast.Constant):
            left, right, op = right, left, _MIRRORED.get(op, op)      # ``0 < i`` is ``i > 0``
        if op is ast.Eq and isinstance(left, ast.Name) and isinstance(right, (ast.Name, ast.Attribute)):
            # ``epoch == self.start_epoch`` on ``for epoch in range(self.start_epoch, ...)``: true on
            # that loop's first iteration (EfficientViT syncs the very first micro-step so)
            loop = self.flow.counter_loop_from(ast.dump(left), ast.dump(right), fr)
            if loop is None and isinstance(fr.scope, Function) and left.id in fr.scope.params and \
                    "epoch" in left.id.lower() and "start" in ast.unparse(right).lower() and self.flow.loop_stack:
                # (``def train_one_epoch(self, epoch)`` handed the epoch loop's counter: the first
                # epoch is the outermost running loop's first turn)
                loop = self.flow.loop_stack[0]
            if loop is not None:
                atom.first = (loop, True)
            return
        if not (isinstance(right, ast.Constant) and type(right.value) is int):
            return
        if isinstance(left, ast.Attribute):
            # ``self.global_step == 0`` in a method the loop calls: a count the object starts at 0
            found = self._attribute_count(left, node, fr)
            if found is not None:
                atom.first = (found[0], COMPARISONS[op](found[1], right.value))
            return
        if not isinstance(left, ast.Name):
            return
        found = self.flow.counter_loop(ast.dump(left), fr)
        if found is None:
            found = self._step_count(left.id, fr, getattr(node, "lineno", 0))
        if found is None and isinstance(fr.scope, Function) and left.id in fr.scope.params and \
                "epoch" in left.id.lower() and self.flow.loop_stack:
            # ``def train_one_epoch(model, ..., epoch, args)`` handed ``for epoch in range(args.epochs)``:
            # ``epoch == 0`` holds on training's first turn, the outermost running loop's (MAE's guard
            # ``first = epoch == 0 and data_iter_step == 0`` for static_graph)
            # (true all through that first epoch: not "the first turn only" of the loop it runs in)
            atom.first = (self.flow.loop_stack[0], COMPARISONS[op](0, right.value))
            return
        if found is None:
            return
        loop, start = found
        # what the test says on the first iteration (``i > 0``: false there, as ``i != 0`` is)
        atom.first = (loop, COMPARISONS[op](start, right.value))
        # (true on the first iteration only: never together with the last)
        only_first = (op in (ast.Eq, ast.LtE) and right.value == start) or (op is ast.Lt and right.value == start + 1)
        last = self.flow.last_atoms.get(loop)
        if atom.first[1] and only_first and last is not None:
            self.atoms.universe &= ~(MASKS[atom.index] & MASKS[last.index]) & TRUE
        # (``micro > 0``: true on every iteration but the first, so on the last one)
        if last is not None and ((op is ast.Gt and right.value == start) or (op is ast.GtE and right.value == start + 1)):
            self.atoms.universe &= ~(~MASKS[atom.index] & MASKS[last.index]) & TRUE

    def _attribute_count(self, left, test, fr) -> Optional[tuple]:
        """(the outermost running loop, the count's first value) for ``self.global_step``: set to an int
        in the class's ``__init__`` and otherwise only moved on (``+= 1``) or set back to that int, and
        not moved on earlier in the method that tests it. On the run's first micro-step it still has
        its first value (``last or self.global_step == 0`` syncs the very first micro-step)."""
        scope = fr.scope
        if not (isinstance(left.value, ast.Name) and isinstance(scope, Function) and scope.cls is not None and
                scope.params and left.value.id == scope.params[0] and self.flow.loop_stack):
            return None
        if any(loop.info.id == self.flow.loop_stack[0] for loop in fr.loops):
            # (a loop of the method itself: its first turn comes again on every call)
            return None
        start = None
        for method in scope.cls.methods.values():
            if not method.params:
                continue
            me = method.params[0]
            for node in ast.walk(method.node):
                target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                    getattr(node, "target", None) if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else None
                if not (isinstance(target, ast.Attribute) and target.attr == left.attr and
                        isinstance(target.value, ast.Name) and target.value.id == me):
                    continue
                value = node.value
                number = value.value if isinstance(value, ast.Constant) and type(value.value) is int else None
                if isinstance(node, ast.AugAssign):
                    if not (isinstance(node.op, ast.Add) and number is not None and number > 0) or \
                            (method is scope and node.lineno < test.lineno):
                        return None
                elif number is None:
                    return None
                elif method.node.name == "__init__":
                    if start is not None and start != number:
                        return None
                    start = number
                elif start is not None and number != start:
                    return None
        return (self.flow.loop_stack[0], start) if start is not None else None

    @staticmethod
    def _step_count(name: str, fr, line: int = 0) -> Optional[tuple]:
        """(the outermost running loop, the count's first value) for ``global_step``: bound once to an
        int before that loop and otherwise only moved on (``global_step += 1``) inside it. On that
        loop's first iteration it still has its first value (``... or global_step == 0`` syncs the very
        first micro-step)."""
        if not fr.loops or not isinstance(fr.scope, Function):
            return None
        outer = fr.loops[0].info
        start = None
        for node in ast.walk(fr.scope.node):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                if start is not None or not (isinstance(node.value, ast.Constant) and type(node.value.value) is int) \
                        or node.lineno >= outer.node.lineno:
                    return None
                start = node.value.value
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                if not (isinstance(node.op, ast.Add) and isinstance(node.value, ast.Constant) and
                        type(node.value.value) is int and node.value.value > 0 and
                        outer.node.lineno <= node.lineno <= (outer.node.end_lineno or outer.node.lineno)):
                    return None
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.withitem, ast.NamedExpr, ast.AnnAssign)) and \
                    any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                        for n in ast.walk(getattr(node, "target", None) or getattr(node, "optional_vars", None)
                                          or ast.Pass())):
                return None
        if start is None:
            return None
        # ``global_step += 1`` as a statement of a running loop's body, above the test: on the first
        # turn the test already sees the count moved on (insightface's ``global_step == 1``)
        for ctx in fr.loops:
            for stmt in ctx.info.node.body:
                if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name \
                        and isinstance(stmt.op, ast.Add) and isinstance(stmt.value, ast.Constant) and \
                        type(stmt.value.value) is int and stmt.lineno < line:
                    start += stmt.value.value
        return outer.id, start
