from synccheck.analyzer.rules.base import Rule


class UnscaledAccumulatedLoss(Rule):
    code = "SC202"
    name = "unscaled-accumulated-loss"
    severity = "warning"
    summary = "Accumulated loss is not divided by the number of micro-steps"
    requires = (".backward(", "step(")
    loop_anchors = (".backward(",)
    loop_companions = ("step(",)         # a loop that never steps has no boundary to get wrong
    what = """
        Finds plain-PyTorch accumulation loops whose loss reaches `backward()` without being divided
        (or multiplied) on the way. Not reported for `accelerator.backward` (Accelerate divides by
        `gradient_accumulation_steps`) or DeepSpeed engines, which scale the loss themselves.
    """
    why = """
        Gradients of N micro-steps add up. Without dividing each loss by N the optimizer sees N times
        the gradient of one batch: with SGD that is an N-times larger learning rate, and the result
        no longer matches training on the large batch (the article in References divides each loss by
        its accumulation steps for exactly this).
    """
    use_instead = """
        Divide the loss by the number of micro-steps in the window, or use
        `synccheck.runtime.GradientAccumulator`, whose `backward()` divides by the real window size
        (a partial last window included).
    """
    references = ("Multiple GPU training in PyTorch and Gradient Accumulation as an alternative to it (Towards Data Science, 2023): https://towardsdatascience.com/multiple-gpu-training-in-pytorch-and-gradient-accumulation-as-an-alternative-to-it-e578b3fc5b91",)
    INVALID = ("""
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss.backward()  # SC202
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,)
    VALID = ("""
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss = loss / 4
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        for i, (x, y) in enumerate(loader):
            loss = loss_fn(model(x), y)
            loss /= accum_steps
            scaler.scale(loss).backward()
            if (i + 1) % accum_steps == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    """, """
        def compute_loss(model, batch, accum):
            return model(batch).loss / accum

        for i, batch in enumerate(loader):
            loss = compute_loss(model, batch, 4)
            loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """, """
        from accelerate import Accelerator
        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for i, batch in enumerate(loader):
            accelerator.backward(model(**batch).loss)
            if (i + 1) % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """)

    def check(self, ctx):
        for acc in ctx.loops:
            if not acc.is_accumulating or acc.too_complex:
                continue
            backwards = [b for p in acc.micro_steps(False) for b in p.backwards if not acc.boundary_of(p, b)]
            if not backwards or any(b.state.value == "managed" for b in backwards) or ctx.grads_rescaled(acc):
                continue
            reported = set()
            for b in backwards:
                if b.via not in ("loss.backward", "scaler.scale(loss).backward", "fabric.backward",
                                 "torch.autograd.backward") or b.arg is None or id(b.node) in reported:
                    continue
                if _scaled(ctx.model, b.arg, b.env, 0):
                    continue
                reported.add(id(b.node))
                ctx.report(self, b.node, "this loss reaches backward() undivided while gradients accumulate over "
                                         "several micro-steps: the step applies the sum of N gradients, an N-times "
                                         "larger update than the large-batch training it stands for",
                           "divide the loss by the number of micro-steps (`loss / accum_steps`)")


def _scaled(model, expr, env, depth) -> bool:
    """Is the loss divided or multiplied on its way here? Unknown origins count as scaled."""
    import libcst as cst

    if expr is None or depth > 10:
        return True
    if isinstance(expr, cst.BinaryOperation):
        if isinstance(expr.operator, (cst.Divide, cst.Multiply, cst.FloorDivide)):
            return True
        return _scaled(model, expr.left, env, depth + 1) or _scaled(model, expr.right, env, depth + 1)
    if isinstance(expr, cst.Name):
        bound = env.get(expr.value)
        if bound is None or bound is expr:
            return True     # a parameter or a name from elsewhere: cannot tell
        if isinstance(bound, cst.Name) and bound.value == "__unknown__":
            return True
        return _scaled(model, bound, {k: v for k, v in env.items() if k != expr.value}, depth + 1)
    if isinstance(expr, (cst.Attribute, cst.Subscript)):
        return _scaled(model, expr.value, env, depth + 1)
    if isinstance(expr, cst.Call):
        func = expr.func
        if isinstance(func, cst.Attribute):
            if func.attr.value == "scale" and expr.args:        # scaler.scale(loss)
                return _scaled(model, expr.args[0].value, env, depth + 1)
            if func.attr.value in ("mean", "sum", "float", "double", "half", "to", "squeeze", "clone", "contiguous"):
                return _scaled(model, func.value, env, depth + 1)
        name = getattr(func, "value", None) if isinstance(func, cst.Name) else None
        local = model.defs.get(name) if name else None
        if local is not None:
            return any(_scaled(model, ret, {}, depth + 1) for ret in _returns(local[0]))
        return False        # a loss function's fresh result: unscaled
    return True


def _returns(fdef) -> list:
    from synccheck.analyzer.model import _block, _small_statements
    import libcst as cst
    return [s.value for s in _small_statements(_block(fdef.body)) if isinstance(s, cst.Return) and s.value]
