"""What each expression does to gradient synchronization, and what it evaluates to.

Expressions are evaluated in order (arguments before the call that takes them). Calls are the events:
a forward of a data-parallel model (DDP decides here whether the next backward all-reduces), a
backward (``loss.backward()``, ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``,
``fabric.backward``, a DeepSpeed engine's), an optimizer step or ``zero_grad``, a sync flag write,
a sync context being made (``model.no_sync()``, ``accelerator.accumulate(model)``, an ``ExitStack``'s
``enter_context``), a collective that syncs gradients by hand. A call into a project function is
analysed in place (syncflow's summaries); anything else leaves the state alone and passes the
provenance of its arguments on (a loss computed from a model's output is that model's loss).
"""
from __future__ import annotations

import ast
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.state import (PLAIN, Control, EnvVal, Forward, Token, sync_state,
                                              with_flag)
from synccheck.analyzer.project.values import (ONE_UNKNOWN, Accumulator, Bag, Bound, Cls, Const, CtxFactory,
                                               Ext, Framework, Func, Inner, Inst, NativeScaler, Obj, Optim,
                                               Scaler, Tup, Unknown, Wrapper, parameter_default, site_of)
from synccheck.analyzer.parse import dotted as _dotted


class FlowCtx(NamedTuple):
    """A sync context as the flow sees it, with the models it names resolved in this context."""
    effect: str                  # off | managed | null | exitstack | unknown
    models: frozenset
    site: tuple
    how: str = ""
    enabled: Optional[tuple] = None      # fabric's enabled=: (true, false) guards


class FlowFactory(NamedTuple):
    effect: str
    models: frozenset
    site: tuple
    how: str = ""


class FlowHelper(NamedTuple):
    """A call of a project ``@contextmanager``: entered by running the generator around the body."""
    key: int


class FlowPartial(NamedTuple):
    key: int


NONE_VAL = EnvVal(((TRUE, frozenset((Const(None),))),))
HARMLESS_CONTEXTS = ("torch.", "contextlib.", "nullcontext", "open", "tqdm", "warnings.", "autocast", "record_function",
                     "profile", "Timer", "timer", "amp.", "accelerate.", "main_process_first", "local_main_process_first",
                     "logging", "wandb", "mlflow", "tempfile", "zipfile", "tarfile", "sdpa_kernel", "sdp_kernel")


def _val(vals, prov=frozenset(), scaled=None, cond=None, version=0) -> EnvVal:
    return EnvVal(((TRUE, vals),), prov, scaled, cond, version)


def _prov(*vals) -> frozenset:
    out = frozenset()
    for v in vals:
        if v is not None:
            out |= v.prov
    return out


# ---------------------------------------------------------------------------------------------------
# expressions

