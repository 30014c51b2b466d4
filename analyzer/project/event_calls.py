"""Stage 6 of the pipeline (sync dataflow), events part 2: calls.

A call's arguments are evaluated first, then what the callee may be decides: a data-parallel model
(a forward), a method that is an event (event_methods.py), a project function or class (analysed in
place by ``inline`` with the caller's state and arguments, memoized on that input), a
``@contextmanager`` helper (entered later by the ``with``, sync_control.py), a ``functools.partial``,
or something unknown (its result carries its arguments' provenance). A callee that is one of several
values on different paths is each of them on its own path.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.call_kinds import (FABRIC_REDIRECTED, clears_grads, forward_dispatch,
                                                   handed_a_token_count, library_training_step, sum_criterion,
                                                   sum_reduced)
from synccheck.analyzer.project.definitions import Function, called_name
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import EnvVal
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.value_helpers import _class_attrs
from synccheck.analyzer.project.values import (ONE_UNKNOWN, Bound, Cls, Const, Ext, Func, Inner, Inst, NativeScaler, Obj,
                                               Optim, Super, Unknown, Wrapper, parameter_default, site_of)


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
    if sum_reduced(node) or sum_criterion(flow, func, fr.scope):
        # ``F.cross_entropy(..., reduction="sum")``: a sum over the examples, whose micro-steps add up
        # to the whole batch's sum; no 1/N is missing from it (SC202)
        result = result._replace(scaled=True)
    elif result.scaled is False and handed_a_token_count(node):
        # ``self.loss_fn(pred, labels, global_valid_tokens)``, ``compute_loss(model, inputs,
        # num_items_in_batch=n)``: a loss normalised by the window's token count, counted before the
        # micro-steps (torchtitan, transformers' Trainer): whether 1/N is in it, we cannot tell
        result = result._replace(scaled=None)
    return result


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
    if inner and all(isinstance(v, Inner) for v in callee):
        return inner_forward(flow, node, inner, args, kws, st, fr)
    if recv is not None and func.attr in FABRIC_REDIRECTED:
        # Fabric sends a LightningModule's ``training_step`` (and its siblings) on the module it set up
        # through the wrapper's forward, so that DDP's hooks run (``_FabricModule``)
        fabric = frozenset(v for v in recv.values if isinstance(v, Wrapper) and v.kind == "fabric")
        if fabric:
            return forward(flow, node, fabric, args, kws, st, fr)
    # ``model.module.train_step(batch, criterion)`` (coqui's Trainer): the module's own training step
    # computes the loss without the wrapper's forward, as ``model.module(x)`` does
    inner = _inner_wrappers(recv.values) if recv is not None and _FORWARD_METHOD.search(func.attr) else None
    if inner and not _project_method(flow, recv.values, func.attr):
        return inner_forward(flow, node, inner, args, kws, st, fr)
    targets = [v for v in callee if isinstance(v, (Func, Bound, Cls, Inst, FlowPartial, FlowFactory, Ext, NativeScaler))]
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
    if (_opaque_object(callee) or recv is not None and not targets and _LOSS_METHOD.search(func.attr) and
            (_opaque_object(recv.values) or all(isinstance(v, Unknown) for v in recv.values))) and \
            not _prov(*args, *kws.values()):
        # an object we cannot see into, called with the model and no output of it: it runs the
        # model's forward (``loss = self.imagen(x, unet=self.unet)``, ``loss = criterion(model, batch)``);
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


def _held_models(flow, inst: Inst) -> frozenset:
    """The data-parallel models an instance keeps in its attributes (``self.model``, the values of
    ``self.modules``), whatever class of its MRO stores them."""
    key = ("held", inst.cls.uid)
    if key not in flow.memo:
        flow.memo[key] = frozenset()        # a cycle through the attributes reads as none
        models = set()
        for vals in _attribute_values(flow, inst):
            models |= flow.program.wrappers(vals | flow.values.elements(vals, values_of_dict=True))
        flow.memo[key] = frozenset(models)
    return flow.memo[key]


def _attribute_values(flow, inst: Inst):
    """The values of each attribute an instance has, whatever class of its MRO stores it."""
    attrs = set()
    for klass in flow.project.mro(inst.cls):
        attrs.update(_class_attrs(flow.values, klass))
    for attr in sorted(attrs):
        yield flow.values.instance_attribute(inst, attr)


def _opaque_object(callee) -> bool:
    """An object we know only by where it came from (a parameter, an attribute set from one), called
    itself -- not a method of something unknown (``ema.update(model)``) nor a function we can read."""
    return any(isinstance(v, Obj) for v in callee) and \
        all(isinstance(v, (Unknown, Obj)) or (isinstance(v, Const) and v.value is None) for v in callee)


def _forward_by_alts(flow, node, callee: EnvVal, args, kws, st, fr) -> EnvVal:
    """``model(x)`` where ``model`` is a wrapper on some paths only: a forward on those paths."""
    parts = []
    result = None
    for formula, vals in callee.alts:
        part = flow.restrict(st.copy(), formula)
        if part is None or not part.props:
            continue
        wrappers = flow.program.wrappers(vals)
        if wrappers:
            result = forward(flow, node, wrappers, args, kws, part, fr)
        parts.append(part)
    joined = flow.join(parts)
    st.props = joined.props if joined is not None else {}
    return result or _val(ONE_UNKNOWN, _prov(*args, *kws.values()), False)


def _literal_default(node, name: str):
    """The default of parameter ``name`` when it is a literal (True, 0, None, "x"), else None."""
    value = parameter_default(node, name)
    return value if isinstance(value, ast.Constant) else None


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


def _partial_of_factory(flow, v) -> bool:
    """A ``functools.partial`` of a sync control's factory (``partial(accelerator.no_sync, model)``)?"""
    return any(isinstance(t, FlowFactory) for t in flow.partials[v.key][0])


