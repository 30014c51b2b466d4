"""Stage 6 of the pipeline (sync dataflow), events part 2: calls.

A call's arguments are evaluated first, then what the callee may be decides: a data-parallel model
(a forward), a method that is an event (event_methods.py), a project function or class (analysed in
place by ``inline``, inlining.py, with the caller's state and arguments, memoized on that input), a
``@contextmanager`` helper (entered later by the ``with``, sync_control.py), a ``functools.partial``,
or something unknown (its result carries its arguments' provenance). A callee that is one of several
values on different paths is each of them on its own path.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.call_kinds import (_FORWARD_METHOD, _HOUSEKEEPING, _LOSS_METHOD,  # noqa: F401
                                                   FABRIC_REDIRECTED, _inner_wrappers, _submodule, clears_grads, forward_dispatch,
                                                   handed_a_token_count, handed_the_accumulation_count,
                                                   library_training_step, sets_sync_flag, sum_criterion, sum_reduced)
from synccheck.analyzer.project.definitions import Function, called_name
from synccheck.analyzer.project.gradient_cache import _is_no_grad
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import FROZEN, EnvVal
from synccheck.analyzer.project.value_helpers import _class_attrs
from synccheck.analyzer.project.values import (ONE_UNKNOWN, Bound, Cls, Const, CtxFactory, Ext, Framework, Func, Inner,
                                               Inst, NativeScaler, Obj, Optim, Super, Unknown, Wrapper, site_of)


# ---------------------------------------------------------------------------------------------------
# calls

def call(flow, node: ast.Call, st, fr) -> EnvVal:
    func = node.func
    if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2 and \
            isinstance(node.args[1], ast.Constant) and node.args[1].value == "no_sync":
        # ``getattr(model, "no_sync", nullcontext)``: DDP's no_sync where the model is a wrapper
        recv = expr(flow, node.args[0], st, fr)
        factory = FlowFactory("off", flow.program.wrappers(recv.values), site_of(fr.module, node),
                              ast.unparse(node))
        return EnvVal(((TRUE, frozenset((factory,))),), recv.prov, recv.scaled)
    if sets_sync_flag(node):
        recv = expr(flow, node.args[0], st, fr)
        value = expr(flow, node.args[2], st, fr)
        models = _reading_the_flag(flow.program.wrappers(recv.values))
        flag(flow, node, models, _cond_of(flow, value, node.args[2], st, fr), st, fr)
        return _val(ONE_UNKNOWN)
    if isinstance(func, ast.Name) and func.id == "super" and isinstance(fr.scope, Function) and \
            fr.scope.cls is not None and fr.scope.params and len(node.args) in (0, 2):
        # ``super()`` on the instance this method runs on: its class's MRO decides what comes next
        me = st.env.get(fr.scope.params[0])
        mine = me.values if me is not None else flow.values.name(fr.scope.params[0], fr.scope)
        found = frozenset(Super(v, fr.scope.cls) for v in mine if isinstance(v, Inst))
        return _val(found or frozenset((Super(Inst(fr.scope.cls), fr.scope.cls),)))
    recv = expr(flow, func.value, st, fr) if isinstance(func, ast.Attribute) else None
    if isinstance(func, ast.Lambda):
        return _val(ONE_UNKNOWN)
    args = [expr(flow, a, st, fr) for a in node.args]
    kws = {kw.arg: expr(flow, kw.value, st, fr) for kw in node.keywords}
    for kw in node.keywords:
        if kw.arg is None:
            # ``loss_fn(**{"net": model, "x": x})`` / ``kwargs = {...}; loss_fn(**kwargs)``: each entry
            # is a keyword (physicsnemo's corrdiff)
            for key, value in _spread_dict(flow, kw.value, fr):
                kws.setdefault(key, expr(flow, value, st, fr))
    if recv is not None and func.attr == "requires_grad_":
        _freeze(flow, func.value, recv, node, st, fr)
    if recv is not None and func.attr == "step":
        lib = _library_steppers(flow, recv.values)
        if lib:
            # ``optimizer.step()`` where the optimizer is a library's on some paths (``torch.optim.Adam``)
            # and a project class with its own ``step`` on others (GaLore's bitsandbytes subclass): each
            # is a path, as a callee that may be any of several methods is. (The project class's
            # ``step`` alone used to decide the call, and the library optimizers' step was lost.)
            stepped = st.copy()
            micro_step(flow, node, lib, stepped, fr)
            own = recv._replace(alts=tuple((g, vs - lib) for g, vs in recv.alts if vs - lib))
            rest = st.copy()
            result = _call_on(flow, node, func, own, args, kws, rest, fr)
            joined = flow.join([stepped, rest])
            st.props = joined.props if joined is not None else {}
            return result
    result = _call_on(flow, node, func, recv, args, kws, st, fr)
    if sum_reduced(node, _reductions_here(node, fr)) or sum_criterion(flow, func, fr.scope):
        # ``F.cross_entropy(..., reduction="sum")``: a sum over the examples, whose micro-steps add up
        # to the whole batch's sum; no 1/N is missing from it (SC202)
        result = result._replace(scaled=True)
    elif result.scaled is False and handed_a_token_count(node):
        # ``self.loss_fn(pred, labels, global_valid_tokens)``, ``compute_loss(model, inputs,
        # num_items_in_batch=n)``: a loss normalised by the window's token count, counted before the
        # micro-steps (torchtitan, transformers' Trainer): whether 1/N is in it, we cannot tell
        result = result._replace(scaled=None)
    elif result.scaled is False and handed_the_accumulation_count(node) and \
            not flow.program.syntactic_targets(node, fr.scope):
        # ``batch.normalize(loss, n_accumulation=accum)`` on an object we cannot follow: handed the
        # count of micro-steps with the loss, it may divide by it (joeynmt), and is taken to (so
        # ``scaler.scale(...)`` of it is too). A project function we follow says itself whether it
        # does (``forward_loss(model, batch, accum)``)
        result = result._replace(scaled=True)
    return result


def _spread_dict(flow, node, fr) -> list:
    """(key, value expression) of the dict literal a ``**`` argument spells, or the one a name is
    bound to once in this function; only entries read from names (no call is evaluated twice)."""
    node = flow.values.bound_once(node, fr.scope)
    if not isinstance(node, ast.Dict) or len(node.keys) > 64:
        return []
    return [(k.value, v) for k, v in zip(node.keys, node.values)
            if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, (ast.Name, ast.Attribute))]


def _reductions_here(node: ast.Call, fr) -> Optional[dict]:
    """``reduction=reduction``: the enclosing function's literal defaults (``def forward(...,
    reduction="sum")``), for sum_reduced. (What a caller hands in is not read: the flow keeps no
    string constants.)"""
    kw = next((k for k in node.keywords if k.arg == "reduction"), None)
    if kw is None or not isinstance(kw.value, ast.Name) or not isinstance(fr.scope, Function):
        return None
    from synccheck.analyzer.project.call_kinds import literal_defaults
    return literal_defaults(fr.scope.node)


def _project_optimizer_class(flow, recv: EnvVal, attr: str) -> EnvVal:
    """``optimizer.backward(loss)`` on a project class that derives from ``torch.optim.Optimizer`` and
    defines the method itself (llm-pytorch's ``GradientAccumulationOptimizer``, whose ``backward`` runs
    under ``model.no_sync()``): the class's own method is what runs, so the value is that instance."""
    if attr in ("step", "zero_grad"):
        return recv
    from synccheck.analyzer.project.value_frameworks import call_at
    swapped = {}
    for v in recv.values:
        if not isinstance(v, Optim) or v.managed:
            continue
        call = call_at(flow.project, v.site)
        held = flow.values.sites.get(v.site)
        if call is None or held is None:
            continue
        for c in flow.values.expr(call.func, held[1]):
            if isinstance(c, Cls) and isinstance(flow.project.attribute(c.cls, attr), Function):
                swapped[v] = Inst(c.cls)
    if not swapped:
        return recv
    return recv._replace(alts=tuple((g, frozenset(swapped.get(v, v) for v in vals)) for g, vals in recv.alts))