def expr(flow, node, st, fr) -> EnvVal:
    t = type(node)
    if node is None:
        return NONE_VAL
    if t is ast.Name:
        known = st.env.get(node.id)
        if known is not None:
            return known
        return _val(flow.values.name(node.id, fr.scope, node.lineno))
    if t is ast.Attribute:
        dotted = _dotted(node)
        if dotted is not None and dotted in st.env:
            return st.env[dotted]
        recv = expr(flow, node.value, st, fr)
        vals = flow.values.attribute(recv.values, node.attr, node, fr.scope)
        if node.attr == "no_sync" and not any(isinstance(v, Inst) and flow.project.attribute(v.cls, "no_sync")
                                              is not None for v in recv.values):
            vals = frozenset(v for v in vals if not isinstance(v, CtxFactory)) | {
                FlowFactory("off", flow.program.wrappers(recv.values), site_of(fr.module, node), _text(fr, node))}
        version = st.env[dotted].version if dotted in st.env else 0
        return EnvVal(((TRUE, vals),), recv.prov, recv.scaled, None, version)
    if t is ast.Call:
        return call(flow, node, st, fr)
    if t is ast.BinOp:
        left, right = expr(flow, node.left, st, fr), expr(flow, node.right, st, fr)
        left_loss = bool(left.prov) or left.scaled is not None
        right_loss = bool(right.prov) or right.scaled is not None
        if isinstance(node.op, ast.Mult) and left_loss != right_loss and \
                not scales_by_count(node.right if left_loss else node.left):
            # ``lambda_coeff * loss``: a weight between losses, not the accumulation's 1/N
            scaled = left.scaled if left_loss else right.scaled
        elif isinstance(node.op, (ast.Div, ast.Mult, ast.FloorDiv)):
            scaled = True
        else:
            scaled = True if (left.scaled or right.scaled) else (
                None if (left.scaled is None and not left.prov) and (right.scaled is None and not right.prov) else
                False if (left.prov or right.prov) else None)
        return _val(ONE_UNKNOWN, left.prov | right.prov, scaled)
    if t is ast.IfExp:
        body, orelse = expr(flow, node.body, st, fr), expr(flow, node.orelse, st, fr)
        syncish = any(isinstance(v, (FlowCtx, FlowFactory, FlowHelper, Const)) for v in body.values | orelse.values)
        true, false = flow.conds.cond(node.test, st, fr, syncish or bool(fr.loops))
        alts = tuple((g & true, v) for g, v in body.alts if g & true) + \
            tuple((g & false, v) for g, v in orelse.alts if g & false)
        cond = None
        if body.cond is not None and orelse.cond is not None:
            cond = ((true & body.cond[0]) | (false & orelse.cond[0]), (true & body.cond[1]) | (false & orelse.cond[1]))
        else:
            bc, oc = _const_cond(body), _const_cond(orelse)
            if bc is not None and oc is not None:
                cond = ((true & bc[0]) | (false & oc[0]), (true & bc[1]) | (false & oc[1]))
        return EnvVal(alts or ((TRUE, ONE_UNKNOWN),), body.prov | orelse.prov,
                      True if (body.scaled or orelse.scaled) else body.scaled, cond)
    if t in (ast.Compare, ast.BoolOp) or (t is ast.UnaryOp and isinstance(node.op, ast.Not)):
        if fr.loops or fr.depth:
            true, false = flow.conds.cond(node, st, fr, True)
            return _val(ONE_UNKNOWN, cond=(true, false))
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.expr) and any(isinstance(n, ast.Call) for n in ast.walk(sub)):
                expr(flow, sub, st, fr)
        return _val(ONE_UNKNOWN)
    if t in (ast.Tuple, ast.List):
        items = [expr(flow, e, st, fr) for e in node.elts]
        return _val(frozenset((Tup(tuple(i.values for i in items)),)), _prov(*items))
    if t is ast.Subscript:
        recv = expr(flow, node.value, st, fr)
        expr(flow, node.slice, st, fr)
        vals = flow.values.expr(node, fr.scope) if isinstance(node.slice, ast.Constant) else ONE_UNKNOWN
        index = node.slice.value if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int) \
            else None
        picked = set()
        for v in recv.values:
            if isinstance(v, Tup):
                if index is not None and -len(v.items) <= index < len(v.items):
                    picked |= v.items[index]
                elif index is None and type(node.slice) is not ast.Slice:
                    picked.update(x for part in v.items for x in part)
            elif isinstance(v, Bag) and type(node.slice) is not ast.Slice:
                picked |= v.item(node.slice.value if isinstance(node.slice, ast.Constant) else None)
        vals = frozenset(picked) or vals
        return _val(vals, recv.prov, recv.scaled)
    if t is ast.Constant:
        return _val(frozenset((Const(node.value),)) if isinstance(node.value, (bool, int, type(None))) else ONE_UNKNOWN)
    if t is ast.NamedExpr:
        value = expr(flow, node.value, st, fr)
        assign(flow, node.target, value, node, st, fr)
        return value
    if t in (ast.Starred, ast.Await):
        return expr(flow, node.value, st, fr)
    if t is ast.Lambda:
        return _val(ONE_UNKNOWN)
    if t is ast.UnaryOp:
        inner = expr(flow, node.operand, st, fr)
        return _val(ONE_UNKNOWN, inner.prov, inner.scaled)
    # comprehensions, dicts, f-strings, ...: their calls still happen; provenance is the union
    prov = frozenset()
    for sub in ast.iter_child_nodes(node):
        if isinstance(sub, ast.expr):
            prov |= expr(flow, sub, st, fr).prov
        elif isinstance(sub, ast.comprehension):
            prov |= expr(flow, sub.iter, st, fr).prov
            for cond in sub.ifs:
                expr(flow, cond, st, fr)
    return _val(ONE_UNKNOWN, prov)


