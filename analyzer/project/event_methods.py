"""Stage 6 of the pipeline (sync dataflow), events part 3: library calls and methods that are events.

Whatever their receiver's class: ``backward`` (a loss's, ``scaler.scale(loss)``'s, an Accelerator's,
Fabric's, a DeepSpeed engine's), ``step`` and ``zero_grad`` of optimizers and scalers, ``no_sync`` /
``accumulate`` / ``no_backward_sync`` contexts being made, ``set_requires_gradient_sync``, an
``ExitStack``'s ``enter_context``, tensor methods that keep or divide a loss, collectives; and the
library functions that are events (``torch.autograd.backward``, ``torch.distributed.all_reduce``,
``nullcontext``, ``functools.partial``, timm's ``NativeScaler``).
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import EnvVal
from synccheck.analyzer.project.value_helpers import _class_attrs, a_sequence
from synccheck.analyzer.project.values import (ONE_UNKNOWN, Accumulator, Bag, Const, Ext, Framework, Inner, Inst, Obj,
                                               Optim, Scaler, Unknown, Wrapper, site_of)


_NO_MODEL = "no model: a list"      # what a control names when it names no wrapper (an empty set names any)
_RUNS_FIRST_ARG = frozenset(("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential",
                             "deepspeed.checkpointing.checkpoint", "torch.func.functional_call"))


def _external(flow, node, qual: str, args, kws, st, fr) -> Optional[EnvVal]:
    last = vocab.tail(qual)
    module = fr.module
    site = site_of(module, node)
    if qual in ("torch.autograd.backward",) and args:
        backward(flow, node, args[0], "torch.autograd.backward", st, fr)
        return NONE_VAL
    if qual in ("torch.div", "torch.divide", "torch.true_divide", "torch.mul", "torch.multiply") and args and \
            (args[0].prov or args[0].scaled is not None):
        return _val(ONE_UNKNOWN, args[0].prov, True)      # ``torch.div(loss, accum)``: as ``loss / accum``
    if qual.startswith("torch.distributed.") and last in vocab.COLLECTIVES:
        collective(flow, node, last, st, fr)
        return None
    if last in ("nullcontext",) or qual in ("contextlib.suppress",):
        return _val(frozenset((FlowCtx("null", frozenset(), site),)))
    if last == "ExitStack":
        return _val(frozenset((FlowCtx("exitstack", frozenset(), site),)))
    if qual in ("functools.partial", "partial") and args:
        key = id(node)
        flow.partial_calls[key] = node
        target = node.args[0] if node.args else None
        if isinstance(target, ast.Attribute) and target.attr == "set_requires_gradient_sync":
            # ``partial(model.set_requires_gradient_sync, recurse=True)``: FSDP2's switch, set when called
            receiver = expr(flow, target.value, st, fr)
            flow.partials[key] = (frozenset((SyncSetter(_fsdp2(flow.program.wrappers(receiver.values))),)),
                                  tuple(args[1:]), dict(kws))
        else:
            flow.partials[key] = (args[0].values, tuple(args[1:]), dict(kws))
        return _val(frozenset((FlowPartial(key),)))
    if qual in vocab.NO_GRAD:
        return _val(frozenset((FlowCtx("nograd", frozenset(), site),)))
    if qual in ("torch.compile", "torch.nn.SyncBatchNorm.convert_sync_batchnorm") and args:
        return args[0]
    if qual in _RUNS_FIRST_ARG and args:
        # ``checkpoint(model, x)``: activation checkpointing calls the model it is given
        models = flow.program.wrappers(args[0].values)
        if models:
            return forward(flow, node, models, args[1:], kws, st, fr)
    if last in vocab.GRAD_SYNC:
        collective(flow, node, last, st, fr)
        return None
    return None


def _native_scaler(flow, node, args, kws, st, fr) -> EnvVal:
    """timm's ``loss_scaler(loss, optimizer, ..., need_update=...)``: backward, then step when due."""
    loss = args[0] if args else kws.get("loss")
    optimizer = args[1] if len(args) > 1 else kws.get("optimizer")
    if loss is not None:
        backward(flow, node, loss, "loss_scaler", st, fr)
    update = kws.get("need_update") or kws.get("update_grad")
    if optimizer is None:
        return NONE_VAL
    if update is None:
        step(flow, node, optimizer.values, st, fr)
        return NONE_VAL
    true, false = _cond_of(flow, update, next((k.value for k in node.keywords if k.arg in ("need_update", "update_grad")),
                                              None), st, fr)
    stepped = flow.restrict(st.copy(), true)
    if stepped is not None and stepped.props:
        step(flow, node, optimizer.values, stepped, fr)
    skipped = flow.restrict(st.copy(), false)
    joined = flow.join([stepped, skipped])
    st.props = joined.props if joined is not None else {}
    return NONE_VAL


