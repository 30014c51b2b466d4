from synccheck.analyzer.rules.base import Rule


class ZeroGradEveryMicrostep(Rule):
    code = "SC201"
    name = "zero-grad-every-microstep"
    severity = "error"
    summary = "zero_grad() runs on every micro-step, wiping the gradients being accumulated"
    requires = ("backward(", "zero_grad", "step(")  # also manual_backward( (Lightning)
    what = """
        Finds accumulation loops (the optimizer steps every N micro-steps) where `zero_grad()` runs
        on every micro-step, not only at the boundary. Not reported for optimizers prepared by
        Accelerate or DeepSpeed, whose `zero_grad()` does nothing off the boundary.
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
    """,)
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
                optimizer.zero_grad()
                accelerator.backward(model(batch).loss)
                optimizer.step()
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
        from synccheck.analyzer.project.facts import wiped

        for flow in ctx.flows:
            for site, token, outcomes, group in wiped(flow):
                module, node = ctx.node(flow, site)
                ctx.report(self, module, node,
                           f"`{ctx.text(module, node)}` runs on every micro-step of this accumulation loop: it wipes "
                           f"the gradients accumulated so far, so the optimizer only ever sees the last micro-batch",
                           "move zero_grad() next to optimizer.step(), inside the boundary branch",
                           autofix=lambda flow=flow, pop=outcomes, site=site: plan_more.wiped(flow, pop, site))
