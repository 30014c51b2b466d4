"""The accumulation schedule of a loop, read off the code the model pointed at: where the micro-step's
forward and backward are, which loop is the micro-step loop, and the condition that says "this
micro-step is the boundary" (the optimizer steps after it), spelled as the loop spells it."""
from __future__ import annotations

import ast
from typing import NamedTuple, Optional

from synccheck.analyzer.fix.syntax import (LOOPS, NoFix, Tree, check_pure, check_stable, in_cond, negate,
                                           position, text)
from synccheck.analyzer.project.traversal import walk


class Boundary(NamedTuple):
    cond: str                 # source text, true on the boundary micro-step
    node: object              # the ast of that condition (None when built, as ``v == n - 1``)
    loop: object              # the micro-step loop
    inner: bool               # an inner ``for v in range(n)`` loop with the step after it
    gate: object              # the statement that tests it (an ``if``), None for an inner loop
    count: Optional[str]      # the number of micro-steps per optimizer step, when the code says it

    def test(self) -> str:
        return in_cond(self.cond, self.node)

    def negated(self) -> str:
        if self.node is None:
            return f"not ({self.cond})"
        return negate(self.cond, self.node)


def forwards(ctx, flow, model, module, loop) -> list:
    """The calls of ``model`` recorded in ``loop`` of ``module``, in source order."""
    tree = Tree.of(module)
    out = []
    for key in flow.records.forwards:
        site, m = key[0], key[1]
        if m != model:
            continue
        mod, node = flow.records.nodes.get(site, (None, None))
        if mod is module and node is not None and tree.inside(node, loop):
            out.append(node)
    if not out:
        raise NoFix("the forward runs in another function than the loop (both would have to change)")
    return sorted(set(out), key=lambda n: (n.lineno, n.col_offset))


def step_nodes(ctx, flow, pop, module) -> list:
    nodes = []
    for token, kind, resolver, across, guard in pop.records:
        if kind != "stepped":
            continue
        mod, node = flow.records.nodes.get(resolver, (None, None))
        if mod is not module or node is None:
            raise NoFix("the optimizer step is in another file or function than the loop")
        nodes.append(node)
    if not nodes:
        raise NoFix("synccheck found no optimizer step for this loop")
    return sorted(set(nodes), key=lambda n: (n.lineno, n.col_offset))


def boundary(module, back, steps: list) -> Boundary:
    """The boundary of the micro-step loop holding the backward ``back``, from its optimizer step(s)."""
    tree = Tree.of(module)
    loop = tree.enclosing_loop(back)
    if loop is None:
        raise NoFix("the backward is not in a loop of this function")
    found = set()
    results = []
    for step in steps:
        if tree.inside(step, loop):
            cond, negated = tree.gate(step, loop)
            if cond is None:
                results.append(_continue_gate(module, tree, loop, step))
            else:
                cond_text = text(module, cond.test)
                node = cond.test
                results.append(Boundary(negate(cond_text, node) if negated else cond_text,
                                        None if negated else node, loop, False, cond, _count(cond.test)))
        else:
            results.append(_inner(module, tree, loop, step))
        found.add(results[-1].cond)
    if len(found) != 1:
        raise NoFix("the optimizer steps under different conditions")
    result = results[0]
    if result.node is not None:
        check_pure(result.node)
    return result


def _continue_gate(module, tree, loop, step) -> Boundary:
    """``if (i + 1) % n != 0: continue`` before an unconditional step."""
    top = tree.top_of(step, loop)
    gates = [s for s in loop.body[:loop.body.index(top)]
             if isinstance(s, ast.If) and not s.orelse and len(s.body) == 1 and isinstance(s.body[0], ast.Continue)]
    if len(gates) != 1:
        raise NoFix("the optimizer step runs on every trip through the loop: no boundary to sync on")
    gate = gates[0]
    cond_text = text(module, gate.test)
    return Boundary(negate(cond_text, gate.test), None, loop, False, gate, _count(gate.test))


def _inner(module, tree, loop, step) -> Boundary:
    """nanoGPT: ``for micro_step in range(n): ...backward()`` with the step after the loop."""
    outer = tree.enclosing_loop(loop)
    if outer is None or not tree.inside(step, outer):
        raise NoFix("the optimizer step is outside the loops that hold the backward")
    if tree.enclosing_loop(step) is not outer:
        raise NoFix("the optimizer step is in a different loop than the micro-steps")
    cond, _ = tree.gate(step, outer)
    if cond is not None:
        raise NoFix("the optimizer step after the micro-step loop is conditional")
    if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Call)
            and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "range" and not loop.iter.keywords):
        raise NoFix("the micro-step loop is not `for v in range(n)`")
    args = loop.iter.args
    if len(args) == 2 and isinstance(args[0], ast.Constant) and args[0].value == 0:
        args = args[1:]
    if len(args) != 1 or isinstance(args[0], ast.Starred):
        raise NoFix("the micro-step loop's range does not start at 0 with step 1")
    count = args[0]
    check_pure(count)
    check_stable(count, loop.body)
    if loop.target.id in {n.id for s in loop.body for n in walk(s) if isinstance(n, ast.Name)
                          and isinstance(n.ctx, ast.Store)}:
        raise NoFix(f"the loop assigns its own counter `{loop.target.id}`")
    n_text = text(module, count)
    if not isinstance(count, (ast.Name, ast.Attribute, ast.Constant, ast.Subscript, ast.Call)):
        n_text = f"({n_text})"
    return Boundary(f"{loop.target.id} == {n_text} - 1", None, loop, True, None, text(module, count))