def _freeze(flow, receiver, recv: EnvVal, node: ast.Call, st, fr) -> None:
    """``ddp_g.eval().requires_grad_(False)`` at the start of a phase that trains another model (a GAN's
    discriminator, a score model): from here the wrapper makes no gradient and all-reduces nothing,
    until ``requires_grad_(True)`` (or ``requires_grad_()``) turns it back on."""
    wrappers = flow.program.wrappers(recv.values)
    while not wrappers and isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) and \
            receiver.func.attr in ("train", "eval", "to", "cuda"):
        receiver = receiver.func.value          # (``.eval()`` / ``.train()`` hand back the module)
        wrappers = flow.program.wrappers(expr(flow, receiver, st, fr).values)
    if not wrappers:
        return
    arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "requires_grad"), None)
    if arg is not None and not isinstance(arg, ast.Constant):
        return                                  # (``requires_grad_(train_d)``: not known here)
    known = st.env.get(FROZEN)
    frozen = known.values if known is not None else frozenset()
    frozen = frozen | wrappers if arg is not None and arg.value is False else frozen - wrappers
    st.env[FROZEN] = _val(frozen)


def _library_steppers(flow, vals) -> frozenset:
    """The library optimizers (and DeepSpeed engines) among a ``.step()`` receiver's values, when
    others are project objects with a ``step`` of their own; empty otherwise."""
    if not _project_method(flow, vals, "step"):
        return frozenset()
    return frozenset(v for v in vals if isinstance(v, Optim) or isinstance(v, Wrapper) and v.kind == "deepspeed")


