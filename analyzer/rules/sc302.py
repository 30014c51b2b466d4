from synccheck.analyzer.rules.base import Rule


class SamplerWithoutSetEpoch(Rule):
    code = "SC302"
    name = "sampler-without-set-epoch"
    severity = "warning"
    summary = "DistributedSampler is iterated over several epochs but set_epoch() is never called"
    requires = ("DistributedSampler",)
    anchors = ("DistributedSampler", "set_epoch", "epoch")
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
        import libcst as cst

        m = ctx.model
        if not m.samplers or not m.epoch_loops or "set_epoch" in m.source:
            return
        for key, call in m.samplers.items():
            shuffle = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
            if isinstance(shuffle, cst.Name) and shuffle.value == "False":
                continue
            ctx.report(self, call, f"`{ctx.model_name(key)}` is a DistributedSampler but set_epoch() is never called: "
                                   f"every epoch replays the same order on every rank",
                       f"call `{ctx.model_name(key)}.set_epoch(epoch)` at the start of each epoch")