def _call_target(flow, node, v, recv, args, kws, st, fr) -> Optional[EnvVal]:
    if isinstance(v, Ext):
        return _external(flow, node, v.qualname, args, kws, st, fr)
    if isinstance(v, FlowFactory):
        return _val(frozenset((FlowCtx(v.effect, v.models, v.site, v.how + "()"),)))
    if isinstance(v, NativeScaler):
        return _native_scaler(flow, node, args, kws, st, fr)
    if isinstance(v, FlowPartial):
        fn_vals, p_args, p_kws = flow.partials[v.key]
        out = None
        for target in fn_vals:
            if isinstance(target, (Func, Bound, Cls, Inst)):
                out = _call_target(flow, node, target, None, list(p_args) + list(args), {**p_kws, **kws}, st, fr)
            elif isinstance(target, FlowFactory):
                # ``partial(model.no_sync)``, ``partial(accelerator.no_sync, model)``: the control, on the
                # model the partial was given when the factory itself names none
                models = target.models or (flow.program.wrappers(p_args[0].values) if p_args else frozenset())
                out = _val(frozenset((FlowCtx(target.effect, models, target.site, target.how + "()"),)))
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
        key = id(node)
        flow.helpers[key] = (fn, receiver, args, kws, node)
        return _val(frozenset((FlowHelper(key),)))
    result = inline(flow, fn, node, receiver, args, kws, st, fr)
    if isinstance(v, Cls):
        return _val(frozenset((Inst(v.cls),)))
    if result is None:
        # not worth following (no event, no model passed in): what it returns, and whether it divides
        prov = _prov(*args, *kws.values())
        return _val(flow.values.call_returns(fn, receiver, site_of(fr.module, node)), prov,
                    flow.program.returns_scaled(fn))
    return result