def _call_on(flow, node: ast.Call, func, recv, args, kws, st, fr) -> EnvVal:
    if recv is None and isinstance(func, ast.Name) and "zero_grad" in func.id and args and \
            clears_grads(flow, func, fr.scope):
        # ``zero_grad(model)``: a project helper that sets every parameter's ``.grad`` to None
        zero_grad(flow, node, args[0].values, st, fr)
        return _val(ONE_UNKNOWN)
    if recv is not None and func.attr == "training_step" and args and library_training_step(flow, recv.values):
        # ``tr_loss += self.training_step(model, inputs)`` in a train loop written over transformers'
        # Trainer: the library's training step runs the model's forward and the backward of its loss
        # (divided by gradient_accumulation_steps)
        models = flow.program.wrappers(args[0].values)
        if models:
            loss = forward(flow, node, models, args, kws, st, fr)
            backward(flow, node, loss._replace(scaled=True), "loss.backward", st, fr)
            return _val(ONE_UNKNOWN)
    if recv is not None and any(isinstance(v, Optim) for v in recv.values):
        recv = _project_optimizer_class(flow, recv, func.attr)
    if recv is not None:
        handled = _method(flow, node, func.attr, recv, args, kws, st, fr)
        if handled is not None:
            return handled
        picked = _property_test(flow, func, recv.values, st, fr)
        if picked is not None:
            # ``self.sync_context()`` where the property picks ``self.model.no_sync`` or ``nullcontext``
            callee = picked.values
            if len(picked.alts) > 1 and any(isinstance(v, FlowFactory) for v in callee):
                return _factory_by_alts(flow, node, picked, recv, args, kws, st, fr)
        else:
            callee = flow.values.attribute(recv.values, func.attr, func, fr.scope)
    else:
        lam = _lambda_named(flow, func, fr)
        if lam is not None:
            return _call_lambda(flow, lam, args, kws, st, fr)
        callee_val = expr(flow, func, st, fr)
        callee = callee_val.values
        if len(callee_val.alts) > 1 and flow.program.wrappers(callee):
            return _forward_by_alts(flow, node, callee_val, args, kws, st, fr)
        if len(callee_val.alts) > 1 and any(isinstance(v, FlowFactory) or isinstance(v, FlowPartial) and
                                            _partial_of_factory(flow, v) for v in callee):
            return _factory_by_alts(flow, node, callee_val, recv, args, kws, st, fr)
    wrappers = flow.program.wrappers(callee)
    if wrappers:
        return forward(flow, node, wrappers, args, kws, st, fr)
    inner = _inner_wrappers(callee)
    # (``self.net = load(...)`` then ``self.net = DDP(self.net)`` in ``__init__``: read from another
    # method, ``self.net.module`` also holds what the first store left, unknown)
    if inner and all(isinstance(v, (Inner, Unknown, Ext)) for v in callee):
        return inner_forward(flow, node, inner, args, kws, st, fr)
    if recv is not None and func.attr in FABRIC_REDIRECTED:
        # Fabric sends a LightningModule's ``training_step`` (and its siblings) on the module it set up
        # through the wrapper's forward, so that DDP's hooks run (``_FabricModule``)
        fabric = frozenset(v for v in recv.values if isinstance(v, Wrapper) and v.kind == "fabric")
        if fabric:
            return forward(flow, node, fabric, args, kws, st, fr)
    # ``model.module.train_step(batch, criterion)`` (coqui's Trainer): the module's own training step
    # computes the loss without the wrapper's forward, as ``model.module(x)`` does; so does a call of
    # one of its submodules or of a method that runs them (SAM-Med3D's ``model.module.image_encoder(x)``,
    # ``net.mask_decoder(...)`` with ``net = model.module``), but not a module's housekeeping
    inner = _inner_wrappers(recv.values) if recv is not None else None
    if inner and (_FORWARD_METHOD.search(func.attr) or _submodule(flow, inner, func.attr) or
                  _runs_submodules(flow, inner, func.attr, fr.scope, node)) and \
            not _project_method(flow, recv.values, func.attr):
        return inner_forward(flow, node, inner, args, kws, st, fr)
    if recv is not None and func.attr == "forward" and isinstance(func.value, ast.Attribute):
        # ``model.module.head.forward(h)``: a submodule of the module inside the wrapper, run by hand
        owners = _inner_wrappers(expr(flow, func.value.value, st, fr).values)
        if owners:
            return inner_forward(flow, node, owners, args, kws, st, fr)
    renamed = _wrapped_under_another_name(flow, node, fr) if isinstance(func, ast.Name) else None
    if renamed:
        # ``ddp_model = DDP(model)`` and then ``model(x)``: the forward skips the wrapper
        return inner_forward(flow, node, renamed, args, kws, st, fr)
    targets = [v for v in callee if isinstance(v, (Func, Bound, Cls, Inst, FlowPartial, FlowFactory, Ext, NativeScaler,
                                                    CtxFactory))]
    if not targets and recv is not None and _opaque_object(recv.values) and any(
            flow.program.wrappers(a.values) for a in list(args) + list(kws.values())):
        # ``self.task.train_step(sample, self.model, ...)`` on an object from a registry: the
        # project's one family of classes that defines the method says what it does
        duck = flow.program.duck_method(func.attr, fr.scope, node)
        if duck is not None:
            targets = [duck]
    if len(targets) > MAX_FANOUT and forward_dispatch(flow, targets, args, kws):
        # ``loss = self.forward_propagation(batch, model)`` overridden by a dozen trainer classes
        # (UER-py), none of which steps, runs a backward or controls sync: each runs the model it is
        # handed, so the call is that model's forward
        models = frozenset()
        for a in list(args) + list(kws.values()):
            models |= flow.program.wrappers(a.values)
        result = forward(flow, node, models, args, kws, st, fr)
        # (and what they return is divided where every one of them divides it: ``loss / accum_steps``)
        scaled = {flow.program.returns_scaled(v.fn) for v in targets if not v.fn.abstract}
        return result._replace(scaled=scaled.pop() if len(scaled) == 1 else None)
    if len(targets) > MAX_FANOUT:
        # a dispatch over many classes (``self.scheduler.step(...)`` on any of a library's dozens of
        # schedulers): not a training loop's own code. Reading each would cost more than it could
        # tell; what they return is read from their returns
        return _opaque_dispatch(flow, targets, args, kws, site_of(fr.module, node))
    results = []
    if len(targets) > 1:
        # a base class's hook (``raise NotImplementedError``) never runs where a subclass fills it
        filled = [v for v in targets if not (isinstance(v, (Func, Bound)) and v.fn.abstract)]
        targets = filled or targets
    if len(targets) > 1:
        # the callee may be any of these (a method of the class or of a subclass): each is a path
        outs = []
        for v in sorted(targets, key=repr):
            part = st.copy()
            result = _call_target(flow, node, v, recv, args, kws, part, fr)
            if result is not None:
                results.append(result)
            outs.append(part)
        joined = flow.join(outs)
        st.props = joined.props if joined is not None else {}
        targets = []
    for v in targets:
        result = _call_target(flow, node, v, recv, args, kws, st, fr)
        if result is not None:
            results.append(result)
    if results:
        out = results[0]
        for r in results[1:]:
            out = EnvVal(out.alts + r.alts, out.prov | r.prov, out.scaled if out.scaled == r.scaled else None,
                         out.cond if out.cond == r.cond else None)
        return out
    if (_opaque_object(callee) and not isinstance(func, ast.Call) or
            recv is not None and not targets and _LOSS_METHOD.search(func.attr) and
            (_opaque_object(recv.values) or all(isinstance(v, Unknown) for v in recv.values))) and \
            not _prov(*args, *kws.values()):
        # an object we cannot see into, called with the model and no output of it: it runs the
        # model's forward (``loss = self.imagen(x, unet=self.unet)``, ``loss = criterion(model, batch)``;
        # not a factory's product, ``make_denoiser_wrapper(config)(inner_model)``, which wraps it);
        # so does such an object's method that computes a loss with the model it is handed (DiT's
        # ``diffusion.training_losses(model, x, t)``). Its other methods handed the model
        # (``ema.update(model)``, ``wandb.watch(model)``) do not.
        models = frozenset()
        for a in list(args) + list(kws.values()):
            models |= flow.program.wrappers(a.values)
        if models:
            return forward(flow, node, models, args, kws, st, fr)
    prov = _prov(*args, *kws.values())
    # a call's result is a fresh value (a loss function's output is not divided), unless it was
    # computed from something already divided
    scaled = True if any(a.scaled for a in list(args) + list(kws.values())) else False
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if scaled and called in _FRESH_LOSS:
        # ``F.kl_div(F.log_softmax(student / T, -1), ...)``: logits divided by a temperature are not a
        # loss divided by the micro-steps; a nonlinearity or a loss function makes a fresh value
        scaled = False
    if isinstance(func, ast.Attribute) and func.attr == "scale" and len(args) == 1 and not kws and (
            args[0].scaled is not None or not args[0].prov):
        # ``scaler.scale(loss)``: the loss times the scaler's factor, which the step undoes; divided
        # or not as the loss was, or not known when nothing says where it came from (a parameter of a
        # function nobody in view calls). A model's output of unknown scaling is a fresh loss.
        scaled = args[0].scaled
    return _val(flow.values.expr(node, fr.scope), prov, scaled)


