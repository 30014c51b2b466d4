from synccheck.analyzer.rules.base import Rule


class NoSyncMissesForward(Rule):
    code = "SC102"
    name = "no-sync-misses-forward"
    severity = "warning"
    summary = "A DDP sync control covers the backward but not the forward, so it does nothing"
    requires = (".backward(",)
    words = ("no_sync", "require_backward_grad_sync", "no_backward_sync")
    what = """
        Finds `model.no_sync()` (or `accelerator.no_sync(model)`) wrapped around `backward()` while
        the forward of the same micro-step ran outside it, and `require_backward_grad_sync` set
        *after* the forward. Not reported for FSDP, which reads its switch during backward.
    """
    why = """
        DDP decides whether a backward all-reduces when the *forward* runs (`_pre_forward` prepares
        the reducer for backward only if `require_backward_grad_sync` is true at that moment). A
        `no_sync()` entered after the forward changes nothing: the backward still all-reduces, and
        the accumulation is as slow as without `no_sync` (the Hugging Face Accelerate guide "Gradient
        synchronization" measured 2.13 s per batch against 2 s for no `no_sync` at all, and 0.91 s when
        done right, on two nodes). The documentation of `no_sync` says so.
    """
    use_instead = """
        Put the forward inside the context too, or set the flag before calling the model.
    """
    fix_safety = """
        `--fix` moves the control so it covers the forward: the condition that held the control
        becomes `with (model.no_sync() if <condition> else contextlib.nullcontext()):` around the
        forward and the branch, which keeps the numbers the same (safe). A `require_backward_grad_sync`
        assignment moves above the forward; that fix is unsafe, because the boundary micro-step, which
        did not sync before, now does.
    """
    references = ("PyTorch, `DistributedDataParallel.no_sync`: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync",
                  "Hugging Face Accelerate, Gradient synchronization (its timing table): https://huggingface.co/docs/accelerate/concept_guides/gradient_synchronization#just-how-much-of-a-slowdown-is-there-and-easy-mistakes-you-can-make")
    INVALID = ("""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y) / accum_steps
            if (i + 1) % accum_steps != 0:
                with model.no_sync():  # SC102
                    loss.backward()
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y) / accum_steps
            model.require_backward_grad_sync = (i + 1) % accum_steps == 0  # SC102
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """)
    VALID = ("""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            if (i + 1) % accum_steps != 0:
                with model.no_sync():
                    loss = loss_fn(model(x), y) / accum_steps
                    loss.backward()
            else:
                loss = loss_fn(model(x), y) / accum_steps
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for i, (x, y) in enumerate(loader):
            model.require_backward_grad_sync = (i + 1) % accum_steps == 0
            loss = loss_fn(model(x), y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model)
        for i, (x, y) in enumerate(loader):   # FSDP reads its switch during backward
            loss = loss_fn(model(x), y) / accum_steps
            if (i + 1) % accum_steps != 0:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    """)

    def check(self, ctx):
        from synccheck.analyzer.fix import plan
        from synccheck.analyzer.project.micro_step_facts import missed_forward

        never_skipping = None
        for flow in ctx.flows:
            for by, site, model, kind in missed_forward(flow):
                module, node = ctx.node(flow, by)
                if kind == "control" and model.kind == "accelerate" and ".accumulate(" in ctx.text(module, node):
                    if never_skipping is None:
                        from synccheck.analyzer.project.static import never_skipping_accumulates
                        never_skipping = never_skipping_accumulates(ctx.program)
                    if (module.path, node.lineno) in never_skipping:
                        # an accelerator never told to accumulate syncs every micro-step anyway: the
                        # late context costs nothing (SC105 says what is wrong, where it applies)
                        continue
                autofix = (lambda flow=flow, by=by, site=site, model=model, kind=kind:
                           plan.missed(flow, by, site, model, kind))
                if kind == "flag":
                    ctx.report(self, module, node,
                               "`require_backward_grad_sync` is set after the forward: DDP read the flag when the "
                               "forward ran, so this write only takes effect at the next micro-step. The boundary "
                               "backward runs with the value the previous micro-step left (no sync): its gradients "
                               "are never all-reduced and the ranks diverge, while the micro-step after it syncs "
                               "for nothing", "set the flag before calling the model",
                               autofix=autofix)
                else:
                    how = ctx.text(module, node)
                    how = how.splitlines()[0].rstrip(":").removeprefix("with ").strip() if how else "no_sync()"
                    ctx.report(self, module, node,
                               f"`{how}` is entered after the forward ran: DDP decided at forward time that this "
                               f"backward all-reduces, so the context does nothing and every micro-step still "
                               f"synchronizes", "move the forward (the `model(...)` call) inside the same context",
                               autofix=autofix)
