from synccheck.analyzer.rules.base import Rule


class SamplerWithoutSetEpoch(Rule):
    code = "SC302"
    name = "sampler-without-set-epoch"
    severity = "warning"
    summary = "DistributedSampler is iterated over several epochs but set_epoch() is never called"
    requires = ("DistributedSampler",)
    what = """
        Finds a `DistributedSampler` built in a file that loops over epochs but never calls
        `set_epoch(...)`. Samplers built with `shuffle=False` are not reported.
    """
    why = """
        `DistributedSampler` seeds its shuffle with the epoch number. Without `set_epoch(epoch)` at
        the start of each epoch every epoch sees the same order on every rank: the shuffling you
        asked for happens once, and training generalises worse.
    """
    use_instead = "Call `sampler.set_epoch(epoch)` at the start of each epoch, before iterating the loader."
    fix_safety = """
        `--fix` calls `sampler.set_epoch(epoch)` first thing in the epoch loop of the same function.
        Unsafe: every epoch after the first sees a different order than before.
    """
    references = ("PyTorch, `DistributedSampler` (and `set_epoch`): https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler",)
    INVALID = ("""
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset)  # SC302
        loader = DataLoader(dataset, sampler=sampler, batch_size=32)
        for epoch in range(10):
            for x, y in loader:
                train_step(x, y)
    """,)
    VALID = ("""
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset)
        loader = DataLoader(dataset, sampler=sampler, batch_size=32)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            for x, y in loader:
                train_step(x, y)
    """, """
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset, shuffle=False)
        loader = DataLoader(dataset, sampler=sampler)
        for epoch in range(10):
            for x, y in loader:
                train_step(x, y)
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan_more
        from synccheck.analyzer.project.samplers import samplers_without_set_epoch

        for found in samplers_without_set_epoch(ctx.program):
            named = found.name != "the sampler"
            subject = f"`{found.name}` is a DistributedSampler but" if named else "this DistributedSampler is built but"
            never = "is called only once, before the epoch loop" if found.once else "is never called"
            effect = "every epoch replays the same order on every rank"
            if found.main_only:
                never = f"is called only on the main rank (under `{found.main_only}`)"
                effect = ("the other ranks replay the first epoch's order while the main rank moves on, so "
                          "their shards no longer split the dataset between them")
            ctx.report(self, found.module, found.node,
                       f"{subject} set_epoch() {never}: {effect}",
                       "call the sampler's `set_epoch(epoch)` at the start of each epoch (keep the sampler in a "
                       "variable)" if not named else f"call `{found.name}.set_epoch(epoch)` at the start of each epoch",
                       autofix=lambda found=found: plan_more.set_epoch(ctx.program, found))