MAX_FANOUT = 8      # targets of one call analysed in place, each as a path


def _opaque_dispatch(flow, targets, args, kws, site) -> EnvVal:
    out = set()
    for v in targets:
        if isinstance(v, (Func, Bound)):
            out |= flow.values.call_returns(v.fn, v.receiver if isinstance(v, Bound) else None, site)
        elif isinstance(v, Cls):
            out.add(Inst(v.cls))
        else:
            out |= ONE_UNKNOWN
    return _val(frozenset(out) or ONE_UNKNOWN, _prov(*args, *kws.values()))


def _opaque_object(callee) -> bool:
    """An object we know only by where it came from (a parameter, an attribute set from one), called
    itself -- not a method of something unknown (``ema.update(model)``) nor a function we can read."""
    return any(isinstance(v, Obj) for v in callee) and \
        all(isinstance(v, (Unknown, Obj)) or (isinstance(v, Const) and v.value is None) for v in callee)


def _forward_by_alts(flow, node, callee: EnvVal, args, kws, st, fr) -> EnvVal:
    """``model(x)`` where ``model`` is a wrapper on some paths only: a forward on those paths. When the
    paths overlap (``model = DDP(model) if args.ddp else model`` under a test the table does not
    model: both alternatives hold everywhere), the values are one may-set: splitting the state would
    make a path where the model is plain and inherits the wrapper's earlier micro-steps."""
    merged: dict = {}
    for formula, vals in callee.alts:
        merged[vals] = merged.get(vals, 0) | formula     # (a loop's joins repeat an alternative)
    alts = [(f, v) for v, f in merged.items()]
    formulas = [f for f, _ in alts]
    if any(formulas[i] & formulas[j] for i in range(len(formulas)) for j in range(i + 1, len(formulas))):
        return forward(flow, node, flow.program.wrappers(callee.values), args, kws, st, fr)
    parts = []
    result = None
    for formula, vals in alts:
        part = flow.restrict(st.copy(), formula)
        if part is None or not part.props:
            continue
        wrappers = flow.program.wrappers(vals)
        if wrappers:
            made = forward(flow, node, wrappers, args, kws, part, fr)
            # (the loss comes from whichever model ran: the provenance of every alternative)
            result = made if result is None else made._replace(prov=result.prov | made.prov)
        parts.append(part)
    joined = flow.join(parts)
    st.props = joined.props if joined is not None else {}
    return result or _val(ONE_UNKNOWN, _prov(*args, *kws.values()), False)


