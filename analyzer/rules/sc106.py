from synccheck.analyzer.rules.base import Rule


class StaticGraphNoSync(Rule):
    code = "SC106"
    name = "static-graph-no-sync"
    severity = "error"
    summary = "DDP(static_graph=True) with no_sync on the very first iteration fails an internal assert"
    requires = ("static_graph", ".backward(")
    what = """
        Finds `DistributedDataParallel(..., static_graph=True)` models whose very first micro-step can
        run with gradient sync off (`no_sync()`, or `require_backward_grad_sync = False`).
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
    """,)
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
    """)

    def check(self, ctx):
        from synccheck.analyzer.project.facts import first_iteration_off

        for flow in ctx.flows:
            for site, model, by in first_iteration_off(flow):
                module, node = ctx.node(flow, by)
                ctx.report(self, module, node,
                           f"`{ctx.model_name(model)}` has static_graph=True and this turns sync off on the very "
                           f"first micro-step: DDP's reducer fails an internal assert (pytorch#143580)",
                           "let iteration 0 sync, or drop static_graph=True")