def _const_cond(value: EnvVal):
    vals = value.values
    if len(vals) == 1:
        (v,) = tuple(vals)
        if isinstance(v, Const) and isinstance(v.value, bool):
            return (TRUE, 0) if v.value else (0, TRUE)
    return None


def assign(flow, target, value: EnvVal, stmt, st, fr, version=None) -> None:
    version = version if version is not None else id(stmt)
    t = type(target)
    if t is ast.Name:
        st.env[target.id] = value._replace(version=version)
    elif t in (ast.Tuple, ast.List):
        for i, el in enumerate(target.elts):
            if isinstance(el, ast.Starred):
                assign(flow, el.value, _val(ONE_UNKNOWN, value.prov), stmt, st, fr, version)
                continue
            picked = frozenset()
            for v in value.values:
                if isinstance(v, Tup) and i < len(v.items):
                    picked |= v.items[i]
            assign(flow, el, _val(picked or ONE_UNKNOWN, value.prov, value.scaled), stmt, st, fr, version)
    elif t is ast.Attribute:
        if target.attr == "require_backward_grad_sync":
            recv = expr(flow, target.value, st, fr)
            models = flow.program.wrappers(recv.values)
            value_node = getattr(stmt, "value", None)
            flag(flow, stmt, models, _cond_of(flow, value, value_node, st, fr), st, fr)
            return
        dotted = _dotted(target)
        if dotted is not None:
            st.env[dotted] = value._replace(version=version)


def _cond_of(flow, value: EnvVal, node, st, fr) -> tuple:
    if value.cond is not None:
        return value.cond
    const = _const_cond(value)
    if const is not None:
        return const
    if node is not None:
        return flow.conds.literal(node, st, fr)
    return (TRUE, TRUE)


# ---------------------------------------------------------------------------------------------------
# calls

def call(flow, node: ast.Call, st, fr) -> EnvVal:
    func = node.func
    recv = expr(flow, func.value, st, fr) if isinstance(func, ast.Attribute) else None
    if isinstance(func, ast.Lambda):
        return _val(ONE_UNKNOWN)
    args = [expr(flow, a, st, fr) for a in node.args]
    kws = {kw.arg: expr(flow, kw.value, st, fr) for kw in node.keywords}
    if recv is not None:
        handled = _method(flow, node, func.attr, recv, args, kws, st, fr)
        if handled is not None:
            return handled
        callee = flow.values.attribute(recv.values, func.attr, func, fr.scope)
    else:
        callee_val = expr(flow, func, st, fr)
        callee = callee_val.values
        if len(callee_val.alts) > 1 and flow.program.wrappers(callee):
            return _forward_by_alts(flow, node, callee_val, args, kws, st, fr)
        if len(callee_val.alts) > 1 and any(isinstance(v, FlowFactory) for v in callee):
            return _factory_by_alts(flow, node, callee_val, recv, args, kws, st, fr)
    wrappers = flow.program.wrappers(callee)
    if wrappers:
        return forward(flow, node, wrappers, args, kws, st, fr)
    targets = [v for v in callee if isinstance(v, (Func, Bound, Cls, Inst, FlowPartial, FlowFactory, Ext, NativeScaler))]
    results = []
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
    prov = _prov(*args, *kws.values())
    # a call's result is a fresh value (a loss function's output is not divided), unless it was
    # computed from something already divided
    scaled = True if any(a.scaled for a in list(args) + list(kws.values())) else False
    return _val(flow.values.expr(node, fr.scope), prov, scaled)


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
                v, (FlowFactory, Ext)) else None
            if result is None:
                alts.append((formula, ONE_UNKNOWN))
                continue
            alts.extend((g & formula, rv) for g, rv in result.alts if g & formula)
    return EnvVal(tuple(alts) or ((TRUE, ONE_UNKNOWN),), _prov(*args, *kws.values()), None, None)


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
        return _val(flow.values.returns(fn), prov, flow.program.returns_scaled(fn))
    return result


