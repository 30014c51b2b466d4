"""Fixes for the sync rules (SC101, SC102, SC103), built from the facts the rule reported.

Each function returns the finding's fix: ``{"applicability", "message", "edits"}`` (ruff's shape), or
``{"reason": ...}`` when synccheck cannot prove a rewrite right; it never guesses. A fix that keeps
the numbers the training computes (the gradients are all-reduced once instead of N times) is safe; one
that changes them (a step that used unsynced gradients now syncs) is unsafe.
"""
from __future__ import annotations

import ast

from synccheck.analyzer.fix.schedule import (always_wrapped, boundary, forwards, model_text, null_context, pos, stable_from,
                                             static_graph, step_nodes)
from synccheck.analyzer.fix.syntax import NoFix, Tree, check_stable, text
from synccheck.analyzer.project.traversal import walk


def build(module, message: str, applicability: str, make) -> dict:
    """Run ``make()`` (the plan's operations) and render it; any doubt becomes a reason. When the edits
    are not wanted (``fix.EDITS``), a plan that was made is reported as ``"deferred"``: the fix exists,
    its edits are built when --fix, --diff or JSON analyse the file again (a notebook's are always
    built: they are mapped to its cells)."""
    from synccheck.analyzer import fix as settings
    from synccheck.analyzer.fix.rewrite import parse, plan_edits

    try:
        ops = tuple(make())
        if not settings.EDITS and not module.path.endswith(".ipynb"):
            if not ops:
                return {"reason": "the rewrite changes nothing"}
            return {"applicability": applicability, "message": message, "deferred": True}
        parsed = getattr(module, "_fix_cst", None)
        if parsed is None or parsed[0] != module.text:
            parsed = (module.text, parse(module.text))
            module._fix_cst = parsed
        found = plan_edits(module.text, ops, parsed[1])
    except NoFix as exc:
        return {"reason": str(exc)}
    except RecursionError:
        return {"reason": "the code is nested too deeply to rewrite"}
    except Exception as exc:       # libcst's parser or the plan not fitting: no fix rather than a wrong one
        return {"reason": f"the rewrite does not fit this code ({type(exc).__name__})"}
    if not found:
        return {"reason": "the rewrite changes nothing"}
    return {"applicability": applicability, "message": message, "edits": found}


# ---------------------------------------------------------------------------------------------------
# SC101: no sync control at all

def wasted(flow, pop, site) -> dict:
    module, back = flow.records.nodes.get(site, (None, None))
    if module is None:
        return {"reason": "the backward's position is unknown"}
    kind = pop.model.kind
    box: dict = {}

    def make():
        bound = boundary(module, back, step_nodes(None, flow, pop, module))
        calls = forwards(None, flow, pop.model, module, bound.loop)
        tree = Tree.of(module)
        first, last = tree.sibling_range(calls[0], back)
        if not all(_covered(tree, c, first, last) for c in calls):
            raise NoFix("the model's forwards in this loop are not next to its backward")
        bound = stable_from(module, bound, first)
        name = model_text(module, calls[0])
        ops = []
        if kind in ("ddp", "fsdp"):
            if kind == "ddp" and static_graph(flow, pop.model):
                raise NoFix("the model is DDP(static_graph=...), whose first iteration must sync (pytorch#143580), "
                            "and synccheck does not prove that the loop's gate lets it")
            if bound.inner and kind == "ddp":
                box["message"] = f"Set `{name}.require_backward_grad_sync` before the forward of each micro-step"
                ops.append(("before", pos(module, first), f"{name}.require_backward_grad_sync = ({bound.cond})"))
            else:
                null, need = null_context(module)
                test = bound.test()
                box["message"] = f"Run the non-boundary micro-steps under `{name}.no_sync()`"
                if not always_wrapped(flow, pop.model):
                    # `if rank != -1: model = DDP(model)`: a plain module has no no_sync()
                    test = f"{_loose(test)} or not hasattr({name}, \"no_sync\")"
                    box["message"] += " where it has one (it is not wrapped on every path)"
                ops.append(("wrap", pos(module, first), pos(module, last),
                            f"({null} if {test} else {name}.no_sync())"))
                if need:
                    ops.append(("import", need))
        elif kind == "fsdp2":
            if not always_wrapped(flow, pop.model):
                raise NoFix("the model is not sharded on every path: `set_requires_gradient_sync` would fail on the "
                            "others")
            box["message"] = f"Turn gradient sync off with `{name}.set_requires_gradient_sync` off the boundary"
            ops.append(("before", pos(module, first), f"{name}.set_requires_gradient_sync({bound.cond})"))
        elif kind == "fabric":
            fabric = _receiver(module, back, "backward")
            box["message"] = f"Run the non-boundary micro-steps under `{fabric}.no_backward_sync`"
            ops.append(("wrap", pos(module, first), pos(module, last),
                        f"{fabric}.no_backward_sync({name}, enabled={bound.negated()})"))
        elif kind == "accelerate":
            ops.extend(_accelerate(module, back, bound, first, last, name))
            box["message"] = "Use `accelerator.accumulate(model)` with `gradient_accumulation_steps`"
        elif kind == "apex":
            raise NoFix("the model is apex's DistributedDataParallel, which has no no_sync(): turn its "
                        "all-reduce off with `disable_allreduce()` off the boundary (`enable_allreduce()` on "
                        "it), or use torch's DDP")
        else:
            raise NoFix(f"no automatic fix for a {kind} model")
        return ops

    applicability = "unsafe" if kind == "accelerate" else "safe"
    result = build(module, "", applicability, make)
    if "applicability" in result:
        result["message"] = box.get("message", "Turn gradient sync off off the boundary")
    return result


