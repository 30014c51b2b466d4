from synccheck.analyzer.rules.base import Rule, accumulate_calls_around

FIX = ("run the forward and backward of every micro-step but the last inside `model.no_sync()` "
       "(or use `synccheck.runtime.GradientAccumulator`, or `accelerator.accumulate(model)`)")
# a model Fabric set up: its own context, which a loop's "is accumulating" flag drives
FIX_FABRIC = ("run the forward and backward of every micro-step but the last inside "
              "`fabric.no_backward_sync(model, enabled=is_accumulating)` (or use `synccheck.runtime.GradientAccumulator`)")
# apex's DistributedDataParallel: no no_sync, a switch its backward hooks read
FIX_APEX = ("call `model.disable_allreduce()` before the backward of every micro-step but the last and "
            "`model.enable_allreduce()` before the last (apex's DDP has no `no_sync()`), or wrap the model in "
            "torch's DistributedDataParallel")
# a model accelerate prepared, stepped inside an ``accumulate()`` that does not name it (a GAN's
# ``accumulate(generator)`` with the discriminator trained beside it)
FIX_PREPARED = ("name {name} in the accumulate context too: `accelerator.accumulate(...)` takes several models "
                "(`accelerator.accumulate(generator, discriminator)`)")


class SyncEveryMicrostep(Rule):
    code = "SC101"
    name = "sync-every-microstep"
    severity = "warning"
    summary = "Gradient accumulation all-reduces on every micro-step, not once per optimizer step"
    requires = (".backward(", "step(")
    words = ("DistributedDataParallel", "FullyShardedDataParallel", "fully_shard", ".prepare(", "prepare_model",
             "Fabric", "fabric.setup", "no_sync", "require_backward_grad_sync")
    what = """
        Finds gradient-accumulation loops on a DistributedDataParallel, FSDP, Accelerate or Fabric
        model where the optimizer steps every N micro-batches but nothing turns gradient sync off for
        the N-1 micro-steps in between. Also two backward passes of one DDP model, each after a forward of
        its own, before one optimizer step (a GAN's discriminator on real images, then on fakes): the
        first all-reduce is wasted.
    """
    why = """
        DDP all-reduces every gradient bucket at the end of every backward pass unless the forward of
        that micro-step ran with sync disabled. Accumulating over N micro-batches without `no_sync()`
        therefore does N all-reduces per optimizer step instead of one. The result is numerically the
        same, only slower: the Hugging Face Accelerate guide "Gradient synchronization" measured 2 s
        per batch against 0.91 s on two nodes. The first N-1 all-reduces only add up gradients that
        the last one would have summed anyway.
    """
    use_instead = """
        Disable sync for the forward *and* backward of every micro-step except the one before the
        optimizer step. `synccheck.runtime.GradientAccumulator` does this on DDP, FSDP and a single
        process; with Accelerate use `accelerator.accumulate(model)`.
    """
    fix_safety = """
        `--fix` turns sync off for every micro-step but the boundary, using the loop's own condition
        for the optimizer step: `with (contextlib.nullcontext() if <boundary> else model.no_sync()):`
        around the forward and backward (DDP, FSDP), `model.require_backward_grad_sync = (micro_step ==
        n - 1)` before the forward of an inner micro-step loop (DDP), `model.set_requires_gradient_sync(
        <boundary>)` (FSDP2), `with fabric.no_backward_sync(model, enabled=not <boundary>):` (Fabric).
        These fixes are safe: the boundary all-reduce sums the same gradients the N all-reduces did.
        Where the model is wrapped only on some paths (`if rank != -1: model = DDP(model)`), the
        condition gains `or not hasattr(model, "no_sync")`, so a one-process run of the plain module
        still works; FSDP2 is then not fixed, nor is `DDP(static_graph=True)`, whose first iteration
        must sync (SC106).
        On Accelerate the fix (`with accelerator.accumulate(model):` and `gradient_accumulation_steps=`
        where the Accelerator is built) is unsafe: `accelerator.backward` then divides the loss by that
        count, and Accelerate's own counter decides the boundary. No fix is offered when the boundary
        cannot be read off the code (a condition that calls a function or changes between the forward
        and the step), or when the forward, the backward and the step are not in one function.
    """
    references = ("PyTorch, `DistributedDataParallel.no_sync`: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync",
                  "Hugging Face Accelerate, Gradient synchronization (its timing table): https://huggingface.co/docs/accelerate/concept_guides/gradient_synchronization#just-how-much-of-a-slowdown-is-there-and-easy-mistakes-you-can-make")
    INVALID = ("""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y) / accum_steps
            loss.backward()  # SC101
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        import torch
        model = torch.nn.parallel.DistributedDataParallel(model)
        micro = 0
        while True:
            loss = model(next(batches))
            scaler.scale(loss).backward()  # SC101
            micro += 1
            if micro == accum:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                micro = 0
    """, """
        from accelerate import Accelerator
        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for step, batch in enumerate(loader):
            loss = model(**batch).loss / 4
            accelerator.backward(loss)  # SC101
            if step % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        while True:
            for micro_step in range(grad_accum):
                logits, loss = model(X, Y)
                loss = loss / grad_accum
                X, Y = get_batch()
                loss.backward()  # SC101
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        netD = DDP(discriminator)
        for real in loader:
            netD.zero_grad()
            (-netD(real).mean()).backward()  # SC101
            netD(generator(noise()).detach()).mean().backward()
            optimizer_d.step()
    """)
    VALID = ("""
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % accum_steps == 0 or i == len(loader) - 1
            with nullcontext() if boundary else model.no_sync():
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
            if boundary:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
        for x, y in loader:          # no accumulation: one backward per step, one all-reduce each
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """, """
        for i, (x, y) in enumerate(loader):   # single process: nothing to synchronize
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        import torch.distributed as dist
        for i, (x, y) in enumerate(loader):   # manual all-reduce at the boundary, no DDP
            loss = loss_fn(model(x), y) / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                optimizer.step()
                optimizer.zero_grad()
    """, """
        import deepspeed
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)
        for step, batch in enumerate(loader):   # the engine skips sync off the boundary itself
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan
        from synccheck.analyzer.project.micro_step_facts import repeated_in_one_step, wasted

        for flow in ctx.flows:
            for site, model, later in repeated_in_one_step(flow):
                module, node = ctx.node(flow, site)
                name = ctx.model_name(model)
                name = "the model" if name == "the model" else f"`{name}`"
                later_text = ctx.text(*ctx.node(flow, later)).strip()
                later_text = f" (`{later_text}`)" if later_text and "\n" not in later_text and len(later_text) < 60 else ""
                ctx.report(self, module, node,
                           f"{name} all-reduces its gradients at this backward and again at the next one"
                           f"{later_text} before the optimizer steps once: the first all-reduce is wasted",
                           f"add the losses and call backward once, or run this micro-step's forward and backward "
                           f"under `{name.strip('`') if name != 'the model' else 'model'}.no_sync()`",
                           autofix=lambda: {"reason": "whether to add the losses or skip this sync is for you to decide"})
            for site, model, outcomes, group in wasted(flow):
                module, node = ctx.node(flow, site)
                name = ctx.model_name(model)
                name = "the model" if name == "the model" else f"`{name}`"
                # FSDP / FSDP2 reduce-scatter their gradients rather than all-reduce them
                sharded = getattr(model, "kind", "") in ("fsdp", "fsdp2")
                verb, noun = ("reduce-scatter", "reduce-scatters") if sharded else ("all-reduce", "all-reduces")
                if any(t.synced != "on" for t, *_ in outcomes.records):
                    when = outcomes.describe(group)
                    msg = (f"these micro-steps of {name} {verb} gradients on every backward: no sync control "
                           f"covers them{' (when ' + when + ')' if when else ''}, so N-1 of every N {noun} "
                           f"are wasted")
                else:
                    msg = (f"{name} {noun} gradients on every micro-step of this accumulation loop, though "
                           f"the optimizer steps only every few: N-1 of every N {noun} are wasted")
                accumulate = _inside_accumulate(module, node) if getattr(model, "kind", "") == "accelerate" else None
                if accumulate is not None:
                    if _given_a_list(ctx.program, module, accumulate):
                        continue        # ``accumulate([model, loss_module])``: SC104 says what is wrong
                    ctx.report(self, module, node, msg, FIX_PREPARED.format(name=name),
                               autofix=lambda: {"reason": "which accumulate() context to widen is for you to decide"})
                    continue
                kind = getattr(model, "kind", "")
                fix = FIX_FABRIC if kind == "fabric" else FIX_APEX if kind == "apex" else FIX
                ctx.report(self, module, node, msg, fix,
                           autofix=lambda flow=flow, pop=outcomes, site=site: plan.wasted(flow, pop, site))


def _inside_accumulate(module, node):
    """The ``accelerator.accumulate(...)`` call (that does not name the model) of the ``with`` the
    reported line is in; None if it is in none."""
    if module is None or node is None:
        return None
    calls = accumulate_calls_around(module.tree, node)
    return calls[0] if calls else None


def _given_a_list(program, module, call) -> bool:
    """Is the one argument of ``accumulate(models)`` a list or tuple (written out, or a name its
    function binds only to lists)? accelerate takes the models one by one."""
    from synccheck.analyzer.project.definitions import enclosing_function
    from synccheck.analyzer.project.value_helpers import a_sequence

    return len(call.args) == 1 and not call.keywords and \
        a_sequence(program.values, enclosing_function(module, call) or module, call.args[0])