def _project_method(flow, values, name: str) -> bool:
    """Is ``name`` a method the analysis can read on these values (then it is followed, not taken for
    the library's method of that name)?"""
    return any(isinstance(v, Inst) and flow.project.attribute(v.cls, name) is not None for v in values)


def _clears_by_hand(flow, values) -> bool:
    """Does the project class's ``zero_grad`` clear the gradients itself (``p.grad = None``,
    ``p.grad.zero_()``) rather than call an optimizer's?"""
    for v in values:
        if isinstance(v, Inst):
            method = flow.project.attribute(v.cls, "zero_grad")
            if isinstance(method, Function):
                text = method.module.segment(method.node) or ""
                if ".zero_grad(" not in text and any(w in text for w in (".grad = None", ".grad.zero_()",
                                                                           ".grad.data.zero_()")):
                    return True
    return False


def _method(flow, node, attr: str, recv: EnvVal, args, kws, st, fr) -> Optional[EnvVal]:
    """Methods that are events whatever their receiver's class: backward, step, zero_grad, no_sync..."""
    vals = recv.values
    program = flow.program
    site = site_of(fr.module, node)
    frameworks = {v.kind for v in vals if isinstance(v, Framework)}
    project_method = _project_method(flow, vals, attr)
    if attr == "backward" and not project_method:
        if not args and kws.get("loss") is not None:
            args = [kws["loss"]]            # ``booster.backward(loss=loss, optimizer=optimizer)``
        if frameworks and args:
            backward(flow, node, args[0], f"{sorted(frameworks)[0]}.backward", st, fr)
            return NONE_VAL
        engines = [v for v in vals if isinstance(v, Wrapper) and v.kind == "deepspeed"]
        if engines:
            loss = args[0] if args else None
            backward(flow, node, loss, "engine.backward", st, fr, engines=frozenset(engines))
            return NONE_VAL
        if any(isinstance(v, Accumulator) for v in vals) and args:
            backward(flow, node, args[0], "accumulator.backward", st, fr)
            return NONE_VAL
        if any(isinstance(v, (Optim, Framework)) for v in vals) and args:
            backward(flow, node, args[0], "optimizer.backward", st, fr)
            return NONE_VAL
        if args and args[0].prov and not recv.prov and not any(isinstance(v, Wrapper) for v in vals):
            # ``optimizer.backward(loss)`` on a wrapper we cannot see (fairseq's FairseqOptimizer,
            # an apex/fp16 optimizer): the model's output is the argument, not the receiver
            backward(flow, node, args[0], "optimizer.backward", st, fr)
            return NONE_VAL
        how = "scaler.scale(loss).backward" if _scale_call(node.func.value) else "loss.backward"
        if (args or kws.get("gradient") is not None or _surrogate(flow, node.func.value, fr)) and \
                recv.scaled is not True:
            # ``reps.backward(grad)``: not a loss but an output and the gradient to give it (GradCache);
            # whatever scaling there is, is in that gradient. So for ``torch.dot(reps, grad).backward()``
            recv = recv._replace(scaled=None)
        backward(flow, node, recv, how, st, fr)
        return NONE_VAL
    if attr == "manual_backward" and args and not project_method:
        # LightningModule.manual_backward(loss): the backward of manual optimization
        backward(flow, node, args[0], "loss.backward", st, fr)
        return NONE_VAL
    if attr == "step" and not project_method:
        if not args and kws.get("optimizer") is not None:
            args = [kws["optimizer"]]       # ``scaler.step(optimizer=self.optimizer)`` (corenet)
        if any(isinstance(v, Scaler) for v in vals) or (_name(node.func.value).endswith("scaler") and args):
            if args:
                step(flow, node, args[0].values, st, fr)
                return NONE_VAL
        optims = frozenset(v for v in vals if isinstance(v, Optim))
        engines = frozenset(v for v in vals if isinstance(v, Wrapper) and v.kind == "deepspeed")
        if optims or engines:
            step(flow, node, optims | engines, st, fr)
            return NONE_VAL
        if _unknown(vals) and vocab.looks_like_optimizer(_name(node.func.value)):
            step(flow, node, frozenset(), st, fr, unknown=True)
            return NONE_VAL
        return None
    if attr in vocab.SAM_STEPS and not project_method and (_unknown(vals) or any(isinstance(v, Optim) for v in vals)):
        # SAM's ``optimizer.first_step(zero_grad=True)``: the ascent step reads the all-reduced gradients
        # of the first backward (and clears them); ``second_step`` is the update
        step(flow, node, frozenset(v for v in vals if isinstance(v, Optim)), st, fr,
             unknown=not any(isinstance(v, Optim) for v in vals))
        return NONE_VAL
    if attr != "step" and not project_method and vocab.STEPPING_METHOD.match(attr) and not args and _unknown(vals):
        # ``model.optim_step()`` (UPT: the model object owns its optimizer) on an object we cannot
        # follow: a step of an optimizer we do not see
        step(flow, node, frozenset(), st, fr, unknown=True)
        return NONE_VAL
    if attr == "zero_grad" and project_method and _clears_by_hand(flow, vals):
        # an apex-style ``FP16_Optimizer.zero_grad()`` that loops over its groups setting ``p.grad``
        zero_grad(flow, node, frozenset(), st, fr)
        return NONE_VAL
    if attr == "zero_grad" and not project_method:
        unknown = _unknown(vals)
        named_optimizer = vocab.looks_like_optimizer(_name(node.func.value))
        if unknown and not named_optimizer and not _name(node.func.value).endswith("model") and \
                not program.wrappers(vals):
            return None
        zero_grad(flow, node, vals, st, fr, unknown=unknown and named_optimizer)
        return NONE_VAL
    if attr == "no_sync" and not node.args:
        models = program.wrappers(vals)
        if frameworks:
            return None
        built = frozenset(w for v in vals if isinstance(v, (Obj, Inst)) for w in program.wrapping().get(v, ())) \
            if not models else frozenset()
        if built:
            # ``net.no_sync()`` on the module a DDP wrapper was built from: SC104 says what is wrong
            # with it; the micro-steps under it get no verdict of their own (neither "off" nor "on")
            return _val(frozenset((FlowCtx("unknown", built, site, _text(fr, node)),)))
        return _val(frozenset((FlowCtx("off", models, site, _text(fr, node)),)))
    if attr in ("no_sync", "accumulate") and "accelerate" in frameworks:
        return accelerate_control(flow, attr, vals, node, args, fr, site, _text(fr, node))
    if attr == "accumulate" and any(isinstance(v, Accumulator) for v in vals):
        models = frozenset()
        for v in vals:
            if isinstance(v, Accumulator):
                models |= program.wrappers(flow.values.context_models(v))
        return _val(frozenset((FlowCtx("managed", models, site, _text(fr, node)),)))
    if attr == "no_backward_sync" and "fabric" in frameworks:
        models = program.wrappers(args[0].values) if args else frozenset()
        enabled_node = next((k.value for k in node.keywords if k.arg == "enabled"),
                            node.args[1] if len(node.args) > 1 else None)
        enabled = kws.get("enabled") or (args[1] if len(args) > 1 else None)
        guard = _cond_of(flow, enabled, enabled_node, st, fr) if enabled is not None else None
        return _val(frozenset((FlowCtx("off", models, site, _text(fr, node), guard),)))
    if attr in ("disable_allreduce", "enable_allreduce") and not args:
        # apex DDP's switch, read by its backward hooks: off until turned on again (DeepSpeedExamples'
        # ``model.disable_allreduce()`` on the micro-steps, ``enable_allreduce()`` on the boundary)
        models = frozenset(m for m in program.wrappers(vals) if getattr(m, "kind", "") == "apex")
        if models:
            on = attr == "enable_allreduce"
            flag(flow, node, models, (TRUE, 0) if on else (0, TRUE), st, fr)
        return NONE_VAL
    if attr == "set_requires_gradient_sync" and args:
        # FSDP2's switch (and composable replicate's): a DDP or FSDP1 wrapper the same name holds on
        # another path has no such method (tinyworlds' ``if isinstance(model, FSDPModule):`` before it)
        models = _fsdp2(program.wrappers(vals))
        if models:
            flag(flow, node, models, _cond_of(flow, args[0], node.args[0], st, fr), st, fr)
        return NONE_VAL
    if attr == "__enter__" and flow.entering and any(isinstance(v, FlowCtx) for v in vals):
        # ``self._ctx = self.model.no_sync(); self._ctx.__enter__()`` in a context object's __enter__:
        # the control lasts as long as the with that entered the object
        push_controls(flow, node, recv, st, fr, flow.entering[-1], at=fr.control)
        return recv
    if attr == "enter_context" and args:
        owners = [flow.exitstacks.get(v.site) for v in vals if isinstance(v, FlowCtx) and v.effect == "exitstack"]
        owner, at, made_in = next((o for o in owners if o is not None), (None, None, None))
        if made_in is fr.scope:
            # entered where the stack is (``if not sync: stack.enter_context(model.no_sync())``): said
            # here, or at the caller's ``with helper(...)`` of a @contextmanager helper
            at = fr.control
        if owner is None and flow.entering:
            # a context object's ``__enter__`` enters it on a stack of its own: the caller's with owns it
            owner, at = flow.entering[-1], fr.control
        if owner is not None:
            push_controls(flow, node, args[0], st, fr, owner, at=at)
        return args[0]
    if attr == "forward":
        models = program.wrappers(vals)
        if models:
            return forward(flow, node, models, args, kws, st, fr)
    if attr in vocab.SELF_RETURNING and any(isinstance(v, (Wrapper, Obj, Inner, Inst)) for v in vals):
        return recv          # ``model.to(device)`` is ``model``, whatever this path knows it to be
    if attr == "unwrap_model" and frameworks and args:
        return _val(frozenset(Inner(w) if isinstance(w, Wrapper) else w for w in args[0].values))
    if attr in ("detach", "item", "tolist", "cpu", "numpy") and not program.wrappers(vals):
        return _val(ONE_UNKNOWN)
    if attr in ("items", "values") and not args and recv.prov and not program.wrappers(vals):
        # ``outputs.items()`` of a model's output (a dict of losses): its entries come from the forward
        return _val(ONE_UNKNOWN, recv.prov, recv.scaled)
    if attr in vocab.TENSOR_PASSTHROUGH and recv.prov or attr in vocab.TENSOR_CASTS and recv.scaled:
        # (a loss already divided stays divided through ``.float()``, whatever model made it)
        return _val(ONE_UNKNOWN, recv.prov | _prov(*args), recv.scaled)
    if attr in vocab.TENSOR_FUNCTIONS and recv.prov:
        return _val(ONE_UNKNOWN, recv.prov | _prov(*args), False)
    scaled = True
    if attr in ("mul", "mul_", "multiply") and len(args) == 1 and node.args and not isinstance(node.args[0], ast.Starred):
        # ``loss.mul(loss_scaling)``: a weight, as ``loss * loss_scaling`` is (see ``weighted``)
        product = weighted(recv, args[0], node.args[0], flow, fr)
        scaled = True if product is _UNWEIGHTED else product
    if attr in ("div_", "mul_") and args and isinstance(node.func.value, ast.Name) and \
            node.func.value.id in st.env:
        # ``loss.div_(accum)``: the name itself now holds the divided loss
        name = node.func.value.id
        st.env[name] = st.env[name]._replace(scaled=scaled)
    if attr in ("div", "div_", "mul", "mul_", "multiply", "true_divide", "divide") and \
            (recv.prov or recv.scaled is not None):
        return _val(ONE_UNKNOWN, recv.prov, scaled)          # ``loss.div(accum)``, the model's or not
    if attr == "average_parameters" or (attr in vocab.GRAD_SYNC and not project_method):
        collective(flow, node, attr, st, fr)
        return NONE_VAL
    if attr in vocab.FRAMEWORK_COLLECTIVES and frameworks:
        return None
    return None


