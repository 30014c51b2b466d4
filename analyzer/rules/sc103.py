import ast
import os

from synccheck.analyzer.rules.base import Rule

FIX = ("let the forward and backward of the micro-step before `optimizer.step()` run with sync on; "
       "`synccheck.runtime.GradientAccumulator` gets the boundary right")


class UnsyncedStep(Rule):
    code = "SC103"
    name = "unsynced-step"
    severity = "error"
    summary = "The optimizer can step on gradients that were never all-reduced: ranks diverge"
    requires = (".backward(", "step(")
    words = ("no_sync", "require_backward_grad_sync", "no_backward_sync", "set_requires_gradient_sync")
    what = """
        Finds accumulation loops where the micro-step right before `optimizer.step()` runs with
        gradient sync off: `no_sync()` around every micro-step, around the boundary one, a sync
        condition that is the inverse of (or off by one from) the step's condition, or, on that
        boundary micro-step, a forward inside `no_sync()` whose backward runs outside it (DDP decides
        at the forward). Also a forward that skips the wrapper (`model.module(x)`, the module a DDP
        wrapper was built around called by its own name, or handed to a helper that runs it): its
        backward all-reduces nothing. So does a wrapper built and thrown away, and a model rebound to
        the module inside its wrapper in the middle of the training loop
        (`model = accelerator.unwrap_model(model)` to save a checkpoint): every later turn trains
        the bare module.
    """
    why = """
        Under `no_sync()` each rank keeps its own local gradients. If the optimizer steps on them,
        every rank applies a different update and the replicas silently drift apart: no error, no
        warning, just a model that is no longer data-parallel (and a checkpoint from rank 0 that does
        not match the others). DDP decides at forward time, so a forward inside `no_sync()` leaves
        its backward un-reduced even when the backward runs outside the context.
    """
    use_instead = """
        Sync exactly on the micro-step whose backward is followed by the optimizer step, using the
        same condition for both.
    """
    fix_safety = """
        `--fix` makes the sync condition the optimizer step's condition (the `if` around `no_sync()`,
        the test of a conditional context, a flag's value, or a conditional around an unconditional
        `no_sync()`). Unsafe: the boundary micro-step now all-reduces, so the weights change (they stop
        diverging across ranks). No fix when the forward and the backward sit in different contexts.
    """
    references = ("PyTorch, `DistributedDataParallel.no_sync`: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync",)
    INVALID = ("""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            with model.no_sync():  # SC103
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            with model.no_sync():
                loss = loss_fn(model(x), y) / accum_steps
            loss.backward()  # SC103
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % accum_steps == 0
            with model.no_sync() if sync else nullcontext():  # SC103
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            if i % accum_steps != 0:
                with model.no_sync():  # SC103
                    loss = loss_fn(model(x), y)
                    loss.backward()
            else:
                loss = loss_fn(model(x), y)
                loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """)
    VALID = ("""
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % accum_steps == 0
            with nullcontext() if sync else model.no_sync():
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            sync_ctx = model.no_sync if (i + 1) % accum_steps != 0 else nullcontext
            with sync_ctx():
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        for i, (x, y) in enumerate(loader):
            model.set_requires_gradient_sync((i + 1) % accum_steps == 0)
            loss = loss_fn(model(x), y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan
        from synccheck.analyzer.project.discarded import discarded_wrappers, unwrapped_in_the_loop
        from synccheck.analyzer.project.micro_step_facts import unsynced_steps

        for found in discarded_wrappers(ctx.program):
            built = f"`{found.helper}(...)` returns the wrapper it builds around `{found.model}`, but it" \
                if found.helper else "the wrapper built here"
            ctx.report(self, found.module, found.node,
                       f"{built} is thrown away: `{found.model}` goes on training unwrapped, so no backward "
                       f"ever all-reduces and the optimizer steps on each rank's own gradients; the replicas "
                       f"silently diverge",
                       f"keep the wrapper and train through it: `{found.model} = {ctx.text(found.module, found.node)}`"
                       if "\n" not in ctx.text(found.module, found.node) else
                       f"keep the wrapper and train through it: `{found.model} = ...(...)`",
                       autofix=lambda: {"reason": "which of the later uses of the model should go through the "
                                                  "wrapper is for you to decide"})

        for found in unwrapped_in_the_loop(ctx.program):
            ctx.report(self, found.module, found.node,
                       f"this rebinds `{found.model}` to the module inside its wrapper in the middle of the training "
                       f"loop: every later forward skips the wrapper, so no backward all-reduces again and the "
                       f"optimizer steps on each rank's own gradients; the replicas silently diverge",
                       f"unwrap into a name of its own (`unwrapped = {ctx.text(found.module, found.node.value)}`) "
                       f"and keep training `{found.model}`")

        for flow in ctx.flows:
            for step_site, token, outcomes, group in unsynced_steps(flow):
                module, node = ctx.node(flow, token.site)
                step_module, step_node = ctx.node(flow, step_site)
                step = ctx.text(step_module, step_node) if step_node is not None else "optimizer.step()"
                autofix = (lambda flow=flow, pop=outcomes, token=token, step_site=step_site:
                           plan.unsynced(flow, pop, token, step_site))
                if token.by in flow.records.bypassed:
                    by_module, by_node = ctx.node(flow, token.by)
                    at_module, at_node = _handed_over(by_module, by_node, module, node)
                    renamed = at_node is by_node and isinstance(getattr(by_node, "func", None), ast.Name)
                    wrapper = ctx.model_name(token.model)
                    what = (f"this forward calls `{by_node.func.id}`, the module a DDP wrapper (`{wrapper}`) was built "
                            f"around, not the wrapper" if renamed else
                            f"this forward calls the module inside the DDP wrapper (`{ctx.control_text(flow, token.by)}`)"
                            if at_node is by_node else
                            f"this hands the module inside the DDP wrapper (`{ctx.text(at_module, at_node)}`) to a "
                            f"function that runs it (`{ctx.control_text(flow, token.by)}`, "
                            f"{os.path.basename(by_module.path)}:{by_node.lineno})")
                    ctx.report(self, at_module or module, at_node or node,
                               f"{what}, so DDP never prepares its reducer: "
                               f"the backward all-reduces nothing and the optimizer steps on each rank's own "
                               f"gradients; ranks silently diverge",
                               f"call the wrapper (`{wrapper}(...)`) for a forward whose gradients must be all-reduced"
                               if renamed else
                               "call the wrapper itself (`model(x)`), not `model.module(x)`, for a forward "
                               "whose gradients must be all-reduced" if at_node is by_node else
                               f"hand over the wrapper itself (`{ctx.text(at_module, at_node).removesuffix('.module')}`): "
                               f"its forward is what makes the backward all-reduce")
                    continue
                if token.forward_outside:
                    how = ctx.control_text(flow, token.by)
                    ctx.report(self, module, node,
                               f"the forward of this micro-step ran inside `{how}` but this backward runs "
                               f"outside it: DDP decides at forward time, so these gradients are never "
                               f"all-reduced and the optimizer steps on each rank's own gradients; ranks "
                               f"silently diverge", FIX, autofix=autofix)
                    continue
                how = ctx.control_text(flow, token.by)
                every = all(t.synced == "off" for t, *_ in outcomes.records)
                if every:
                    detail = f"sync is off on every micro-step, the one before `{step}` included"
                else:
                    when = outcomes.describe(group)
                    detail = (f"sync is still off when `{step}` runs: "
                              f"{'at that micro-step ' + when + ', and there ' if when else 'there '}"
                              f"`{how}` turns it off, so the sync condition does not match the step's condition")
                at_module, at_node = ctx.node(flow, token.by) if token.by is not None else (module, node)
                ctx.report(self, at_module or module, at_node or node,
                           f"{detail}: the optimizer steps on gradients that were never all-reduced, so each "
                           f"rank applies a different update and the replicas silently diverge",
                           FIX, autofix=autofix)
            for site, outer in flow.records.recounted.items():
                module, node = ctx.node(flow, site)
                if node is None:
                    continue
                ctx.report(self, module, node,
                           f"`{ctx.text(module, node)}` runs inside `{ctx.control_text(flow, outer)}` of the same "
                           f"accelerator: each `accumulate()` counts a micro-step, so the counter moves twice per "
                           f"micro-step and the outer call's models stay under no_sync at the step (with 2 "
                           f"accumulation steps, on every micro-step): the optimizer steps on gradients that were "
                           f"never all-reduced and the replicas silently diverge",
                           "name every model in one call: `accelerator.accumulate(unet, text_encoder)`")


def _handed_over(at_module, at_node, module, node) -> tuple:
    """Where the inner module was handed to the function that runs it: ``loss_fn(online_net=self.net.module)``
    in the trainer whose backward this is, when the bypassing call is ``online_net(x)`` on a parameter
    of a function elsewhere (a correct loss helper: the bug is the argument). Else the call itself."""
    from synccheck.analyzer.project.definitions import enclosing_function

    if at_node is None or module is None or node is None:
        return at_module, at_node
    callee = enclosing_function(at_module, at_node)
    func = getattr(at_node, "func", None)
    while isinstance(func, ast.Attribute):
        func = func.value
    if callee is None or not isinstance(func, ast.Name) or func.id not in callee.params:
        return at_module, at_node
    caller = enclosing_function(module, node)
    if caller is None or caller is callee:
        return at_module, at_node
    index = callee.params.index(func.id) - (1 if callee.is_method else 0)
    for call in sorted((n for n in caller.nodes() if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        handed = [k.value for k in call.keywords if k.arg == func.id]
        if 0 <= index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:index + 1]):
            handed.append(call.args[index])
        for arg in handed:
            if isinstance(arg, ast.Attribute) and arg.attr == "module":
                return module, arg
    return at_module, at_node