def _factory_by_alts(flow, node, callee: EnvVal, recv, args, kws, st, fr) -> EnvVal:
    """``ctx()`` where ``ctx = model.no_sync if cond else nullcontext``: the sync control on the
    paths where the factory was chosen, whatever the other alternatives make."""
    alts = []
    for formula, vals in callee.alts:
        for v in sorted(vals, key=repr):
            result = _call_target(flow, node, v, recv, args, kws, st, fr) if isinstance(
                v, (FlowFactory, FlowPartial, Ext)) else None
            if result is None:
                alts.append((formula, ONE_UNKNOWN))
                continue
            alts.extend((g & formula, rv) for g, rv in result.alts if g & formula)
    return EnvVal(tuple(alts) or ((TRUE, ONE_UNKNOWN),), _prov(*args, *kws.values()), None, None)


def _partial_of_a_loss_method(flow, key) -> bool:
    """Was the partial made of a method, of an object we cannot see into, whose name says it computes
    a loss (``partial(self.diffusion.training_losses, ...)``)?"""
    made = flow.partial_calls.get(key)
    target = made.args[0] if made is not None and made.args else None
    return isinstance(target, ast.Attribute) and bool(_LOSS_METHOD.search(target.attr)) and \
        all(isinstance(t, Unknown) for t in flow.partials[key][0])


def _stored_factory(flow, node, v, args, fr) -> EnvVal:
    """A sync control's callable kept in an attribute and called later: ``self.scope = self.model.no_sync``
    then ``with self.scope():``, or ``self.scope = self.accelerator.accumulate`` then
    ``with self.scope(self.model):`` (nougat-latex-ocr's trainer, ``nullcontext`` on one GPU)."""
    owner = flow.values.context_models(v)
    accelerators = frozenset(f for f in owner if isinstance(f, Framework) and f.kind == "accelerate")
    if accelerators:
        return accelerate_control(flow, v.how, accelerators, node, args, fr, v.site, v.how + "()")
    return _val(frozenset((FlowCtx(v.effect, flow.program.wrappers(owner), v.site, v.how + "()"),)))


