from synccheck.analyzer.rules.base import Rule, accumulate_calls_around


class ZeroGradEveryMicrostep(Rule):
    code = "SC201"
    name = "zero-grad-every-microstep"
    severity = "error"
    summary = "zero_grad() runs on every micro-step, wiping the gradients being accumulated"
    requires = ("backward(", "zero_grad", "step(")  # also manual_backward( (Lightning)
    what = """
        Finds accumulation loops (the optimizer steps every N micro-steps) where `zero_grad()` runs
        on every micro-step, not only at the boundary, or runs on the boundary micro-step before its
        backward. An optimizer prepared by Accelerate clears gradients only where
        `accelerator.sync_gradients` holds, on the boundary, so its `zero_grad()` is reported only
        when it comes before the backward inside `accelerator.accumulate(...)` (accelerate#1299);
        DeepSpeed's engine is never reported.
    """
    why = """
        `backward()` adds into `.grad`; `zero_grad()` clears it. Clearing on every micro-step throws
        away all micro-batches but the last: the optimizer steps on 1/N of the data, with a loss that
        was probably divided by N, and training quietly behaves like a tiny batch and learning rate.
    """
    use_instead = "Call `zero_grad()` right after `optimizer.step()`, inside the boundary branch."
    fix_safety = """
        `--fix` moves `zero_grad()` to just after the optimizer step (after `scaler.update()`). Unsafe:
        the optimizer then sees the sum of every micro-step's gradients, not only the last one's.
    """
    INVALID = ("""
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()  # SC201
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
    """, """
        from accelerate import Accelerator
        accelerator = Accelerator(gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                optimizer.zero_grad()  # SC201
                accelerator.backward(model(batch).loss)
                optimizer.step()
    """, """
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % 4 == 0
            if boundary:
                optimizer.zero_grad()  # SC201
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if boundary:
                optimizer.step()
    """)
    VALID = ("""
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
                optimizer.step()
                optimizer.zero_grad()     # a no-op off the boundary, and after the step on it
    """, """
        for i, (x, y) in enumerate(loader):
            if i % 4 == 0:
                optimizer.zero_grad()     # at the start of each window: fine
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan_more
        from synccheck.analyzer.project.micro_step_facts import wiped

        for flow in ctx.flows:
            for site, token, outcomes, group, at_boundary in wiped(flow):
                module, node = ctx.node(flow, site)
                if _inside_an_accumulate_that_never_accumulates(ctx.program, module, node):
                    continue        # (SC105: accumulate() steps on every micro-batch, there is no window to wipe)
                what = (f"`{ctx.text(module, node)}` runs after every micro-step's backward, the last one's included, "
                        f"and the optimizer steps after this loop: it steps on no gradients at all"
                        if at_boundary == "all" else
                        f"`{ctx.text(module, node)}` runs on the micro-step that steps, before its backward: it wipes "
                        f"the gradients the window's earlier micro-steps accumulated, so the optimizer only ever sees "
                        f"the last micro-batch" if at_boundary else
                        f"`{ctx.text(module, node)}` runs on every micro-step of this accumulation loop: it wipes "
                        f"the gradients accumulated so far, so the optimizer only ever sees the last micro-batch")
                ctx.report(self, module, node, what,
                           "move zero_grad() next to optimizer.step(), inside the boundary branch",
                           autofix=lambda flow=flow, pop=outcomes, site=site: plan_more.wiped(flow, pop, site))


def _inside_an_accumulate_that_never_accumulates(program, module, node) -> bool:
    """Is ``node`` inside ``with accelerator.accumulate(...)`` of an Accelerator built without
    gradient_accumulation_steps? Every micro-batch is then a step of its own (SC105's finding)."""
    from synccheck.analyzer.project.definitions import enclosing_function
    from synccheck.analyzer.project.values import Framework

    if module is None or node is None:
        return False
    scope = enclosing_function(module, node) or module
    for call in accumulate_calls_around(getattr(scope, "node", None) or module.tree, node):
        held = [v for v in program.values.expr(call.func.value, scope) if isinstance(v, Framework)]
        if held and all(v.kind == "accelerate" and v.accumulates == "no" for v in held):
            return True
    return False
