"""Fixes for SC201 (zero_grad on every micro-step), SC202 (undivided loss), SC302 (no set_epoch) and
SC105 (accumulate without steps). All change what the training computes, so all are unsafe."""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.fix.plan import build
from synccheck.analyzer.fix.schedule import boundary, pos, step_nodes
from synccheck.analyzer.fix.syntax import NoFix, Tree, check_stable, end_position, text
from synccheck.analyzer.project.traversal import walk


def wiped(flow, pop, zero_site) -> dict:
    """SC201: the ``zero_grad()`` statement moves to just after the optimizer step (after the scaler's
    ``update()`` when there is one), unless one is already there."""
    module, zero = flow.records.nodes.get(zero_site, (None, None))
    if module is None:
        return {"reason": "the zero_grad call's position is unknown"}

    def make():
        tree = Tree.of(module)
        stmt = tree.statement(zero)
        if not (isinstance(stmt, ast.Expr) and stmt.value is zero):
            raise NoFix("zero_grad() is not a statement of its own")
        steps = step_nodes(None, flow, pop, module)
        if len(steps) != 1:
            raise NoFix("the optimizer steps in more than one place")
        step = tree.statement(steps[0])
        if not isinstance(step, ast.Expr) or tree.enclosing_loop(step) is not tree.enclosing_loop(stmt):
            raise NoFix("the optimizer step is not a statement of the same loop")
        block = tree.block(step)
        after = step
        for s in block[block.index(step) + 1:]:
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and \
                    getattr(s.value.func, "attr", "") in ("update",):
                after = s
                continue
            break
        rest = block[block.index(step) + 1:]
        ops = [("remove", pos(module, stmt))]
        if not any("zero_grad" in text(module, s) for s in rest):
            ops.append(("after", pos(module, after), text(module, stmt)))
        return ops

    return build(module, "Move zero_grad() to just after the optimizer step", "unsafe", make)


def unscaled(flow, site, info) -> dict:
    """SC202: the loss reaching backward is divided by the count the step's condition uses."""
    from synccheck.analyzer.project.facts import populations

    module, back = info.module, info.node

    def make():
        pops = [p for p in populations(flow) if any(r[0].site == site for r in p.records)]
        if len(pops) != 1:
            raise NoFix("the backward belongs to more than one accumulation loop")
        bound = boundary(module, back, step_nodes(None, flow, pops[0], module))
        if not bound.count:
            raise NoFix("the number of micro-steps is not written in the step's condition")
        count = ast.parse(bound.count, mode="eval").body
        check_stable(count, bound.loop.body)
        if not isinstance(back, ast.Call):
            raise NoFix("the backward is not a call")
        if info.via == "loss.backward" and isinstance(back.func, ast.Attribute):
            loss = back.func.value
        elif info.via == "scaler.scale(loss).backward" and isinstance(back.func.value, ast.Call) and \
                back.func.value.args:
            loss = back.func.value.args[0]
        elif info.via in ("fabric.backward", "torch.autograd.backward") and back.args:
            loss = back.args[0]
        else:
            raise NoFix("synccheck cannot tell which expression is the loss")
        atom = isinstance(loss, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        n = bound.count if re.fullmatch(r"[\w.]+", bound.count) else f"({bound.count})"
        new = f"{text(module, loss)} / {n}" if atom else f"({text(module, loss)}) / {n}"
        if info.via == "loss.backward":
            new = f"({new})"
        return [("replace", pos(module, loss), end_position(module, loss), new)]

    return build(module, "Divide the loss by the number of micro-steps", "unsafe", make)


def set_epoch(program, found) -> dict:
    """SC302: ``sampler.set_epoch(epoch)`` first thing in the epoch loop of the same function."""
    module, call, name = found.module, found.node, found.name

    def make():
        if not re.fullmatch(r"(self\.)?[A-Za-z_]\w*(\.sampler)?", name or ""):
            raise NoFix("the sampler is not bound to a plain name")
        tree = Tree.of(module)
        scope = _scope(tree, call)
        loops = [n for n in walk(module.tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
                 and "epoch" in n.target.id.lower() and _scope(tree, n) is scope and n.lineno >= call.lineno
                 and any(isinstance(x, (ast.For, ast.While)) for s in n.body for x in walk(s))]
        if len(loops) != 1:
            raise NoFix("there is not exactly one epoch loop after the sampler in the same function")
        loop = loops[0]
        if loop.target.id in {n.id for s in loop.body for n in walk(s)
                              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}:
            raise NoFix("the epoch loop reassigns its epoch variable")
        return [("before", pos(module, loop.body[0]), f"{name}.set_epoch({loop.target.id})")]

    return build(module, "Call set_epoch(epoch) at the start of each epoch", "unsafe", make)


def _scope(tree, node):
    return next((a for a in tree.ancestors(node) if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))), None)


ACCUM_NAME = re.compile(r"(gradient_accumulation_steps|grad_accum(_steps|ulation_steps)?|accum(ulation)?_steps"
                        r"|accumulation_steps|accum_iter|accum)$")


def accumulate_steps(program, found) -> dict:
    """SC105: ``gradient_accumulation_steps=`` on the file's one ``Accelerator(...)``, from the one
    accumulation-count name the file spells out."""
    module = found.module

    def make():
        builds = [n for n in walk(module.tree) if isinstance(n, ast.Call) and
                  (getattr(n.func, "id", None) == "Accelerator" or getattr(n.func, "attr", None) == "Accelerator")]
        if len(builds) != 1:
            raise NoFix("the Accelerator is not built exactly once in this file")
        made = builds[0]
        if any(k.arg is None for k in made.keywords) or any(isinstance(a, ast.Starred) for a in made.args):
            raise NoFix("the Accelerator's arguments are unpacked from a mapping")
        names = {}
        for n in walk(module.tree):
            if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load):
                last = n.id if isinstance(n, ast.Name) else n.attr
                if ACCUM_NAME.match(last) and not (isinstance(n, ast.Attribute) and
                                                   text(module, n.value).endswith("accelerator")):
                    names.setdefault(text(module, n), n)
        if len(names) != 1:
            raise NoFix("the number of micro-steps per optimizer step is not spelled out once in this file")
        (count_text, node), = names.items()
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name) or not _bound_before(tree=Tree.of(module), module=module, name=root.id,
                                                               at=made):
            raise NoFix(f"`{count_text}` is not set before the Accelerator is built")
        return [("kwarg", pos(module, made), end_position(module, made), "gradient_accumulation_steps", count_text)]

    return build(module, "Pass gradient_accumulation_steps to the Accelerator", "unsafe", make)


def _bound_before(tree, module, name: str, at) -> bool:
    scope = _scope(tree, at)
    if scope is not None and name in {a.arg for a in scope.args.args + scope.args.kwonlyargs}:
        return True
    for n in walk(scope or module.tree):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) and n.lineno < at.lineno \
                and _scope(tree, n) is scope:
            return True
    return False