def _partial_of_factory(flow, v) -> bool:
    """A ``functools.partial`` of a sync control's factory (``partial(accelerator.no_sync, model)``)?"""
    return any(isinstance(t, FlowFactory) for t in flow.partials[v.key][0])


def _call_target(flow, node, v, recv, args, kws, st, fr) -> Optional[EnvVal]:
    if isinstance(v, Ext):
        return _external(flow, node, v.qualname, args, kws, st, fr)
    if isinstance(v, FlowFactory):
        return _val(frozenset((FlowCtx(v.effect, v.models, v.site, v.how + "()"),)))
    if isinstance(v, CtxFactory):
        return _stored_factory(flow, node, v, args, fr)
    if isinstance(v, NativeScaler):
        return _native_scaler(flow, node, args, kws, st, fr)
    if isinstance(v, FlowPartial):
        fn_vals, p_args, p_kws = flow.partials[v.key]
        out = None
        for target in fn_vals:
            if isinstance(target, (Func, Bound, Cls, Inst)):
                out = _call_target(flow, node, target, None, list(p_args) + list(args), {**p_kws, **kws}, st, fr)
            elif isinstance(target, SyncSetter) and not p_args and args and node.args:
                # ``set_sync(micro_idx == 0)`` made by ``partial(model.set_requires_gradient_sync, ...)``
                flag(flow, node, target.models, _cond_of(flow, args[0], node.args[0], st, fr), st, fr)
                out = NONE_VAL
            elif isinstance(target, FlowFactory):
                # ``partial(model.no_sync)``, ``partial(accelerator.no_sync, model)``: the control, on the
                # model the partial was given when the factory itself names none
                models = target.models or (flow.program.wrappers(p_args[0].values) if p_args else frozenset())
                out = _val(frozenset((FlowCtx(target.effect, models, target.site, target.how + "()"),)))
        if out is None and _partial_of_a_loss_method(flow, v.key):
            # ``partial(self.diffusion.training_losses, self.ddp_model, micro, t)`` called: as the
            # method called with the model (improved-diffusion's compute_losses)
            every = list(p_args) + list(args) + list(p_kws.values()) + list(kws.values())
            models = frozenset()
            for a in every:
                models |= flow.program.wrappers(a.values)
            if models and not _prov(*every):
                return forward(flow, node, models, list(p_args) + list(args), {**p_kws, **kws}, st, fr)
        return out
    fn, receiver = None, None
    if isinstance(v, Func):
        fn = v.fn
    elif isinstance(v, Bound):
        fn, receiver = v.fn, v.receiver
    elif isinstance(v, Cls):
        made = flow.values.expr(node, fr.scope)
        if any(isinstance(x, (Wrapper, Optim)) for x in made):
            return _val(made)          # a project subclass of DDP or of a torch optimizer
        init = flow.project.attribute(v.cls, "__init__")
        fn, receiver = (init, Inst(v.cls)) if isinstance(init, Function) else (None, None)
        if fn is None:
            return _val(frozenset((Inst(v.cls),)))
    elif isinstance(v, Inst):
        method = flow.project.attribute(v.cls, "__call__")
        if not isinstance(method, Function) and any(b.rpartition(".")[2] == "Module"
                                                     for b in flow.project.external_bases(v.cls)):
            # ``criterion(logits, target)`` on a project ``nn.Module``: its ``forward`` runs
            # (``AccumulationScaledLoss.forward`` returning ``self.base(...) / self.accum_steps``)
            # (only one that divides by a number of micro-steps: a loss module's own means,
            # ``sum(nll) / batch_size``, are not the window's, and its other code is not a micro-step's)
            method = flow.project.attribute(v.cls, "forward")
            if isinstance(method, Function) and (_divides_by_a_count(method) or _held_models(flow, v)):
                # (or a module that holds the DDP model and runs it, NVIDIA's ``ModelAndLoss``:
                # ``self.model = DDP(self.model)`` in its ``distributed()``, ``self.model(data)`` in forward)
                return _call_target(flow, node, Bound(method, v), recv, args, kws, st, fr)
            return None
        if not isinstance(method, Function):
            return None
        fn, receiver = method, v
    if fn is None:
        return None
    if fn.abstract and isinstance(receiver, Inst) and not _prov(*args, *kws.values()):
        # ``outputs = self.compute_forward(batch)`` on a base class whose subclasses fill the hook:
        # with the models the instance holds and none of their outputs, the override runs them
        models = _held_models(flow, receiver)
        if models:
            return forward(flow, node, models, args, kws, st, fr)
    if fn.contextmanager:
        # (one per function: ``backend.get_context_for_microstep_forward(...)`` dispatched over a DDP
        # backend and a single-process one names two helpers at one call)
        key = (id(node), fn.uid)
        flow.helpers[key] = (fn, receiver, args, kws, node)
        return _val(frozenset((FlowHelper(key),)))
    result = inline(flow, fn, node, receiver, args, kws, st, fr)
    if isinstance(v, Cls):
        return _val(frozenset((Inst(v.cls),)))
    if result is not None and not result.scaled and flow.program.scaled_through_items(fn):
        result = result._replace(scaled=True)
    if result is None:
        # not worth following (no event, no model passed in): what it returns, and whether it divides
        # (``def scale(self, loss): return loss``, a no-op scaler: as its argument was)
        prov = _prov(*args, *kws.values())
        handed = _returned_argument(fn, receiver, args, kws)
        return _val(flow.values.call_returns(fn, receiver, site_of(fr.module, node)), prov,
                    handed.scaled if handed is not None else flow.program.returns_scaled(fn))
    return result