_COUNT_WORDS = ("accum", "grad_acc", "gradient_acc", "micro", "update_freq", "iters_to_acc", "n_acc", "ga_",
                "num_steps", "n_steps", "batches", "chunks", "splits", "inv", "norm", "scale", "world", "factor")


def scales_by_count(factor) -> bool:
    """Could multiplying a loss by this be the accumulation's division (``loss * (1 / accum)``,
    ``loss * 0.25``, ``loss * self.inv_accum``)? A plain weight (``lambda_coeff``, ``alpha``) or an fp16 loss
    scale is not."""
    if isinstance(factor, ast.Constant):
        return True
    if isinstance(factor, ast.BinOp) and isinstance(factor.op, ast.Div):
        return True
    text = ast.unparse(factor).lower()
    if "loss_scale" in text:
        return False          # fp16 loss scaling (``loss * 2 ** lg_loss_scale``), undone before the step
    return any(w in text for w in _COUNT_WORDS)


_UNWEIGHTED = object()


_GRAD_NAME = re.compile(r"(?:^|[._])(?:\w+_)?grads?$")     # grad, q_grads, reps.grad (not grad_accum)
_PRODUCTS = ("dot", "vdot", "inner", "mul", "einsum", "tensordot")


def _surrogate(flow, node, fr, depth: int = 0) -> bool:
    """``torch.dot(reps.flatten(), grad.flatten())``, ``(reps * cached_grads).sum()``: a product with a
    gradient kept from an earlier backward (GradCache's surrogate), not a loss; followed through the
    function's own assignments to the name that is differentiated."""
    if isinstance(node, ast.Name) and depth < 3:
        scope = fr.scope
        assigns = flow.values.info(scope).assigns.get(node.id, ()) if hasattr(scope, "node") else ()
        return any(not path and _surrogate(flow, value, fr, depth + 1) for value, path in assigns)
    for sub in ast.walk(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult):
            operands = (sub.left, sub.right)
        elif isinstance(sub, ast.Call) and _name(sub.func) in _PRODUCTS:
            operands = tuple(sub.args)
        else:
            continue
        if any(_GRAD_NAME.search(_dotted(o) or "") for a in operands for o in ast.walk(a)
               if isinstance(o, (ast.Name, ast.Attribute))):
            return True
    return False