def inline(flow, fn: Function, node, receiver, args, kws, st, fr, yield_handler=None,
           control=None, seed=None) -> Optional[EnvVal]:
    """Analyse ``fn`` in place with the caller's state; None when it cannot matter or cannot be followed.
    ``seed``: values the callee starts with beyond its parameters (``self.model`` of a context object)."""
    if fn.abstract:
        return None         # a hook that subclasses fill: the base's raise is not what runs
    carries = any(a.prov or flow.program.wrappers(a.values)
                  for a in list(args) + list(kws.values()) + list((seed or {}).values()))
    if yield_handler is None and (fn.uid in fr.stack or fr.depth >= 8 or flow.values.info(fn).has_yield):
        return None
    if yield_handler is None and not carries and not _worth_inlining(flow, fn, receiver, args, kws):
        return None
    env = dict(seed or {})
    params = list(fn.params)
    positional = list(args)
    if receiver is not None and fn.is_method and params:
        env[params[0]] = _val(frozenset((receiver,)), version=("arg", id(node), 0))._replace(
            origin=origin_of(node.func.value, st) if isinstance(node.func, ast.Attribute) else None)
        params = params[1:]
    kwonly = {a.arg for a in fn.node.args.kwonlyargs}
    kw_nodes = {kw.arg: kw.value for kw in node.keywords if kw.arg is not None}
    for i, name in enumerate(params):
        source = None
        if name in kws:
            value = kws[name]
            source = kw_nodes.get(name)
        elif i < len(positional) and name not in kwonly and not any(isinstance(a, ast.Starred) for a in node.args[:i + 1]):
            value = positional[i]
            source = node.args[i] if i < len(node.args) else None
        elif not node.keywords or all(k.arg is not None for k in node.keywords):
            # not passed: a literal default is what the callee sees (``update_grad=True``)
            default = _literal_default(fn.node, name)
            if default is None or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            value = expr(flow, default, st, fr)
        else:
            continue
        origin = value.origin
        if origin is None and source is not None and type(source) in _COPIES:
            origin = origin_of(source, st)
        env[name] = value._replace(version=("arg", id(node), i), origin=origin)
    key = None
    if yield_handler is None:
        key = (fn.uid, tuple(sorted((k, _freeze(v)) for k, v in env.items())), frozenset(st.props.items()), fr.no_grad > 0)
        hit = flow.memo.get(key)
        if hit is not None:
            st.props = dict(hit[0])
            return hit[1]
    from synccheck.analyzer.project.syncflow import Frame, St
    frame = Frame(fn, fr.depth + 1, fr.stack + (fn.uid,), fr.no_grad)
    if fn.parent is not None and fn.parent is fr.scope:
        # a closure called where it is defined sees the caller's loop counters: ``i < len(samples)``
        # in fairseq's ``maybe_no_sync()`` is a test of the enclosing ``for i, sample in ...``
        frame.loops = list(fr.loops)
    frame.yield_handler = yield_handler
    # a flag a @contextmanager helper writes is the caller's ``with helper(...)``: reported there
    frame.control = control or fr.control
    if any(called_name(d) in ("no_grad", "inference_mode") for d in fn.node.decorator_list):
        frame.no_grad += 1
    flow.call_stack.append((fr.module, node))
    try:
        out = flow.block(fn.node.body, St(dict(st.props), env), frame)
    finally:
        flow.call_stack.pop()
    ends = flow.join([out] + frame.returns)
    props = ends.props if ends is not None else {}
    if frame.ret_vals:
        rets = frame.ret_vals
        if len(rets) > 1:
            # ``if enabled: return model.no_sync()`` / ``return nullcontext()``: each value holds on the
            # paths that return it (the caller's ``with`` then turns sync off where ``enabled`` holds)
            rets = [_on_paths(r, returned) for r, returned in zip(rets, frame.returns)]
        result = rets[0]
        for r in rets[1:]:
            result = EnvVal(result.alts + tuple(a for a in r.alts if a not in result.alts), result.prov | r.prov,
                            True if (result.scaled or r.scaled) else result.scaled,
                            result.cond if result.cond == r.cond else None)
    else:
        result = NONE_VAL
    st.props = dict(props)
    if key is not None:
        flow.memo[key] = (props, result)
    return result


_CALLABLE = (Func, Bound, Cls, Inst, Inner, Obj)


def _worth_inlining(flow, fn: Function, receiver, args, kws) -> bool:
    """Can analysing ``fn`` in place change what happens to gradients? It runs an event (a backward,
    a step, a sync control) through the calls it makes; or it calls a value that may be a model or a
    callback, and it was handed one (a callable argument, an instance that holds data-parallel models
    or callables). A library function that only calls its own objects (a pipeline's ``__call__``, a
    VAE's tiled encode) cannot: its body is not walked, what it returns is read from its returns."""
    words = flow.program.fn_words(fn)
    if words - flow.program.CALLS_ONLY:
        return True
    if _returns_a_test(fn) or _returns_a_sync_control(fn):
        return True
    if "call" not in words:
        return False
    if fn.parent is not None:
        return True                         # a closure: it may call the caller's model
    for a in list(args) + list(kws.values()):
        if any(isinstance(v, _CALLABLE) or isinstance(v, FlowPartial) for v in a.values):
            return True
    return isinstance(receiver, Inst) and _holds_callables(flow, receiver)


