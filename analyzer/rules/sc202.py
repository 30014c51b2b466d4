import ast
import re

from synccheck.analyzer.rules.base import Rule


class UnscaledAccumulatedLoss(Rule):
    code = "SC202"
    name = "unscaled-accumulated-loss"
    severity = "warning"
    summary = "Accumulated loss is not divided by the number of micro-steps"
    requires = ("backward(", "step(")  # also manual_backward( (Lightning)
    what = """
        Finds plain-PyTorch accumulation loops whose loss reaches `backward()` without being divided
        (or multiplied) on the way. Not reported for `accelerator.backward` (Accelerate divides by
        `gradient_accumulation_steps`) or DeepSpeed engines, which scale the loss themselves. Nor for
        gradient caching (open_clip's `accum_freq`): the window's outputs are cached without gradient,
        then each micro-batch is re-run and the loss computed over the whole window with its own slot
        of the cache replaced (`torch.cat(cache[:j] + [out] + cache[j + 1:])`); each such loss is the
        window's loss, and the micro-steps' gradients add up to the window's gradient.
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
    fix_safety = """
        `--fix` divides the loss by the count the step's condition uses (`(loss / accum_steps).backward()`).
        Unsafe: the update becomes N times smaller. No fix when the condition does not spell the count.
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
        from synccheck.analyzer.fix import plan_more
        from synccheck.analyzer.project.micro_step_facts import accumulating_backwards

        for flow in ctx.flows:
            if _grads_rescaled(flow):
                continue
            for site, info, model in accumulating_backwards(flow):
                if info.via not in ("loss.backward", "scaler.scale(loss).backward", "fabric.backward",
                                    "torch.autograd.backward", "loss_scaler") or info.scaled is not False:
                    continue
                if info.window:
                    continue      # gradient caching: each micro-step's loss is the whole window's
                if _sums_its_loss(ctx.program, model, info):
                    continue      # the model's forward returns a sum over examples: micro-steps add up to the batch's
                if _random_restarts(info):
                    continue      # ``while r < p: r = rng.random()``: no count of micro-steps to divide by
                if _same_batch_repeats(info):
                    continue      # the sandwich rule: one batch through several subnets, summed on purpose
                ctx.report(self, info.module, info.node,
                           "this loss reaches backward() undivided while gradients accumulate over several "
                           "micro-steps: the step applies the sum of N gradients, an N-times larger update than "
                           "the large-batch training it stands for",
                           "divide the loss by the number of micro-steps (`loss / accum_steps`)",
                           autofix=lambda flow=flow, site=site, info=info: plan_more.unscaled(flow, site, info))


_HOOK_DIVIDES = re.compile(r"buffer\(\)\.div_\(|\.div_\([^)\n]*accum", re.I)
_RESCALE = re.compile(r"(multiply_grads|\.grad\.div_|\.grad\.mul_|scale_grads|grad /=|grad \*=|\.grad\.data\.div_|"
                      r"\.grad\.data\.mul_)(?P<rest>[^\n]*)")


def _enclosing(module, node):
    """The innermost function of ``module`` whose lines hold ``node`` (project/definitions.py's, imported
    only when a finding is checked: the rules stay light to import)."""
    from synccheck.analyzer.project.definitions import enclosing_function
    return enclosing_function(module, node)


def _random_restarts(info) -> bool:
    """Is the backward in a ``while`` loop that goes on by chance (``while r < args.restart_prob: r =
    rng.random()``, DROID-SLAM's random restarts)? Its micro-steps have no count a loss could be divided
    by: they are repeats, not a batch split into N."""
    fn = _enclosing(info.module, info.node)
    if fn is None:
        return False
    line = info.node.lineno
    for loop in ast.walk(fn.node):
        if not (isinstance(loop, ast.While) and loop.lineno < line <= (loop.end_lineno or loop.lineno)):
            continue
        tested = {n.id for n in ast.walk(loop.test) if isinstance(n, ast.Name)}
        for node in ast.walk(loop):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    any(isinstance(t, ast.Name) and t.id in tested for t in node.targets) and \
                    "rand" in ast.unparse(node.value.func).lower():
                return True
    return False


