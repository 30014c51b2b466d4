from synccheck.analyzer.rules.base import Rule


class ZeroGradEveryMicrostep(Rule):
    code = "SC201"
    name = "zero-grad-every-microstep"
    severity = "error"
    summary = "zero_grad() runs on every micro-step, wiping the gradients being accumulated"
    requires = (".backward(", "zero_grad", "step(")
    loop_anchors = (".backward(",)
    loop_companions = ("step(",)         # a loop that never steps has no boundary to get wrong
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
        from synccheck.analyzer.paths import ZeroGrad
        managed = ctx.model.managed_optimizers
        for acc in ctx.loops:
            if not acc.is_accumulating or acc.too_complex:
                continue
            accumulating = acc.micro_steps(False)
            per_path = []
            for path in accumulating:
                if any(b.state.value == "managed" for b in path.backwards):
                    per_path = []
                    break
                accumulating_models = {b.model for b in path.backwards if not acc.boundary_of(path, b)}
                zeros = [r for r in path.records if isinstance(r, ZeroGrad) and r.target not in managed
                         and not any(w.kind in ("accelerate", "deepspeed") for w in ctx.model.lookup(r.target))
                         and _clears(ctx.model, r.target, accumulating_models)]
                if not zeros:
                    per_path = []
                    break
                per_path.append(zeros)
            for zeros in per_path:
                for z in zeros:
                    ctx.report(self, z.node, f"`{ctx.model.code(z.node).strip()}` runs on every micro-step of this "
                                             f"accumulation loop: it wipes the gradients accumulated so far, so the "
                                             f"optimizer only ever sees the last micro-batch",
                               "move zero_grad() next to optimizer.step(), inside the boundary branch")


def _clears(model, target, models) -> bool:
    """Does ``target.zero_grad()`` clear the gradients of one of these models?"""
    from synccheck.analyzer.paths import bare

    if not target or None in models:
        return True
    owner = model.optimizer_model.get(target) or next(
        (v for k, v in model.optimizer_model.items() if bare(k) == bare(target)), None)
    if owner is None and model.lookup(target):
        owner = target                      # model.zero_grad()
    return owner is None or any(bare(owner) == bare(m) for m in models)