def _count(test) -> Optional[str]:
    """N in ``(i + 1) % N == 0``, ``i % N != 0``, ``step == N``, ``micro >= N``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _count(test.operand)
    if isinstance(test, ast.BoolOp):
        counts = {c for c in (_count(v) for v in test.values) if c}
        return counts.pop() if len(counts) == 1 else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, right = test.left, test.comparators[0]
    if isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod) and isinstance(right, ast.Constant) \
            and right.value == 0 and isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
        return ast.unparse(left.right)
    if isinstance(left, ast.Name) and isinstance(test.ops[0], (ast.Eq, ast.GtE)) and \
            isinstance(right, (ast.Name, ast.Attribute, ast.Constant)):
        return ast.unparse(right)
    return None


def stable_from(module, bound: Boundary, start_stmt) -> Boundary:
    """The boundary condition as it must be written at ``start_stmt`` to have the value the step's test
    will see: unchanged, or, for a counter the loop increments in between (``micro += 1`` before
    ``if micro == accum:``), with the counter's later value (``micro + 1 == accum``)."""
    if bound.node is None and bound.gate is None:
        return bound            # ``v == n - 1``: checked with the loop
    tree = Tree.of(module)
    loop = bound.loop
    a = tree.top_of(start_stmt, loop)
    b = tree.top_of(bound.gate, loop)
    i, j = loop.body.index(a), loop.body.index(b)
    stmts = loop.body[i:j] if i < j else loop.body[j + 1:i + 1]
    test = bound.gate.test
    steps = {}
    if i < j:
        for s in stmts:
            if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Add) and isinstance(s.target, ast.Name) and \
                    isinstance(s.value, ast.Constant) and isinstance(s.value.value, int):
                steps[s.target.id] = steps.get(s.target.id, 0) + s.value.value
    rest = [s for s in stmts if not (isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name)
                                     and s.target.id in steps)]
    check_stable(test, rest)
    if not steps or not (set(steps) & {n.id for n in walk(test) if isinstance(n, ast.Name)}):
        return bound
    import copy

    class Later(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id in steps:
                return ast.BinOp(ast.Name(node.id, ast.Load()), ast.Add(), ast.Constant(steps[node.id]))
            return node

    later = ast.fix_missing_locations(Later().visit(copy.deepcopy(test)))
    later_text = ast.unparse(later)
    negated = bound.node is None
    return bound._replace(cond=negate(later_text, later) if negated else later_text,
                          node=None if negated else later)


def model_text(module, call) -> str:
    """How the loop calls the model (``model``, ``self.model``), from its forward call."""
    func = call.func if isinstance(call, ast.Call) else call
    if isinstance(func, ast.Attribute) and func.attr == "forward":
        func = func.value
    node = func
    while isinstance(node, ast.Attribute):
        node = node.value
    if not isinstance(node, ast.Name):
        raise NoFix("the model is not called through a plain name")
    return text(module, func)


def wrap_call(flow, wrapper) -> tuple:
    """(module, call) of the call that made ``wrapper`` (``DDP(model, ...)``), or (None, None)."""
    site = getattr(wrapper, "site", None)
    if not site:
        return None, None
    path, line, col = site[:3]
    project = flow.project
    module = project.by_path.get(path) or next((m for m in project.modules() if m.path == path), None)
    if module is None or getattr(module, "tree", None) is None:
        return None, None
    call = module.call_at(line, col)
    return (module, call) if call is not None else (None, None)


def static_graph(flow, wrapper) -> bool:
    """``DDP(..., static_graph=<anything but False>)``: its first iteration must sync (pytorch#143580)."""
    _, call = wrap_call(flow, wrapper)
    return call is not None and any(k.arg == "static_graph" and not (isinstance(k.value, ast.Constant)
                                                                     and k.value.value in (False, None, 0))
                                    for k in call.keywords)


def always_wrapped(flow, wrapper) -> bool:
    """Is the model the loop calls a wrapper on every path: its wrap call is the whole value of a
    statement (``model = DDP(model)``, ``return DDP(model)``) that runs whenever its function (or the
    module) does? ``if rank != -1: model = DDP(model)``, ``DDP(m) if distributed else m`` and a wrap
    this cannot find are not: on the other paths the model is a plain module (or a DataParallel) with
    no ``no_sync()``, and a fix that calls it there would raise AttributeError."""
    module, call = wrap_call(flow, wrapper)
    if call is None:
        return False
    tree = Tree.of(module)
    stmt = tree.parent.get(call)
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Return, ast.Expr)):
        return False
    child = stmt
    for owner in tree.ancestors(stmt):
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            return True
        if isinstance(owner, ast.Try) and child in owner.finalbody:
            child = owner
            continue
        if not isinstance(owner, (ast.With, ast.AsyncWith)):
            return False            # an if, a loop, a try (its handler may go on unwrapped), a match
        child = owner
    return False


def null_context(module) -> tuple:
    """(how to write ``nullcontext()`` here, the import it needs or None). Only imports at the top of
    the module count: one inside a function or an ``if`` may not have run where the fix uses it."""
    plain = None
    for stmt in module.tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "contextlib" and not stmt.level:
            for alias in stmt.names:
                if alias.name == "nullcontext":
                    return f"{alias.asname or alias.name}()", None
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name == "contextlib" and plain is None:
                    plain = alias.asname or alias.name
    if plain is not None:
        return f"{plain}.nullcontext()", None
    return "contextlib.nullcontext()", "contextlib"


def pos(module, node) -> tuple:
    return position(module, node)


LOOP_TYPES = LOOPS