def weighted(loss, factor, factor_node, flow=None, fr=None):
    """``loss * factor`` where the factor is a plain weight (``lambda_coeff``, an fp16 loss scale),
    not the accumulation's 1/N: the product is as scaled as the loss was. ``_UNWEIGHTED`` when this is
    not such a product (``loss`` is no loss, or the factor is one too, or it may divide by the count).
    With the flow, a factor's own binding is read too (``self.loss_scale = 1.0 / accum``)."""
    is_loss = bool(loss.prov) or loss.scaled is not None
    if is_loss and not factor.prov and (count_of_examples(factor_node) or
                                        flow is not None and _bound_to_a_batch_size(flow, factor_node, fr)):
        # ``F.cross_entropy(logits, y) * y.numel()``: a mean times its count is a sum over the
        # examples (VoiceStar), whose micro-steps add up to the batch's; no 1/N is missing
        return True
    # (a call's result that no forward made, ``weights.get(name, 1.0)``, is a plain weight: read as
    # "undivided" only because it is fresh)
    factor_is_loss = bool(factor.prov) or factor.scaled is True
    if is_loss and not factor_is_loss and not scales_by_count(factor_node) and \
            not (flow is not None and _bound_to_a_fraction(flow, factor_node, fr)):
        return loss.scaled
    return _UNWEIGHTED