def _loose(test: str) -> str:
    """``test`` as the left operand of ``or``: parenthesized if it binds more loosely."""
    try:
        node = ast.parse(test.strip(), mode="eval").body
    except SyntaxError:
        return f"({test})"
    return f"({test})" if isinstance(node, (ast.IfExp, ast.Lambda, ast.NamedExpr)) else test


def _covered(tree, node, first, last) -> bool:
    block = tree.block(first)
    lo, hi = block.index(first), block.index(last)
    stmt = tree.statement(node)
    while stmt is not None:
        if stmt in tree.block_of and tree.block(stmt) is block:
            return lo <= block.index(stmt) <= hi
        stmt = tree.statement(tree.parent.get(stmt))
    return False


def _receiver(module, call, attr: str) -> str:
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == attr:
        return text(module, call.func.value)
    raise NoFix(f"the backward is not `<framework>.{attr}(loss)`")


def _accelerate(module, back, bound, first, last, name) -> list:
    """``with accelerator.accumulate(model):`` around the micro-step, and the step count where the
    Accelerator is built. Unsafe: ``accelerator.backward`` then divides the loss by that count, and
    Accelerate's own counter decides the boundary."""
    accelerator = _receiver(module, back, "backward")
    if bound.inner or bound.count is None:
        raise NoFix("the number of micro-steps per optimizer step is not written in the step's condition")
    builds = [n for n in walk(module.tree) if isinstance(n, ast.Call) and
              (getattr(n.func, "id", None) == "Accelerator" or getattr(n.func, "attr", None) == "Accelerator")]
    if len(builds) != 1:
        raise NoFix("the Accelerator is not built exactly once in this file")
    made = builds[0]
    if any(k.arg is None or k.arg.startswith("gradient_accumulation") for k in made.keywords):
        raise NoFix("the Accelerator's arguments may already set gradient accumulation")
    if made.lineno > first.lineno and Tree.of(module).enclosing_loop(made) is None and \
            _same_scope(module, made, first):
        raise NoFix("the Accelerator is built after the loop")
    count = ast.parse(bound.count, mode="eval").body
    late = [s for s in module.tree.body if made.lineno < s.lineno < first.lineno]
    try:
        check_stable(count, late)
    except NoFix:
        raise NoFix(f"the number of micro-steps (`{bound.count}`) is set after the Accelerator is built") from None
    from synccheck.analyzer.fix.syntax import end_position
    return [("wrap", pos(module, first), pos(module, last), f"{accelerator}.accumulate({name})"),
            ("kwarg", pos(module, made), end_position(module, made), "gradient_accumulation_steps", bound.count)]