# a call that draws new data inside the loop (``X, Y = get_batch("train")``, ``next(it)``; a GAN's generator
# step draws its micro-batch as noise: ``mixing_noise(chunk, ...)``, ``torch.randn(chunk, dim)``)
_DRAWS = re.compile(r"next\b|batch|load|fetch|data|read|randn|noise", re.I)


def _same_batch_repeats(info) -> bool:
    """Is the backward in a ``for _ in range(k)`` loop that draws no data of its own: the loop variable
    is only compared (``if arch_id == k - 1:``), and nothing in the body draws a batch (AlphaNet's
    sandwich rule: the same images through the largest, the smallest and random subnets, their
    gradients summed by design)? Those backwards are not micro-batches of one large batch."""
    fn = _enclosing(info.module, info.node)
    if fn is None:
        return False
    line = info.node.lineno
    loops = [n for n in ast.walk(fn.node) if isinstance(n, (ast.For, ast.While, ast.AsyncFor)) and
             n.lineno < line <= (n.end_lineno or n.lineno)]
    if not loops:
        return False
    loop = max(loops, key=lambda n: n.lineno)
    if not isinstance(loop, ast.For) or not isinstance(loop.target, ast.Name) or \
            not (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name) and
                 loop.iter.func.id == "range"):
        return False
    from synccheck.analyzer.project.branches import _COUNT_WORDS
    if any(_COUNT_WORDS.search(ast.unparse(a)) for a in loop.iter.args):
        return False        # ``for micro_step in range(gradient_accumulation_steps)``: the micro-steps themselves
    if len(loop.iter.args) == 3:
        return False        # ``for j in range(0, batch, chunk)``: a batch split into chunks
    var = loop.target.id
    compared = {id(n) for c in ast.walk(loop) if isinstance(c, ast.Compare) for n in ast.walk(c)}
    for node in ast.walk(loop):
        if isinstance(node, ast.Name) and node.id == var and id(node) not in compared and node is not loop.target:
            return False
        if isinstance(node, ast.Call) and _DRAWS.search(ast.unparse(node.func)):
            return False
        if isinstance(node, (ast.For, ast.AsyncFor)) and node is not loop:
            return False
    return True


def _mean_times_count(node) -> bool:
    """``F.cross_entropy(logits, y) * y.numel()`` / ``loss * ntokens``: a mean times the number of
    examples it was over, a sum."""
    from synccheck.analyzer.project.event_methods import count_of_examples
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and (
        count_of_examples(node.right) and isinstance(node.left, ast.Call) or
        count_of_examples(node.left) and isinstance(node.right, ast.Call))