def inline(flow, fn: Function, node, receiver, args, kws, st, fr, yield_handler=None,
           control=None) -> Optional[EnvVal]:
    """Analyse ``fn`` in place with the caller's state; None when it cannot matter or cannot be followed."""
    carries = any(a.prov or flow.program.wrappers(a.values) for a in list(args) + list(kws.values()))
    if yield_handler is None and (fn.uid in fr.stack or fr.depth >= 8 or flow.values.info(fn).has_yield):
        return None
    if yield_handler is None and not (flow.program.has_events(fn) or carries):
        return None
    env = {}
    params = list(fn.params)
    positional = list(args)
    if receiver is not None and fn.is_method and params:
        env[params[0]] = _val(frozenset((receiver,)), version=("arg", id(node), 0))
        params = params[1:]
    kwonly = {a.arg for a in fn.node.args.kwonlyargs}
    for i, name in enumerate(params):
        if name in kws:
            value = kws[name]
        elif i < len(positional) and name not in kwonly and not any(isinstance(a, ast.Starred) for a in node.args[:i + 1]):
            value = positional[i]
        elif not node.keywords or all(k.arg is not None for k in node.keywords):
            # not passed: a literal default is what the callee sees (``update_grad=True``)
            default = _literal_default(fn.node, name)
            if default is None or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            value = expr(flow, default, st, fr)
        else:
            continue
        env[name] = value._replace(version=("arg", id(node), i))
    key = None
    if yield_handler is None:
        key = (fn.uid, tuple(sorted((k, _freeze(v)) for k, v in env.items())), frozenset(st.props.items()), fr.no_grad > 0)
        hit = flow.memo.get(key)
        if hit is not None:
            st.props = dict(hit[0])
            return hit[1]
    from synccheck.analyzer.project.syncflow import Frame, St
    frame = Frame(fn, fr.depth + 1, fr.stack + (fn.uid,), fr.no_grad)
    frame.yield_handler = yield_handler
    # a flag a @contextmanager helper writes is the caller's ``with helper(...)``: reported there
    frame.control = control or fr.control
    if any(_deco(d) in ("no_grad", "inference_mode") for d in fn.node.decorator_list):
        frame.no_grad += 1
    flow.call_stack.append((fr.module, node))
    try:
        out = flow.block(fn.node.body, St(dict(st.props), env), frame)
    finally:
        flow.call_stack.pop()
    ends = flow.join([out] + frame.returns)
    props = ends.props if ends is not None else {}
    if frame.ret_vals:
        result = frame.ret_vals[0]
        for r in frame.ret_vals[1:]:
            result = EnvVal(result.alts + tuple(a for a in r.alts if a not in result.alts), result.prov | r.prov,
                            True if (result.scaled or r.scaled) else result.scaled,
                            result.cond if result.cond == r.cond else None)
    else:
        result = NONE_VAL
    st.props = dict(props)
    if key is not None:
        flow.memo[key] = (props, result)
    return result


def _freeze(value: EnvVal):
    return (value.alts, value.prov, value.scaled, value.cond)


def _external(flow, node, qual: str, args, kws, st, fr) -> Optional[EnvVal]:
    last = vocab.tail(qual)
    module = fr.module
    site = site_of(module, node)
    if qual in ("torch.autograd.backward",) and args:
        backward(flow, node, args[0], "torch.autograd.backward", st, fr)
        return NONE_VAL
    if qual.startswith("torch.distributed.") and last in vocab.COLLECTIVES:
        collective(flow, node, last, st, fr)
        return None
    if last in ("nullcontext",) or qual in ("contextlib.suppress",):
        return _val(frozenset((FlowCtx("null", frozenset(), site),)))
    if last == "ExitStack":
        return _val(frozenset((FlowCtx("exitstack", frozenset(), site),)))
    if qual in ("functools.partial", "partial") and args:
        key = id(node)
        flow.partials[key] = (args[0].values, tuple(args[1:]), dict(kws))
        return _val(frozenset((FlowPartial(key),)))
    if qual in vocab.NO_GRAD:
        return _val(frozenset((FlowCtx("nograd", frozenset(), site),)))
    if qual in ("torch.compile", "torch.nn.SyncBatchNorm.convert_sync_batchnorm") and args:
        return args[0]
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