def _runs_submodules(flow, wrappers: frozenset, attr: str, scope, node) -> bool:
    """Is ``attr`` a method of the module inside these wrappers, of a project class, that runs its
    submodules (``model.module.encode_images(x)`` calling ``self.encoder(x)``): a forward that bypasses
    the wrapper? (Not housekeeping: ``get_``, ``save``, ``freeze``...) A module built out of view
    stands for the one family of project classes that defines the method (duck.py)."""
    if _HOUSEKEEPING.match(attr):
        return False
    bound = []
    for w in wrappers:
        for v in flow.values.wrapped_by(w):
            if isinstance(v, Inst):
                method = flow.project.attribute(v.cls, attr)
                if isinstance(method, Function):
                    bound.append((method, v.cls))
    if not bound:
        duck = flow.program.duck_method(attr, scope, node)
        if duck is not None:
            bound.append((duck.fn, duck.receiver.cls))
    for method, klass in bound:
        stored = set()
        for k in flow.project.mro(klass):
            stored |= set(_class_attrs(flow.values, k))
        if _calls_submodules(flow, method, klass, stored, 3):
            return True
    return False


def _calls_submodules(flow, method, klass, stored: set, depth: int) -> bool:
    """Does the method call a submodule stored on its instance (``self.model(x_noisy, t)``), itself or
    through the methods of its class it calls (``loss`` -> ``self.p_losses(...)`` -> ``self.model(...)``)?"""
    if not method.params or any(_is_no_grad(d) for d in method.node.decorator_list):
        return False
    me = method.params[0]
    # (not the submodules it runs under ``torch.no_grad()``: a target computed without gradients,
    # OSEDiff's distribution-matching loss, bypasses nothing)
    quiet = {id(n) for w in method.nodes() if isinstance(w, ast.With) and
             any(_is_no_grad(i.context_expr) for i in w.items) for b in w.body for n in ast.walk(b)}
    calls = [n for n in method.nodes() if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
             isinstance(n.func.value, ast.Name) and n.func.value.id == me and id(n) not in quiet]
    if any(n.func.attr in stored for n in calls):
        return True
    if depth <= 1:
        return False
    for n in calls:
        other = flow.project.attribute(klass, n.func.attr)
        if isinstance(other, Function) and other is not method and not _HOUSEKEEPING.match(n.func.attr) and \
                _calls_submodules(flow, other, klass, stored, depth - 1):
            return True
    return False



def _handed_back(node) -> Optional[str]:
    """The name ``return`` gives back as scaled as it came: ``loss``, ``self.scaler.scale(loss)`` (a
    GradScaler's loss scale, which the step undoes), ``loss.float()``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "scale" and len(node.args) == 1 and not node.keywords and \
                isinstance(node.args[0], ast.Name):
            return node.args[0].id
        if node.func.attr in vocab.TENSOR_PASSTHROUGH and isinstance(node.func.value, ast.Name):
            return node.func.value.id
    return None


def _returned_argument(fn, receiver, args, kws) -> Optional[EnvVal]:
    """The argument ``fn`` returns as it was handed (every ``return`` is that parameter, or its loss
    scaled by a GradScaler: R-ESM's ``return self.scaler.scale(loss)``), else None."""
    nodes = fn.nodes()
    returns = [n.value for n in nodes if isinstance(n, ast.Return)]
    handed = [_handed_back(r) for r in returns]
    names = set(handed)
    if len(names) != 1 or None in names:
        return None
    (name,) = names
    if any(isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load) for n in nodes):
        return None         # (``loss = loss / accum; return loss``: not what was handed)
    params = list(fn.params)
    if receiver is not None and fn.is_method and params:
        params = params[1:]
    if name in kws:
        return kws[name]
    if name in params and params.index(name) < len(args):
        return args[params.index(name)]
    return None


_COUNT_DIVISOR = re.compile(r"accum|grad_acc|update_freq|micro|steps|n_acc|num_acc|gas\b|iters", re.I)


