import ast

from synccheck.analyzer.rules.base import Rule


class NoSyncOnUnwrapped(Rule):
    code = "SC104"
    name = "no-sync-on-unwrapped"
    severity = "error"
    summary = "no_sync() is called on the original module, not on the DDP/FSDP wrapper"
    words = ("no_sync", "no_backward_sync", "accumulate(")
    what = """
        Finds `no_sync()` (and `accelerator.no_sync(...)`, `accelerator.accumulate(...)`,
        `fabric.no_backward_sync(...)`) applied to something that is not the data-parallel wrapper:
        `model.module.no_sync()`; the module that was passed to `DistributedDataParallel(...)` /
        `accelerator.prepare(...)` when the wrapper was bound to another name; an object built
        around the wrapper (`model = Denoiser(ddp_model)`, then `accelerator.accumulate(model)`); or
        one list of models handed to `accelerator.accumulate([unet, text_encoder])`.
    """
    why = """
        Only the wrapper knows how to skip the all-reduce. A plain `nn.Module` has no `no_sync`:
        `model.module.no_sync()` raises `AttributeError`, and `accelerator.no_sync(original)` quietly
        falls back to a `nullcontext()`, so every micro-step keeps all-reducing while the code reads
        as if it did not. The same holds for `accelerator.accumulate(original)`, which calls
        `no_sync` on what it is given, and for an alias of the module taken before `prepare()`
        rebound the name (`raw = model; model = accelerator.prepare(model)`).
    """
    use_instead = "Call it on the object returned by the wrapper (`ddp_model.no_sync()`)."
    fix_safety = """
        There is no automatic fix: which object is the wrapper, and where it is visible, is for you to decide.
    """
    INVALID = ("""
        from accelerate import Accelerator

        accelerator = Accelerator()
        ddp_model, dataloader = accelerator.prepare(model, dataloader)
        for index, batch in enumerate(dataloader):
            if index != len(dataloader) - 1:
                with accelerator.no_sync(model):  # SC104
                    accelerator.backward(loss_func(ddp_model(batch)))
            else:
                accelerator.backward(loss_func(ddp_model(batch)))
                optimizer.step()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        with model.module.no_sync():  # SC104
            model(x).sum().backward()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(net)
        with net.no_sync():  # SC104
            ddp(x).sum().backward()
    """, """
        from accelerate import Accelerator

        def train(inner, optimizer, loader):
            accelerator = Accelerator(gradient_accumulation_steps=4)
            inner, optimizer, loader = accelerator.prepare(inner, optimizer, loader)
            model = Denoiser(inner, sigma_data=0.5)
            for batch in loader:
                with accelerator.accumulate(model):  # SC104
                    accelerator.backward(model.loss(batch))
                    optimizer.step()
                    optimizer.zero_grad()
    """, """
        from accelerate import Accelerator

        def train(model, optimizer, loader):
            accelerator = Accelerator(gradient_accumulation_steps=4)
            raw = model
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for batch in loader:
                with accelerator.accumulate(raw):  # SC104
                    accelerator.backward(model(batch).mean())
                    optimizer.step()
                    optimizer.zero_grad()
    """, """
        from accelerate import Accelerator

        def train(transformer, optimizer, loader):
            accelerator = Accelerator(gradient_accumulation_steps=4)
            transformer, optimizer, loader = accelerator.prepare(transformer, optimizer, loader)
            for batch in loader:
                models_to_accumulate = [transformer]
                with accelerator.accumulate(models_to_accumulate):  # SC104
                    accelerator.backward(transformer(batch).mean())
                    optimizer.step()
                    optimizer.zero_grad()
    """)
    VALID = ("""
        from accelerate import Accelerator

        accelerator = Accelerator()
        ddp_model, dataloader = accelerator.prepare(model, dataloader)
        for index, batch in enumerate(dataloader):
            if index != len(dataloader) - 1:
                with accelerator.no_sync(ddp_model):
                    accelerator.backward(loss_func(ddp_model(batch)))
            else:
                accelerator.backward(loss_func(ddp_model(batch)))
                optimizer.step()
    """, """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        with model.no_sync():
            model(x).sum().backward()
    """, """
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=4)
        model = build()
        model, optimizer = accelerator.prepare(model, build_optimizer(model))
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).mean())
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from accelerate import Accelerator

        def train(transformer, optimizer, loader):
            accelerator = Accelerator(gradient_accumulation_steps=4)
            transformer, optimizer, loader = accelerator.prepare(transformer, optimizer, loader)
            for batch in loader:
                models_to_accumulate = [transformer]
                with accelerator.accumulate(*models_to_accumulate):
                    accelerator.backward(transformer(batch).mean())
                    optimizer.step()
                    optimizer.zero_grad()
    """)

    def check(self, ctx):
        from synccheck.analyzer.project.static import no_sync_on_unwrapped

        for found in no_sync_on_unwrapped(ctx.program):
            how, wrapper = found.how, found.wrapper_text
            message, fix = {
                "outer": (f"`{how}` names an object that holds the wrapper `{wrapper}` but is not it: accelerate "
                          f"looks for no_sync() on the object it is given, finds none and falls back to a "
                          f"nullcontext, so every micro-step still all-reduces",
                          f"pass the wrapper itself (`{wrapper}`)"),
                "module": (f"`{how}` names the module inside the wrapper: a plain nn.Module has no no_sync(), so "
                           f"this raises AttributeError (or, through accelerate, silently does nothing and every "
                           f"micro-step still all-reduces)", f"call no_sync() on the wrapper itself (`{wrapper}`)"),
                "list": (f"`{how}` is given one {_noun(found.node)}: accelerate calls no_sync() on each of its "
                         f"arguments, finds none on a {_noun(found.node)} and falls back to a nullcontext, so no "
                         f"model in it skips the all-reduce "
                         f"on any micro-step", f"pass the models themselves: `{_unpacked(found.node)}`")
                if found.kind == "list" else None,
                "original": (f"`{how}` names the original module, not the wrapper `{wrapper}` built from it: "
                             f"nothing skips the all-reduce (accelerate falls back to a nullcontext; a plain "
                             f"module has no no_sync)", f"use `{wrapper}` here"),
            }[found.kind]
            ctx.report(self, found.module, found.node, message, fix)


def _unpacked(call) -> str:
    """``accelerator.accumulate([a, b])`` with the list's models as its arguments: ``accelerator.accumulate(a, b)``,
    ``accelerator.accumulate(*models)``."""
    arg = call.args[0]
    models = ", ".join(ast.unparse(e) for e in arg.elts) if isinstance(arg, (ast.List, ast.Tuple)) \
        else f"*{ast.unparse(arg)}"
    return f"{ast.unparse(call.func)}({models})"


def _noun(call) -> str:
    return "tuple" if isinstance(call.args[0], ast.Tuple) else "list"