def _sums_its_loss(program, model, info) -> bool:
    """Does the forward of the model that made this loss return a loss reduced by sum
    (``return F.cross_entropy(logits, targets, reduction="sum")``)? Its micro-steps' gradients then add
    up to the whole batch's, the convention of a sum loss: no 1/N is missing."""
    from synccheck.analyzer.project.call_kinds import literal_defaults, sum_reduced
    from synccheck.analyzer.project.index import Function
    from synccheck.analyzer.project.value_types import Inst, Obj, Wrapper
    candidates = set()
    if isinstance(model, Wrapper):
        candidates.update(program.values.wrapped_by(model))
    made = _made_by(info)
    if made is not None:
        scope = _enclosing(info.module, made) or info.module
        for v in program.values.expr(made.func, scope):
            candidates.update(program.values.wrapped_by(v) if isinstance(v, Wrapper) else (v,))
    classes = [v.cls for v in candidates if isinstance(v, Inst)]
    for v in candidates:
        if isinstance(v, Obj):
            classes.extend(_made_from_class(program, v.site))
    for cls in classes:
        forward = program.project.attribute(cls, "forward")
        if not isinstance(forward, Function):
            continue
        # (a name given a summed loss, or one added to it: ``total_loss += F.cross_entropy(...,
        # reduction=reduction)`` with ``reduction="sum"`` the default, returned in a tuple: vall-e)
        defaults = literal_defaults(forward.node)
        summed = set()
        nodes = list(ast.walk(forward.node))
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AugAssign)) and (sum_reduced(node.value, defaults) or
                                                                   _mean_times_count(node.value)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                summed.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in nodes:
            if isinstance(node, ast.Return) and node.value is not None:
                parts = node.value.elts if isinstance(node.value, ast.Tuple) else \
                    node.value.values if isinstance(node.value, ast.Dict) else [node.value]
                if any(sum_reduced(p, defaults) or isinstance(p, ast.Name) and p.id in summed for p in parts):
                    return True
    return False


def _made_from_class(program, site) -> list:
    """The project classes an object known by where it was made was built from: ``GPT(...).cuda()``
    (the calls at that place in the code whose callee is a class)."""
    from synccheck.analyzer.project.call_kinds import calls_at
    from synccheck.analyzer.project.value_types import Cls
    out = []
    calls = calls_at(program, site)
    module = program.project.module_at(site[0]) if calls else None
    for node in calls:
        scope = _enclosing(module, node) or module
        out.extend(v.cls for v in program.values.expr(node.func, scope) if isinstance(v, Cls))
    return out


def _made_by(info):
    """The call that made the loss a ``.backward()`` runs on: ``model(x, y).backward()``, or the last
    ``loss = model(x, y)`` of the function before ``loss.backward()``."""
    node = info.node
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"):
        return None
    loss = node.func.value
    if isinstance(loss, ast.Call):
        return loss
    if not isinstance(loss, ast.Name):
        return None
    fn = _enclosing(info.module, node)
    found = None
    for n in ast.walk(fn.node if fn is not None else info.module.tree):
        if isinstance(n, ast.Assign) and n.lineno < node.lineno and isinstance(n.value, ast.Call) and any(
                isinstance(t, ast.Name) and t.id == loss.id for t in n.targets):
            if found is None or n.lineno > found.lineno:
                found = n
    return found.value if found is not None else None


def _grads_rescaled(flow) -> bool:
    """The loop rescales gradients itself before stepping (fairseq's ``optimizer.multiply_grads``).
    Undoing an fp16 loss scale (``p.grad.mul_(1.0 / 2 ** self.lg_loss_scale)``) is not that."""
    texts = []
    root = flow.root
    if hasattr(root, "node"):
        texts.append(root.module.segment(root.node) or "")
    else:       # a script's top level: its statements, not the functions it defines
        texts.extend(root.segment(s) or "" for s in root.script_body())
    # and the functions the loop's events are in (a dead ``scale_grads`` elsewhere in the file is not)
    seen = set()
    for module, node in flow.records.nodes.values():
        fn = _enclosing(module, node)
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            texts.append(module.segment(fn.node) or "")
    if _rescales(texts):
        return True
    # a DDP communication hook that divides each bucket by the micro-steps before the all-reduce
    # (NVIDIA's BERT: ``bucket.set_buffer(bucket.buffer().div_(args.gradient_accumulation_steps))``)
    for module in {id(m): m for m, _ in flow.records.nodes.values() if m is not None}.values():
        if "register_comm_hook" in module.text and _HOOK_DIVIDES.search(module.text):
            return True
    # one call further: a helper of those modules the loop calls (ClassyVision's
    # ``self._rescale_gradients(1 / self.optimizer_period)`` before the step)
    called = {m.group(1) for text in texts for m in _CALLED.finditer(text)}
    modules = {id(m): m for m, _ in flow.records.nodes.values() if m is not None}
    helpers = [m.segment(fn.node) or "" for m in modules.values() for fn in m.functions.values()
               if fn.node.name in called and id(fn) not in seen]
    return _rescales(helpers)


_CALLED = re.compile(r"(?<![\w])(?:self\.)?(\w*grad\w*)\s*\(")


def _rescales(texts) -> bool:
    for text in texts:
        for match in _RESCALE.finditer(text):
            if "loss_scale" not in match.group("rest"):
                return True
    return False
