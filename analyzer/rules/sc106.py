from synccheck.analyzer.rules.base import Rule


class StaticGraphNoSync(Rule):
    code = "SC106"
    name = "static-graph-no-sync"
    severity = "error"
    summary = "DDP(static_graph=True) with no_sync on the very first iteration fails an internal assert"
    requires = ("static_graph",)
    what = """
        Finds `DistributedDataParallel(..., static_graph=True)` models whose very first micro-step can
        run with gradient sync off (`no_sync()`, or `require_backward_grad_sync = False`), and Lightning
        Trainers given `DDPStrategy(static_graph=True)` with `accumulate_grad_batches` above 1 (Lightning
        runs every micro-step before a boundary under `no_sync`, the first one included).
    """
    why = """
        With `static_graph=True` DDP records the graph during the first iteration and needs that
        iteration's backward to run its hooks. Skipping sync on iteration 0 trips
        `INTERNAL ASSERT FAILED` in the reducer (pytorch#143580): the job crashes at the start, on
        every rank, often only once the full-size configuration is launched.
    """
    use_instead = "Let the first micro-step sync (`sync = i == 0 or (i + 1) % n == 0`), or drop static_graph."
    fix_safety = """
        There is no automatic fix: either drop `static_graph=True` or let the first iteration sync.
    """
    references = ("pytorch/pytorch#143580, INTERNAL ASSERT with static_graph and no_sync: https://github.com/pytorch/pytorch/issues/143580",)
    INVALID = ("""
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, static_graph=True)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % 4 == 0
            with nullcontext() if sync else model.no_sync():  # SC106
                model(x).sum().backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy

        trainer = pl.Trainer(
            devices=4,
            strategy=DDPStrategy(static_graph=True),  # SC106
            accumulate_grad_batches=8,
        )
        trainer.fit(model, train_loader)
    """)
    VALID = ("""
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, static_graph=True)
        for i, (x, y) in enumerate(loader):
            sync = i % 4 == 0
            with nullcontext() if sync else model.no_sync():
                model(x).sum().backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % 4 == 0
            with nullcontext() if sync else model.no_sync():
                model(x).sum().backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy

        trainer = pl.Trainer(devices=4, strategy=DDPStrategy(static_graph=True), accumulate_grad_batches=1)
        trainer.fit(model, train_loader)
    """)

    def check(self, ctx):
        from synccheck.analyzer.project.micro_step_facts import first_iteration_off

        from synccheck.analyzer.project.static import (accelerate_static_graph_accumulation,
                                                       lightning_static_graph_accumulation)

        for found in lightning_static_graph_accumulation(ctx.program):
            ctx.report(self, found.module, found.node,
                       "`DDPStrategy(static_graph=True)` with `accumulate_grad_batches` > 1: Lightning runs "
                       "the micro-steps before each optimizer step under no_sync, the very first one included, "
                       "and DDP's reducer fails an internal assert (pytorch#143580)",
                       "drop static_graph=True, or do not accumulate with this strategy")
        for found in accelerate_static_graph_accumulation(ctx.program):
            ctx.report(self, found.module, found.node,
                       "`DistributedDataParallelKwargs(static_graph=True)` with gradient accumulation: "
                       "`accelerator.accumulate()` runs the micro-steps before each boundary under no_sync, "
                       "the very first one included, and DDP's reducer fails an internal assert "
                       "(pytorch#143580, accelerate#3679)",
                       "drop static_graph=True, or do not accumulate with it")
        for flow in ctx.flows:
            for site, model, by in first_iteration_off(flow):
                module, node = ctx.node(flow, by)
                ctx.report(self, module, node,
                           f"`{ctx.model_name(model)}` has static_graph=True and this turns sync off on the very "
                           f"first micro-step: DDP's reducer fails an internal assert (pytorch#143580)",
                           "let iteration 0 sync, or drop static_graph=True")