def _divides_by_a_count(fn) -> bool:
    """Does a loss module's ``forward`` divide by a number of micro-steps (``/ self.accum_steps``)?"""
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and _COUNT_DIVISOR.search(ast.unparse(n.right))
               for n in ast.walk(fn.node))


def _lambda_named(flow, func, fr) -> Optional[ast.Lambda]:
    """The lambda a name is bound to, once, in the calling scope (``grad_ctx = lambda b: ...``)."""
    if not isinstance(func, ast.Name):
        return None
    bound = flow.values.info(fr.scope).assigns.get(func.id, ())
    if len(bound) == 1 and not bound[0][1] and isinstance(bound[0][0], ast.Lambda):
        return bound[0][0]
    return None


def _call_lambda(flow, lam: ast.Lambda, args, kws, st, fr) -> EnvVal:
    """``grad_ctx(i % accum == 0)``: the lambda's body, its parameters bound to the arguments, in the
    caller's state (``nullcontext() if boundary else model.no_sync()`` then picks by the caller's test)."""
    from synccheck.analyzer.project.syncflow import St
    env = dict(st.env)
    for i, param in enumerate(a.arg for a in lam.args.args):
        if i < len(args):
            env[param] = args[i]
        elif param in kws:
            env[param] = kws[param]
        else:
            env.pop(param, None)
    inner = St(st.props, env)
    out = expr(flow, lam.body, inner, fr)
    st.props = inner.props
    return out


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
# functions whose result is not as divided as their input: nonlinearities and loss functions
_FRESH_LOSS = frozenset(("softmax", "log_softmax", "sigmoid", "logsigmoid", "tanh", "normalize", "exp", "log",
                         "kl_div", "cross_entropy", "nll_loss", "binary_cross_entropy",
                         "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                         "cosine_similarity", "logsumexp"))


def _wrapped_under_another_name(flow, node, fr) -> Optional[frozenset]:
    """The DDP wrapper when ``node`` calls ``model`` after ``ddp_model = DDP(model, ...)`` in the same
    function, ``model`` bound once before it and never after (the tutorial mistake of training the
    module that was wrapped under a new name). Read from the function's own assignments only."""
    scope = fr.scope
    if not isinstance(scope, Function):
        return None
    derived = fr.module.derived
    says = derived.get("says DDP")
    if says is None:
        says = derived["says DDP"] = "DistributedDataParallel" in fr.module.text or "DDP" in fr.module.text
    if not says:
        return None
    name = node.func.id
    info = flow.values.info(scope)
    assigns = info.assigns
    calls = _calls_on_a_name(info)
    # the names of the one module: ``raw_model = model`` (model never bound again), and
    # ``compiled_model = torch.compile(model)``, which DDP may be built around instead
    names = [name]
    own = name              # the name that must not be bound again after the wrapping
    bound = assigns.get(name, ())
    if len(bound) == 1 and not bound[0][1] and isinstance(bound[0][0], ast.Name):
        source = bound[0][0].id
        if source != name and not any(getattr(v, "lineno", 0) > bound[0][0].lineno for v, _ in assigns.get(source, ())):
            names.append(source)
            own = source
    for n in list(names):
        names += [t for t, value in calls.get(n, ()) if called_name(value) == "compile" and t not in names]
    for n in names:
        for target, value in calls.get(n, ()):
            if target in names or not value.lineno < node.lineno <= (scope.node.end_lineno or node.lineno):
                continue
            wrappers = frozenset(w for w in flow.values.expr(value, scope) if isinstance(w, Wrapper) and w.kind == "ddp")
            if not wrappers:
                continue
            # ``model`` itself never rebound after the wrapping (``model = ddp_model`` would be fine);
            # an alias of it may be bound after (``raw_model = model``), to the same module
            if any(getattr(v, "lineno", 0) > value.lineno for v, _ in assigns.get(own, ())):
                return None
            return wrappers
    return None


def _calls_on_a_name(info) -> dict:
    """``name -> [(target, call)]`` for each ``target = f(name, ...)`` of a scope, in the order of its
    assignments; read once per scope."""
    found = info.first_args
    if found is None:
        found = info.first_args = {}
        for target, bound in info.assigns.items():
            for value, path in bound:
                if not path and isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Name):
                    found.setdefault(value.args[0].id, []).append((target, value))
    return found


from synccheck.analyzer.project.events import (NONE_VAL, FlowCtx, _reading_the_flag, FlowFactory, FlowHelper,
                                               FlowPartial, SyncSetter, _cond_of, _property_test, _prov, _val, expr)
from synccheck.analyzer.project.inlining import _held_models, inline
from synccheck.analyzer.project.event_methods import (_external, _method, _native_scaler, _project_method,
                                                      accelerate_control)
from synccheck.analyzer.project.micro_step import (backward, flag, forward, inner_forward, step as micro_step,
                                                   zero_grad)