_EXAMPLE_COUNT = re.compile(r"(?:^|_)(?:n_?tok(?:en)?s?|num_tok(?:en)?s|tok(?:en)?_count|n_?samples|num_samples|"
                            r"sample_size|n_?items)$", re.I)


def count_of_examples(node) -> bool:
    """``y.numel()``, ``mask.sum()``, ``ntokens``, ``sample_size``: how many examples (tokens) a mean was over."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numel":
        return True
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return bool(_EXAMPLE_COUNT.search(name))


def _bound_to_a_batch_size(flow, node, fr) -> bool:
    """Is the name bound, in this function, only to a tensor's leading size (``bs = tobj.shape[0]``,
    ``n = x.size(0)``)? yolov5's ``return (lbox + lobj + lcls) * bs``: a mean times the batch size."""
    scope = fr.scope
    if not isinstance(node, ast.Name) or not hasattr(scope, "node"):
        return False
    bound = flow.values.info(scope).assigns.get(node.id, ())
    return bool(bound) and all(_leading_size(v) if not path else path == (0,) and _shape_of(v) for v, path in bound)


def _shape_of(value) -> bool:
    """``x.shape``, ``x.shape[:2]``, ``x.size()``: a tensor's sizes from the first (unpacked)."""
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Slice) and value.slice.lower is None:
        value = value.value
    return isinstance(value, ast.Attribute) and value.attr == "shape" or isinstance(value, ast.Call) and \
        isinstance(value.func, ast.Attribute) and value.func.attr == "size" and not value.args


def _leading_size(value) -> bool:
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Attribute) and value.value.attr == "shape":
        return isinstance(value.slice, ast.Constant) and value.slice.value == 0
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "size" and \
        len(value.args) == 1 and isinstance(value.args[0], ast.Constant) and value.args[0].value == 0