def _same_scope(module, a, b) -> bool:
    tree = Tree.of(module)

    def scope(n):
        return next((x for x in tree.ancestors(n) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return scope(a) is scope(b)


# ---------------------------------------------------------------------------------------------------
# SC102: the control covers the backward, not the forward

def missed(flow, by, site, model, kind: str) -> dict:
    module, node = flow.records.nodes.get(by, (None, None))
    if module is None:
        return {"reason": "the sync control's position is unknown"}
    tree = Tree.of(module)
    calls_box: dict = {}

    def calls(loop):
        if "calls" not in calls_box:
            calls_box["calls"] = forwards(None, flow, model, module, loop)
        return calls_box["calls"]

    if kind == "flag":
        def make_flag():
            stmt = tree.statement(node)
            loop = tree.enclosing_loop(stmt)
            if loop is None:
                raise NoFix("the flag is not set in a loop")
            before = [c for c in calls(loop) if (c.lineno, c.col_offset) < (stmt.lineno, stmt.col_offset)]
            if not before:
                raise NoFix("no forward of the model before the flag in this loop")
            first, last = tree.sibling_range(before[-1], stmt)
            if last is not stmt:
                raise NoFix("the flag and the forward are not in one block")
            block = tree.block(stmt)
            check_stable(stmt.value, block[block.index(first):block.index(stmt)])
            return [("move", pos(module, stmt), pos(module, first))]
        return build(module, "Set `require_backward_grad_sync` before the forward", "unsafe", make_flag)

    def make_control():
        with_stmt = node if isinstance(node, (ast.With, ast.AsyncWith)) else tree.statement(node)
        if not isinstance(with_stmt, ast.With) or len(with_stmt.items) != 1 or with_stmt.items[0].optional_vars:
            raise NoFix("the sync control is not a plain `with <control>:` statement")
        loop = tree.enclosing_loop(with_stmt)
        if loop is None:
            raise NoFix("the sync control is not in a loop")
        before = [c for c in calls(loop) if (c.lineno, c.col_offset) < (with_stmt.lineno, with_stmt.col_offset)]
        if not before:
            raise NoFix("no forward of the model before the sync control in this loop")
        first, holder = tree.sibling_range(before[0], with_stmt)
        control = text(module, with_stmt.items[0].context_expr)
        null, need = null_context(module)
        if holder is with_stmt:
            raise NoFix("the sync control is unconditional: moving it over the forward would leave the boundary "
                        "unsynced")
        if not (isinstance(holder, ast.If) and (with_stmt in holder.body or with_stmt in holder.orelse)):
            raise NoFix("the sync control sits under more than one condition")
        cond = holder.test
        block = tree.block(holder)
        check_stable(cond, block[block.index(first):block.index(holder)])
        from synccheck.analyzer.fix.syntax import in_cond, negate
        test = text(module, cond)
        test = in_cond(test, cond) if with_stmt in holder.body else in_cond(negate(test, cond), None)
        ops = [("unwrap", pos(module, with_stmt)),
               ("wrap", pos(module, first), pos(module, holder), f"({control} if {test} else {null})")]
        return ops + ([("import", need)] if need else [])

    result = build(module, "", "safe", make_control)
    if "applicability" in result:
        result["message"] = "Move the sync control so that it covers the forward too"
    return result


# ---------------------------------------------------------------------------------------------------
# SC103: sync off at the boundary

def unsynced(flow, pop, token, step_site) -> dict:
    module, back = flow.records.nodes.get(token.site, (None, None))
    if module is None or token.by is None:
        return {"reason": "the sync control's position is unknown"}
    by_module, by = flow.records.nodes.get(token.by, (None, None))
    if by_module is not module:
        return {"reason": "the sync control is in another file than the loop"}
    if token.forward_outside:
        return {"reason": "the forward and the backward sit in different sync contexts; move the backward into the "
                          "forward's context by hand"}

    def make():
        tree = Tree.of(module)
        bound = boundary(module, back, step_nodes(None, flow, pop, module))
        stmt = tree.statement(by)
        bound = stable_from(module, bound, stmt)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
                getattr(stmt.targets[0], "attr", "") == "require_backward_grad_sync":
            return [("replace", pos(module, stmt.value), _end(module, stmt.value), f"({bound.cond})")]
        if isinstance(by, ast.Call) and getattr(by.func, "attr", "") == "set_requires_gradient_sync" and by.args:
            arg = by.args[0]
            return [("replace", pos(module, arg), _end(module, arg), bound.cond)]
        if not isinstance(stmt, ast.With) or len(stmt.items) != 1:
            raise NoFix("the sync control is not a plain `with` statement")
        expr = stmt.items[0].context_expr
        null, need = null_context(module)
        if isinstance(expr, ast.Name):
            expr = _assigned_context(tree, stmt, expr.id)
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and not expr.args and not expr.keywords:
            # ``ctx = model.no_sync if c else nullcontext`` then ``with ctx():``: the chosen callable
            try:
                chosen = _assigned_context(tree, stmt, expr.func.id)
            except NoFix:
                chosen = None               # a function of the project: wrapped below
            if isinstance(chosen, ast.IfExp):
                expr, null = chosen, null[:-2] if null.endswith("()") else null
        extra = [("import", need)] if need else []
        if isinstance(expr, ast.IfExp):
            off = expr.body if "sync" in text(module, expr.body) else expr.orelse
            if "sync" not in text(module, off):
                raise NoFix("cannot tell which branch of the sync context turns sync off")
            new = f"{null} if {bound.test()} else {text(module, off)}"
            return [("replace", pos(module, expr), _end(module, expr), new)] + extra
        if isinstance(expr, ast.Call) and getattr(expr.func, "attr", "") == "no_backward_sync":
            enabled = next((k.value for k in expr.keywords if k.arg == "enabled"), None)
            if enabled is None:
                call_end = _end(module, expr)
                return [("kwarg", pos(module, expr), call_end, "enabled", bound.negated())]
            return [("replace", pos(module, enabled), _end(module, enabled), bound.negated())]
        if not (isinstance(expr, ast.Call) and "sync" in text(module, expr.func)):
            raise NoFix("the sync context is not a call synccheck can rewrite")
        holder = tree.parent.get(stmt)
        if isinstance(holder, ast.If) and holder is not bound.gate and tree.enclosing_loop(stmt) is bound.loop and \
                holder is not bound.loop and (stmt in holder.body or stmt in holder.orelse):
            test = bound.negated() if stmt in holder.body else bound.cond
            return [("replace", pos(module, holder.test), _end(module, holder.test), test)]
        if tree.enclosing_loop(stmt) is not bound.loop or holder is not bound.loop and not isinstance(holder, ast.With):
            raise NoFix("the sync control sits under a condition synccheck cannot relate to the step's")
        return [("replace", pos(module, expr), _end(module, expr),
                 f"({null} if {bound.test()} else {text(module, expr)})")] + extra

    return build(module, "Make the sync condition the optimizer step's condition", "unsafe", make)


def _assigned_context(tree, with_stmt, name: str):
    """``ctx = model.no_sync() if c else nullcontext()`` then ``with ctx:``: the assigned expression,
    when it is the only assignment of ``ctx`` and sits just before, in the same block."""
    block = tree.block(with_stmt)
    before = block[:block.index(with_stmt)]
    assigns = [s for s in before if isinstance(s, ast.Assign) and len(s.targets) == 1
               and isinstance(s.targets[0], ast.Name) and s.targets[0].id == name]
    loop = tree.enclosing_loop(with_stmt)
    others = [n for n in walk(loop) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]
    if len(assigns) != 1 or len(others) != 1:
        raise NoFix(f"`{name}` is not assigned once, just before the `with`")
    return assigns[0].value


def _end(module, node) -> tuple:
    from synccheck.analyzer.fix.syntax import end_position
    return end_position(module, node)