def _method(flow, node, attr: str, recv: EnvVal, args, kws, st, fr) -> Optional[EnvVal]:
    """Methods that are events whatever their receiver's class: backward, step, zero_grad, no_sync..."""
    vals = recv.values
    program = flow.program
    site = site_of(fr.module, node)
    frameworks = {v.kind for v in vals if isinstance(v, Framework)}
    project_method = any(isinstance(v, Inst) and flow.project.attribute(v.cls, attr) is not None for v in vals)
    if attr == "backward" and not project_method:
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
        how = "scaler.scale(loss).backward" if _scale_call(node.func.value) else "loss.backward"
        backward(flow, node, recv, how, st, fr)
        return NONE_VAL
    if attr == "step" and not project_method:
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
            step(flow, node, frozenset(), st, fr)
            return NONE_VAL
        return None
    if attr == "zero_grad" and not project_method:
        if _unknown(vals) and not vocab.looks_like_optimizer(_name(node.func.value)) and \
                not _name(node.func.value).endswith("model"):
            return None
        zero_grad(flow, node, vals, st, fr)
        return NONE_VAL
    if attr == "no_sync" and not node.args:
        models = program.wrappers(vals)
        if frameworks:
            return None
        return _val(frozenset((FlowCtx("off", models, site, _text(fr, node)),)))
    if attr in ("no_sync", "accumulate") and "accelerate" in frameworks:
        models = program.wrappers(args[0].values) if args else frozenset()
        effect = "managed" if attr == "accumulate" else "off"
        return _val(frozenset((FlowCtx(effect, models, site, _text(fr, node)),)))
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
    if attr == "set_requires_gradient_sync" and args:
        models = program.wrappers(vals)
        flag(flow, node, models, _cond_of(flow, args[0], node.args[0], st, fr), st, fr)
        return NONE_VAL
    if attr == "enter_context" and args:
        owners = [flow.exitstacks.get(v.site) for v in vals if isinstance(v, FlowCtx) and v.effect == "exitstack"]
        owner = next((o for o in owners if o is not None), None)
        if owner is not None:
            push_controls(flow, node, args[0], st, fr, owner)
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
    if attr in vocab.TENSOR_PASSTHROUGH and recv.prov:
        return _val(ONE_UNKNOWN, recv.prov | _prov(*args), recv.scaled)
    if attr in ("div", "div_", "mul", "mul_", "true_divide") and recv.prov:
        return _val(ONE_UNKNOWN, recv.prov, True)
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
    ``loss * 0.25``, ``loss * self.inv_accum``)? A plain weight (``lambda_coeff``, ``alpha``) is not."""
    if isinstance(factor, ast.Constant):
        return True
    if isinstance(factor, ast.BinOp) and isinstance(factor.op, ast.Div):
        return True
    text = ast.unparse(factor).lower()
    return any(w in text for w in _COUNT_WORDS)


def _scale_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "scale"


def _unknown(vals) -> bool:
    return all(isinstance(v, (Unknown, Obj, Ext)) for v in vals)


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


def _deco(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _text(fr, node) -> str:
    return (fr.module.segment(node) or ast.unparse(node)).strip()


# ---------------------------------------------------------------------------------------------------
# transfers

def _each(st, fn) -> None:
    """Apply a property transfer to every (property, guard) of the state."""
    out: dict = {}
    for prop, guard in st.props.items():
        for p2, g2 in fn(prop, guard):
            if g2:
                out[p2] = out.get(p2, 0) | g2
    st.props = out


def forward(flow, node, models: frozenset, args, kws, st, fr) -> EnvVal:
    prov = models | _prov(*args, *kws.values())
    if fr.no_grad:
        return _val(ONE_UNKNOWN)
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    managed = flow.program.managed_models()

    def transfer(prop, guard):
        forwards = [f for f in prop.forwards if f.model not in models]
        for model in sorted(models, key=repr):
            if model.kind == "deepspeed":
                decided, by = "managed", None
            else:
                decided, by = sync_state(prop, model, managed)
            forwards.append(Forward(model, decided, by, site))
            flow.records.forward(site, model, decided, by, prop.first, guard)
        yield prop._replace(forwards=tuple(forwards)), guard

    _each(st, transfer)
    return _val(ONE_UNKNOWN, prov, False)


def backward(flow, node, loss: Optional[EnvVal], via: str, st, fr, engines: frozenset = frozenset()) -> None:
    flow.records.node(site_of(fr.module, node), fr.module, node)
    site = flow.report_site(fr.module, node)
    models = engines or flow.program.wrappers(loss.prov if loss is not None else frozenset())
    report_module, report_node = flow.records.nodes[site]
    flow.records.backward(site, report_module, report_node, via, loss, fr)
    managed = flow.program.managed_models()

    loops = tuple(flow.loop_stack)

    def transfer(prop, guard):
        pending = frozenset(f.model for f in prop.forwards)
        # the models this backward runs through: those its loss came from whose forward ran on this
        # path (``if distributed: model = DDP(model)`` makes it a DDP backward on that path only)
        mine = (models & pending) if models else pending
        if not mine:
            mine = frozenset((PLAIN,))
        tokens = list(prop.tokens)
        forwards = list(prop.forwards)
        # several models from one forward are alternatives (a helper called with a different DDP
        # model by each script), not one loss through several models (a GAN's generator loss)
        shared = len({f.site for f in forwards if f.model in mine}) > 1
        for model in sorted(mine, key=repr):
            old = next((t for t in tokens if t.model == model), None)
            if old is not None:
                flow.records.resolve(old, "superseded", site, guard)
                tokens.remove(old)
            fwd = next((f for f in forwards if f.model == model), None)
            if fwd is not None:
                forwards.remove(fwd)
            if model == PLAIN:
                tokens.append(Token(PLAIN, site, "plain", None, False, False, loops))
                continue
            now, now_by = sync_state(prop, model, managed)
            if model.kind == "deepspeed":
                synced, by = "managed", None
            elif model.kind in vocab.FORWARD_DECIDES and fwd is not None:
                synced, by = fwd.decided, fwd.by
            else:
                synced, by = now, now_by
            misses = model.kind == "ddp" or model.kind in ("accelerate", "fabric")
            misses = misses and fwd is not None and ((fwd.decided == "on" and now == "off") or fwd.flag_after is not None)
            if misses:
                flow.records.misses_forward(now_by if fwd.flag_after is None else fwd.flag_after, site, model,
                                            "flag" if fwd.flag_after is not None else "control", guard)
            outside = model.kind in vocab.FORWARD_DECIDES and fwd is not None and fwd.decided == "off" and now == "on"
            tokens.append(Token(model, site, synced, by, outside, misses, loops, shared))
        yield prop._replace(tokens=tuple(tokens), forwards=tuple(forwards)), guard

    _each(st, transfer)


def _owned(flow, optims: frozenset) -> Optional[frozenset]:
    """The models these optimizers step; None: unknown (they may step any)."""
    if not optims:
        return None
    out = set()
    for o in optims:
        if isinstance(o, Wrapper):
            out.add(o)
            continue
        if not isinstance(o, Optim):
            return None
        owners = flow.values.owners(o)
        if not owners:
            return None
        out |= flow.program.models_of(owners)
        if not out:
            return None
    return frozenset(out)


def step(flow, node, optims: frozenset, st, fr) -> None:
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    models = _owned(flow, frozenset(v for v in optims if isinstance(v, (Optim, Wrapper))))
    # an optimizer accelerate prepared steps, inside ``accelerator.accumulate``, only when
    # ``accelerator.sync_gradients`` holds: off the boundary the step is a no-op
    managed = bool(optims) and all(isinstance(v, Optim) and v.managed for v in optims)
    gate = _sync_gradients_atom(flow) if managed else None
    # stepping each of several optimizers in a loop is one step, in the loops around that loop
    loops = tuple(i for i in flow.loop_stack if i not in flow.optimizer_loops)

    def transfer(prop, guard):
        flow.records.reached(site, guard)
        mine = [t for t in prop.tokens if models is None or t.model in models or t.model == PLAIN]
        if gate is not None and any(t.synced == "managed" for t in mine):
            branches = ((guard & flow.atoms.formula(gate, True), True), (guard & flow.atoms.formula(gate, False), False))
        else:
            branches = ((guard, True),)
        for g, taken in branches:
            if not g:
                continue
            kept = []
            for token in prop.tokens:
                if token in mine and (taken or token.synced != "managed"):
                    # a step in a loop the backward is not in (a later training phase) is no boundary of it
                    kind = "stepped" if loops == token.loops[:len(loops)] else "elsewhere"
                    flow.records.resolve(token, kind, site, g)
                else:
                    kept.append(token)
            yield prop._replace(tokens=tuple(kept)), g

    _each(st, transfer)


def _sync_gradients_atom(flow):
    atom = flow.atoms.get(("ACCELERATE_SYNC_GRADIENTS",), "accelerator.sync_gradients")
    if atom is not None:
        flow.note_atom(atom, (), True)
    return atom


def zero_grad(flow, node, vals: frozenset, st, fr) -> None:
    if any(isinstance(v, Optim) and v.managed for v in vals) or \
            any(isinstance(v, Wrapper) and v.kind == "deepspeed" for v in vals):
        return
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    flow.records.loops_at.setdefault(site, set()).update(flow.loop_stack)
    optims = frozenset(v for v in vals if isinstance(v, Optim))
    direct = flow.program.models_of(frozenset(v for v in vals if isinstance(v, (Wrapper, Obj, Inner))))
    models = _owned(flow, optims) if optims else (direct or None)

    def transfer(prop, guard):
        kept = []
        for token in prop.tokens:
            if models is None or token.model in models or token.model == PLAIN:
                flow.records.resolve(token, "wiped", site, guard)
            else:
                kept.append(token)
        yield prop._replace(tokens=tuple(kept)), guard

    _each(st, transfer)


def flag(flow, node, models: frozenset, cond: tuple, st, fr) -> None:
    if not models:
        return
    at_module, at_node = fr.control or (fr.module, node)
    site = site_of(at_module, at_node)
    flow.records.node(site, at_module, at_node)
    true, false = cond

    def transfer(prop, guard):
        first = flow.first_mask(prop.first)
        for value, formula in (("on", true), ("off", false)):
            g = guard & formula & first
            if g:
                p = prop
                for model in models:
                    p = with_flag(p, model, value, site)
                yield p, g

    _each(st, transfer)


def collective(flow, node, what: str, st, fr) -> None:
    """A collective. One that syncs gradients (or averages parameters) by hand makes the pending
    gradients synchronized, whatever DDP did for them."""
    if what not in vocab.GRAD_SYNC:
        return

    def transfer(prop, guard):
        tokens = tuple(t._replace(synced="manual") if t.synced in ("off", "unknown") else t for t in prop.tokens)
        yield prop._replace(tokens=tokens), guard

    _each(st, transfer)


def push_controls(flow, node, value: EnvVal, st, fr, owner: int) -> None:
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)

    def transfer(prop, guard):
        first = flow.first_mask(prop.first)
        for formula, vals in value.alts:
            g = guard & formula & first
            if not g:
                continue
            ctxs = [v for v in vals if isinstance(v, FlowCtx) and v.effect in ("off", "managed", "unknown")]
            others = [v for v in vals if not (isinstance(v, FlowCtx) and v.effect in ("off", "managed", "unknown"))]
            if others or not ctxs:
                yield prop, g
            for c in ctxs:
                control = Control(c.models, c.effect, site, owner, c.how)
                if c.enabled is None:
                    yield prop._replace(controls=prop.controls + (control,)), g
                else:
                    on, off = c.enabled
                    if g & on:
                        yield prop._replace(controls=prop.controls + (control,)), g & on
                    if g & off:
                        yield prop, g & off

    _each(st, transfer)


def pop_controls(st, owner: int) -> None:
    if st is None:
        return

    def transfer(prop, guard):
        if any(c.owner == owner for c in prop.controls):
            prop = prop._replace(controls=tuple(c for c in prop.controls if c.owner != owner))
        yield prop, guard

    _each(st, transfer)


# ---------------------------------------------------------------------------------------------------
# with

def with_(flow, s, st, fr):
    owner = id(s)
    out = _enter(flow, s, 0, st, fr, owner)
    pop_controls(out, owner)
    return out


def _enter(flow, s, i: int, st, fr, owner: int):
    if st is None or not st.props:
        return None
    if i == len(s.items):
        return flow.block(s.body, st, fr)
    item = s.items[i]
    value = expr(flow, item.context_expr, st, fr)
    vals = value.values
    if item.optional_vars is not None:
        bound = value
        ctx = item.context_expr
        if isinstance(ctx, ast.Call) and ctx.args and _name(ctx.func) == "scale_loss":
            # apex's ``with amp.scale_loss(loss, optimizer) as scaled_loss``: the loss times the fp16
            # loss scale, which the step undoes; for accumulation it is still ``loss``
            bound = expr(flow, ctx.args[0], st, fr)
        assign(flow, item.optional_vars, bound, s, st, fr)
    if any(isinstance(v, FlowCtx) and v.effect == "nograd" for v in vals) or _is_no_grad_call(flow, item, fr):
        fr.no_grad += 1
        try:
            return _enter(flow, s, i + 1, st, fr, owner)
        finally:
            fr.no_grad -= 1
    for v in vals:
        if isinstance(v, FlowCtx) and v.effect == "exitstack":
            flow.exitstacks[v.site] = owner
    helpers = [v for v in vals if isinstance(v, FlowHelper)]
    if helpers:
        outs = []
        for h in helpers:
            outs.append(_run_helper(flow, s, i, h, st.copy(), fr, owner))
        return flow.join(outs)
    if not any(isinstance(v, FlowCtx) for v in vals) and _opaque_context(flow, item.context_expr, vals, fr):
        value = _val(frozenset((FlowCtx("unknown", frozenset(), site_of(fr.module, item.context_expr),
                                        _text(fr, item.context_expr)),)))
    push_controls(flow, item.context_expr, value, st, fr, owner)
    return _enter(flow, s, i + 1, st, fr, owner)


def _run_helper(flow, s, i, helper: FlowHelper, st, fr, owner: int):
    """``with helper(...):`` for a project @contextmanager: the generator runs, and at its ``yield`` the
    rest of the with statement (further items, then the body) runs in the caller."""
    fn, receiver, args, kws, node = flow.helpers[helper.key]
    caller_env = st.env
    envs: list = []
    from synccheck.analyzer.project.syncflow import St

    def at_yield(inner):
        body = _enter(flow, s, i + 1, St(inner.props, dict(caller_env)), fr, owner)
        if body is None:
            return None
        envs.append(body.env)
        return St(body.props, inner.env)

    if fn.uid in fr.stack or fr.depth >= 8:
        return _enter(flow, s, i + 1, st, fr, owner)
    result_st = St(dict(st.props), caller_env)
    inline(flow, fn, node, receiver, args, kws, result_st, fr, yield_handler=at_yield,
           control=(fr.module, node))
    if not envs:
        return None if not result_st.props else St(result_st.props, caller_env)
    env = envs[0]
    return St(result_st.props, env)


def _is_no_grad_call(flow, item, fr) -> bool:
    node = item.context_expr
    if isinstance(node, ast.Call):
        func = node.func
        vals = flow.values.expr(func, fr.scope)
        for v in vals:
            if isinstance(v, Ext) and v.qualname in vocab.NO_GRAD:
                return True
        if isinstance(func, ast.Attribute) and func.attr in ("no_grad", "inference_mode"):
            return True
        if isinstance(func, ast.Attribute) and func.attr == "set_grad_enabled" and node.args and \
                isinstance(node.args[0], ast.Constant) and node.args[0].value is False:
            return True
    return False


def _opaque_context(flow, node, vals, fr) -> bool:
    """A context we cannot see into, in a project that turns sync off somewhere: it may hide a no_sync
    (we then give the micro-step no verdict rather than a wrong one)."""
    if not flow.program.mentions_no_sync:
        return False
    func = node.func if isinstance(node, ast.Call) else node
    text = _text(fr, func)
    qual = next((v.qualname for v in flow.values.expr(func, fr.scope) if isinstance(v, Ext)), text)
    if any(qual.startswith(h) or h in text for h in HARMLESS_CONTEXTS):
        return False
    if isinstance(func, ast.Attribute) and func.attr in ("autocast", "no_grad", "profile", "timer", "record_function",
                                                         "inference_mode", "main_process_first", "join"):
        return False
    return any(isinstance(v, (Obj, Unknown, Ext)) for v in vals)
