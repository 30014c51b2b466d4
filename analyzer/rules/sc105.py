from synccheck.analyzer.rules.base import Rule


class AccumulateWithoutSteps(Rule):
    code = "SC105"
    name = "accumulate-without-steps"
    severity = "warning"
    summary = "accelerator.accumulate() is used but the Accelerator has no gradient_accumulation_steps"
    requires = (".accumulate(", "Accelerator")
    what = """
        Finds `with accelerator.accumulate(model):` where the `Accelerator(...)` built in the same file
        is never given `gradient_accumulation_steps` (directly, through a
        `GradientAccumulationPlugin`, or by setting `accelerator.gradient_accumulation_steps` later).
    """
    why = """
        Without the number of steps Accelerate defaults to 1: `accumulate()` then syncs and steps on
        every micro-batch. The code looks like gradient accumulation but trains with the small batch
        size, at full communication cost.
    """
    use_instead = "Pass `gradient_accumulation_steps=N` to `Accelerator(...)`."
    fix_safety = """
        `--fix` passes `gradient_accumulation_steps=<count>` to the file's one `Accelerator(...)` when the
        file spells the count once, under a recognisable name (`args.gradient_accumulation_steps`). Unsafe:
        Accelerate then skips sync and steps, and divides the loss, which changes training.
    """
    references = ("Hugging Face Accelerate, Performing gradient accumulation: https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation",)
    INVALID = ("""
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):  # SC105
                accelerator.backward(model(batch).loss)
                optimizer.step()
                optimizer.zero_grad()
    """,)
    VALID = ("""
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin

        plugin = GradientAccumulationPlugin(num_steps=4)
        accelerator = Accelerator(gradient_accumulation_plugin=plugin)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
    """, """
        from accelerate import Accelerator

        accelerator = Accelerator()
        accelerator.gradient_accumulation_steps = args.accum
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
    """, """
        from accelerate import Accelerator

        accelerator = Accelerator(**accelerator_kwargs)   # cannot tell: stays silent
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan_more
        from synccheck.analyzer.project.static import accumulate_without_steps

        for found in accumulate_without_steps(ctx.program):
            ctx.report(self, found.module, found.node,
                       f"`{found.accelerator_text}` was built "
                       f"{'with gradient_accumulation_steps=1 while the script counts micro-steps' if found.one else 'without gradient_accumulation_steps'}"
                       f", so accumulate() syncs and steps on every micro-batch: no accumulation happens",
                       "pass gradient_accumulation_steps=N to Accelerator(...)",
                       autofix=lambda found=found: plan_more.accumulate_steps(ctx.program, found))