def _inner_wrappers(values) -> frozenset:
    """The DDP / accelerate wrappers whose inner module (``model.module``) is among these values."""
    return frozenset(v.wrapper for v in values if isinstance(v, Inner) and v.wrapper.kind in ("ddp", "accelerate"))


# methods that compute a loss from the model they are handed
_LOSS_METHOD = re.compile(r"loss|^forward|^compute_|^p_losses$|^run_model$")
# methods of a model that run its forward (not ``parameters``, ``state_dict``, ``eval``, ``to``)
# (not a hook or an optimizer's: ``model.on_before_optimizer_step(optimizer)``, ``scheduler_step``)
_FORWARD_METHOD = re.compile(r"^(?!on_|before_|after_)(?:forward\w*|train_step|training_step|compute_loss|"
                             r"(?!\w*(?:optimizer|optim|scheduler|lr|ema|zero_grad)_step$)\w*_step)$")


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


def _on_paths(value: EnvVal, st) -> EnvVal:
    """``value`` restricted to the paths that reach state ``st`` (the guards of its properties)."""
    if st is None or not st.props:
        return value
    reach = 0
    for guard in st.props.values():
        reach |= guard
    alts = tuple((g & reach, v) for g, v in value.alts if g & reach)
    return value._replace(alts=alts) if alts else value


def _returns_a_sync_control(fn: Function) -> bool:
    """``return self.model.no_sync if self.accumulating else nullcontext``: a sync control (or its
    factory) picked by a test the caller's state decides (walked, the test is the caller's)."""
    ret = fn.only_return
    return ret is not None and any(isinstance(n, ast.Attribute) and n.attr in _SYNC_ATTRS for n in walk(ret))


_SYNC_ATTRS = ("no_sync", "no_backward_sync")


def _returns_a_test(fn: Function) -> bool:
    """``def _is_boundary(self): return (self.micro_step + 1) % self.accum == 0``: a predicate whose
    test the caller branches on (walked, it is a condition the step's gate is made of)."""
    return isinstance(fn.only_return, (ast.Compare, ast.BoolOp, ast.UnaryOp))


def _holds_callables(flow, inst: Inst) -> bool:
    """Does an instance keep a data-parallel model, or a function or object of ours it may call
    (``self.loss_fn = compute_loss``), in its attributes?"""
    key = ("holds", inst.cls.uid)
    if key not in flow.memo:
        flow.memo[key] = True               # (a cycle through the attributes reads as holding one)
        found = bool(_held_models(flow, inst))
        if not found:
            for vals in _attribute_values(flow, inst):
                if any(isinstance(v, (Func, Bound, Inner, FlowPartial)) or isinstance(v, Inst) and
                       _runs_events(flow, v) for v in vals):
                    found = True
                    break
        flow.memo[key] = found
    return flow.memo[key]


def _runs_events(flow, inst: Inst) -> bool:
    """Does calling this instance (its ``__call__``, or a module's ``forward``) run an event?"""
    for name in ("__call__", "forward"):
        method = flow.project.attribute(inst.cls, name)
        if isinstance(method, Function):
            return bool(flow.program.fn_words(method) - flow.program.CALLS_ONLY)
    return False


def _freeze(value: EnvVal):
    return (value.alts, value.prov, value.scaled, value.cond, value.origin)


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
from synccheck.analyzer.project.events import (_COPIES, NONE_VAL, FlowCtx, FlowFactory, FlowHelper, FlowPartial,
                                               _property_test,
                                               _prov, _val, expr)
from synccheck.analyzer.project.state import origin_of
from synccheck.analyzer.project.event_methods import _external, _method, _native_scaler, _project_method
from synccheck.analyzer.project.micro_step import backward, forward, inner_forward, step as micro_step, zero_grad