def _bound_to_a_fraction(flow, node, fr) -> bool:
    """Is the name or ``self`` attribute bound to a division (``1.0 / accum``) where it is set?"""
    scope = fr.scope
    if isinstance(node, ast.Name) and hasattr(scope, "node"):
        values = [value for value, path in flow.values.info(scope).assigns.get(node.id, ()) if not path]
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and getattr(scope, "cls", None) \
            is not None and scope.params and node.value.id == scope.params[0]:
        values = [value for klass in flow.project.mro(scope.cls)
                  for _, value, path in _class_attrs(flow.values, klass).get(node.attr, ()) if not path]
    else:
        return False
    return any(isinstance(v, ast.BinOp) and isinstance(v.op, ast.Div) and share_of_a_count(v) for v in values)


def share_of_a_count(division: ast.BinOp) -> bool:
    """``1.0 / accum``, ``x / num_accumulation_rounds``: a constant over anything, or anything over a name
    that says it counts (scales_by_count), the 1/N an accumulation divides by."""
    return isinstance(division.left, ast.Constant) or scales_by_count(division.right)


def _scale_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "scale"


def _unknown(vals) -> bool:
    """Nothing known about the receiver of a method call. ``None`` and containers (an optimizer-in-
    backward path keeps ``self._optimizer = None`` or a dict of them) cannot be the receiver of
    ``.step()``: the path where it is one of those does not run it."""
    return all(isinstance(v, (Unknown, Obj, Ext)) or _not_a_receiver(v) for v in vals)


def _not_a_receiver(v) -> bool:
    return (isinstance(v, Const) and v.value is None) or isinstance(v, Bag)


def _name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr.lower()
    if isinstance(node, ast.Name):
        return node.id.lower()
    if isinstance(node, ast.Subscript):
        inner = node.slice
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str) and \
                vocab.looks_like_optimizer(inner.value.lower()):
            return inner.value.lower()
        return _name(node.value)     # ``self.optimizers["model"]``: one of the optimizers
    return ""


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
from synccheck.analyzer.project.events import (NONE_VAL, FlowCtx, FlowPartial, SyncSetter, _cond_of, _prov, _text, _val,
                                               expr)
from synccheck.analyzer.project.micro_step import backward, collective, flag, forward, step, zero_grad
from synccheck.analyzer.project.sync_control import push_controls


def accelerate_control(flow, attr: str, vals, node, args, fr, site, how: str) -> EnvVal:
    """``accelerator.accumulate(...)`` / ``accelerator.no_sync(model)`` called (``vals``: the accelerator),
    directly or through its method kept in an attribute (``self.scope = self.accelerator.accumulate``,
    then ``self.scope(self.model)``: event_calls._stored_factory): the control on the models named."""
    # ``accelerator.accumulate(generator, discriminator)``: every model named (no_sync takes one)
    models = frozenset()
    named = list(zip(node.args, args)) if attr == "accumulate" else list(zip(node.args, args))[:1]
    # ``accelerator.accumulate([model, loss_module])``: a list is no model; accelerate's
    # ``no_sync(list)`` falls back to a nullcontext, so nothing it holds skips the all-reduce
    # (accumulate still moves accelerate's step counter: a prepared optimizer steps at the boundary)
    # (``models_to_accumulate = [transformer]`` passed by its name, diffusers' LoRA scripts, is the same)
    named = [(n, a) for n, a in named if not a_sequence(flow.values, fr.scope, n)]
    if args and not named:
        models = frozenset((_NO_MODEL,))
    for _, a in named:
        models |= flow.program.wrappers(a.values)
    effect = "managed" if attr == "accumulate" else "off"
    # the accelerator whose micro-step counter ``accumulate()`` moves, when it was given a
    # gradient_accumulation_steps (each call counts a micro-step: see sync_control.push_controls)
    counted = [v.site for v in vals if isinstance(v, Framework) and v.kind == "accelerate" and v.accumulates == "yes"]
    counter = counted[0] if attr == "accumulate" and len(counted) == 1 else ()
    return _val(frozenset((FlowCtx(effect, models, site, how, counter=counter),)))


def _fsdp2(models: frozenset) -> frozenset:
    """The wrappers that have ``set_requires_gradient_sync``: FSDP2's (``fully_shard``, ``replicate``)."""
    return frozenset(m for m in models if getattr(m, "kind", "") == "fsdp2")
