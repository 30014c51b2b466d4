"""Stage 6 of the pipeline (sync dataflow), events part 5: sync controls and ``with`` statements.

A ``with`` enters its items in order: ``no_sync()`` / ``accumulate()`` / ``no_backward_sync()``
contexts are pushed as sync controls for the body and popped after it; ``torch.no_grad()`` bodies run
no forward that matters; a project ``@contextmanager`` helper runs its generator around the body (the
rest of the ``with`` runs at its ``yield``); an ``ExitStack`` owns what ``enter_context`` pushed until
its ``with`` ends. A context the analysis cannot see into, in a project that turns sync off somewhere,
makes the micro-step's verdict unknown rather than wrong.
"""
from __future__ import annotations

import ast

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import Control, EnvVal
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.value_helpers import _argument
from synccheck.analyzer.project.values import Ext, Inst, Obj, Unknown, site_of


HARMLESS_CONTEXTS = ("torch.", "contextlib.", "nullcontext", "open", "tqdm", "warnings.", "autocast", "record_function",
                     "profile", "Timer", "timer", "amp.", "accelerate.", "main_process_first", "local_main_process_first",
                     "logging", "wandb", "mlflow", "tempfile", "zipfile", "tarfile", "sdpa_kernel", "sdp_kernel",
                     "nvtx")


def push_controls(flow, node, value: EnvVal, st, fr, owner: int, at=None) -> None:
    """``at``: (module, node) the control is reported at, when not ``node`` in the frame's module (a
    context object's ``__enter__`` enters it: the caller's ``with`` is where it is written)."""
    module, node = at or (fr.module, node)
    site = site_of(module, node)
    flow.records.node(site, module, node)

    def transfer(prop, guard):
        first = flow.first_mask(prop.first)
        for formula, vals in value.alts:
            g = guard & formula & first
            if not g:
                continue
            # (``stack.enter_context(torch.no_grad())`` on some paths: "nograd", a control of no model)
            ctxs = [v for v in vals if isinstance(v, FlowCtx) and v.effect in ("off", "managed", "unknown", "nograd")]
            others = [v for v in vals if not (isinstance(v, FlowCtx) and v.effect in ("off", "managed", "unknown",
                                                                                      "nograd"))]
            if others or not ctxs:
                yield prop, g
            for c in ctxs:
                control = Control(c.models, c.effect, site, owner, c.how, c.counter)
                if c.counter:
                    outer = next((k for k in prop.controls if k.counter == c.counter and k.site != site), None)
                    if outer is not None:
                        # ``with accelerator.accumulate(unet), accelerator.accumulate(text_encoder):``:
                        # each call counts a micro-step, so the counter moves twice per micro-step
                        flow.records.recounted.setdefault(site, outer.site)
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
    loop = fr.loops[-1] if fr.loops else None
    marks = (len(loop.continues), len(loop.breaks)) if loop is not None else (0, 0)
    returns = len(fr.returns)
    out = _enter(flow, s, 0, st, fr, owner)
    pop_controls(out, owner)
    # a ``continue``, ``break`` or ``return`` inside the body leaves the with too: its controls end
    # there (left on, they piled up one more each time round the loop)
    exits = [(fr.returns, returns)]
    if loop is not None:
        exits += [(loop.continues, marks[0]), (loop.breaks, marks[1])]
    for states, start in exits:
        for k in range(start, len(states)):
            if states[k] is not None:
                states[k] = states[k].copy()
                pop_controls(states[k], owner)
    return out


def _enter(flow, s, i: int, st, fr, owner: int):
    if st is None or not st.props:
        return None
    if i == len(s.items):
        return flow.block(s.body, st, fr)
    item = s.items[i]
    if isinstance(item.context_expr, ast.BoolOp):
        # ``with accelerator.accumulate(model) and torch.no_grad():`` enters only what ``and`` gives, the
        # last operand (a context object is true); ``or`` gives the first (mustango's evaluation loop)
        operand = item.context_expr.values[-1 if isinstance(item.context_expr.op, ast.And) else 0]
        item = ast.withitem(context_expr=operand, optional_vars=item.optional_vars)
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
    if len(value.alts) > 1 and any(isinstance(v, FlowHelper) for v in vals) and \
            not all(any(isinstance(v, FlowHelper) for v in alt) for _, alt in value.alts):
        formulas = [f for f, _ in value.alts]
        if not any(formulas[a] & formulas[b] for a in range(len(formulas)) for b in range(a + 1, len(formulas))):
            # ``with model.no_sync() if not boundary else noop():`` (a project @contextmanager that only
            # yields): each side is entered on its own paths
            outs = []
            for formula, alt in value.alts:
                part = flow.restrict(st.copy(), formula)
                if part is not None and part.props:
                    outs.append(_entered(flow, s, i, item, value._replace(alts=((TRUE, alt),)), part, fr, owner))
            return flow.join(outs)
    return _entered(flow, s, i, item, value, st, fr, owner)


def _entered(flow, s, i: int, item, value, st, fr, owner: int):
    """The rest of ``_enter`` once item i's value is known: the context it makes, then the rest."""
    vals = value.values
    if any(isinstance(v, FlowCtx) and v.effect == "nograd" for v in vals) or _is_no_grad_call(flow, item, fr):
        fr.no_grad += 1
        try:
            return _enter(flow, s, i + 1, st, fr, owner)
        finally:
            fr.no_grad -= 1
    for v in vals:
        if isinstance(v, FlowCtx) and v.effect == "exitstack":
            # (what a helper that returns the stack enters is reported at the caller's ``with
            # no_sync_all([...])``, which owns it)
            flow.exitstacks[v.site] = (owner, fr.control or (fr.module, item.context_expr), fr.scope)
    helpers = [v for v in vals if isinstance(v, FlowHelper)]
    if helpers:
        outs = []
        for h in helpers:
            outs.append(_run_helper(flow, s, i, h, st.copy(), fr, owner))
        return flow.join(outs)
    objects = [v for v in vals if isinstance(v, Inst) and _entered_in_place(flow, v)]
    if objects and len(objects) == len(vals) and isinstance(item.context_expr, ast.Call):
        return flow.join([_run_context_object(flow, s, i, v, item.context_expr, st.copy(), fr, owner) for v in objects])
    if not any(isinstance(v, FlowCtx) for v in vals) and _opaque_context(flow, item.context_expr, vals, fr):
        value = _val(frozenset((FlowCtx("unknown", frozenset(), site_of(fr.module, item.context_expr),
                                        _text(fr, item.context_expr)),)))
    # (``with net.no_sync(): yield`` in a @contextmanager helper: the caller's ``with helper(...)``,
    # where the arguments that decide it are written, is where it is reported)
    push_controls(flow, item.context_expr, value, st, fr, owner, at=fr.control)
    return _enter(flow, s, i + 1, st, fr, owner)


def _run_helper(flow, s, i, helper: FlowHelper, st, fr, owner: int):
    """``with helper(...):`` for a project @contextmanager: the generator runs, and at its ``yield`` the
    rest of the with statement (further items, then the body) runs in the caller."""
    fn, receiver, args, kws, node = flow.helpers[helper.key]
    caller_env = st.env
    envs: list = []
    from synccheck.analyzer.project.syncflow import St

    def at_yield(inner):
        env = dict(caller_env)
        # (what the helper stored on its instance before the yield, as the caller names it: the count
        # ``self.current_step += 1`` of ``self.accumulator.accumulate(model)``)
        env.update(stored_outputs(fn, node, receiver, inner))
        body = _enter(flow, s, i + 1, St(inner.props, env), fr, owner)
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


def _entered_in_place(flow, inst) -> bool:
    """A project class whose ``__enter__`` writes the DDP flag or enters ``no_sync`` (``MicroStep(model, sync)``)."""
    enter = flow.project.attribute(inst.cls, "__enter__")
    text = enter.module.segment(enter.node) or "" if isinstance(enter, Function) else ""
    return any(w in text for w in ("require_backward_grad_sync", "no_sync", "enter_context"))


def _run_context_object(flow, s, i, inst, made, st, fr, owner: int):
    """``with MicroStep(model, sync):`` for a project class: its ``__enter__`` runs in place before the
    rest of the with statement, its ``__exit__`` after, each seeing the ``self.x = x`` its ``__init__``
    stored from the call that made it. A flag written there is the with's (as a @contextmanager's)."""
    project = flow.project
    enter, leave = project.attribute(inst.cls, "__enter__"), project.attribute(inst.cls, "__exit__")
    if enter.uid in fr.stack or fr.depth >= 8:
        return _enter(flow, s, i + 1, st, fr, owner)
    seed = _constructor_fields(flow, project.attribute(inst.cls, "__init__"), made, st, fr,
                               enter.params[0] if enter.params else "self")
    control = (fr.module, made)
    flow.entering.append(owner)
    try:
        inline(flow, enter, made, inst, [], {}, st, fr, control=control, seed=seed)
    finally:
        flow.entering.pop()
    body = _enter(flow, s, i + 1, st, fr, owner)
    if body is None or not isinstance(leave, Function):
        return body
    inline(flow, leave, made, inst, [], {}, body, fr, control=control, seed=seed)
    return body


def _constructor_fields(flow, init, made, st, fr, me: str) -> dict:
    """``self.x`` (``me``: the name of ``self``) -> the value the call ``made`` passed for the
    ``__init__`` parameter stored there."""
    if not isinstance(init, Function) or not init.params:
        return {}
    out = {}
    for stmt in init.node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute) and \
                isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == init.params[0] and \
                isinstance(stmt.value, ast.Name) and stmt.value.id in init.params[1:]:
            passed = _argument(made, init, stmt.value.id, init.params.index(stmt.value.id), 1)
            if passed is not None:
                out[f"{me}.{stmt.targets[0].attr}"] = expr(flow, passed, st, fr)
    return out


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
    """A context we cannot see into, in a project that turns sync off somewhere, or made from the
    data-parallel model by a library we do not read (``for ctx in model_forward_contexts(accelerator,
    model, n): with ctx():``): it may hide a no_sync (we then give the micro-step no verdict rather
    than a wrong one)."""
    if not flow.program.mentions_no_sync and not _made_from_the_model(flow, node, fr):
        return False
    if isinstance(node, ast.Name):
        # ``ctx = nullcontext() if device_type == "cpu" else torch.cuda.amp.autocast()`` made once,
        # then ``with ctx:`` in the loop (nanoGPT, minimind): what it is bound to says what it is
        made = _bound_calls(flow, node.id, fr)
        if made and all(_harmless_call(flow, call, scope) for call, scope in made):
            return False
    if isinstance(node, ast.Attribute):
        # ``self.amp_ctx = torch.amp.autocast(...)`` in ``__init__``, ``with self.amp_ctx:`` in the loop
        made = _stored_calls(flow, node, fr)
        if made and all(_harmless_call(flow, call, scope) for call, scope in made):
            return False
    if _harmless_call(flow, node, fr.scope):
        return False
    return any(isinstance(v, (Obj, Unknown, Ext)) for v in vals)


def _made_from_the_model(flow, node, fr) -> bool:
    """Is the context made by a call handed a data-parallel model: ``with make_ctx(accelerator, model):``,
    or ``ctx()`` where ``ctx`` comes from one (``for ctx in model_forward_contexts(accelerator, model,
    n):``)?"""
    calls = [node] if isinstance(node, ast.Call) else []
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Name):
        calls += [call for call, _ in _bound_calls(flow, func.id, fr)]
        if isinstance(fr.scope, Function):
            calls += [loop.iter for loop in walk(fr.scope.node) if isinstance(loop, (ast.For, ast.AsyncFor)) and
                      isinstance(loop.target, ast.Name) and loop.target.id == func.id and isinstance(loop.iter, ast.Call)]
    return any(flow.program.wrappers(flow.values.expr(a, fr.scope))
               for call in calls for a in list(call.args) + [k.value for k in call.keywords])


def _harmless_call(flow, node, scope) -> bool:
    """A context made by (or named) torch's, contextlib's, a profiler's, a logger's...: no sync in it."""
    func = node.func if isinstance(node, ast.Call) else node
    text = ast.unparse(func)
    qual = next((v.qualname for v in flow.values.expr(func, scope) if isinstance(v, Ext)), text)
    if any(qual.startswith(h) or h in text for h in HARMLESS_CONTEXTS):
        return True
    return isinstance(func, ast.Attribute) and func.attr in ("autocast", "no_grad", "profile", "timer",
                                                             "record_function", "inference_mode",
                                                             "main_process_first", "join")


def _stored_calls(flow, node, fr) -> list:
    """(call, scope) for every value the class stores in ``self.<attr>`` (through conditional
    expressions); [] when one is not a call, or ``node`` is not an attribute of the method's ``self``."""
    from synccheck.analyzer.project.value_helpers import _class_attrs
    scope = fr.scope
    if not (isinstance(node.value, ast.Name) and isinstance(scope, Function) and scope.cls is not None and
            scope.params and node.value.id == scope.params[0]):
        return []
    stores = [(where, value, path) for klass in flow.project.mro(scope.cls)
              for where, value, path in _class_attrs(flow.values, klass).get(node.attr, ())]
    if any(path for _, _, path in stores):
        return []           # (stored into an item or unpacked: not a call's value)
    return _calls_of([(value, where) for where, value, _ in stores])


def _bound_calls(flow, name: str, fr) -> list:
    """(call, scope) for every expression ``name`` is bound to, in the function or at the module's top,
    through conditional expressions; [] when one of them is not a call."""
    return _calls_of(flow.values.bound_expressions(name, fr.scope))


def _calls_of(bound: list) -> list:
    """(call, scope) for each (expression, scope), through conditional expressions; [] when one of them
    is not a call."""
    todo, out = list(bound), []
    while todo:
        value, where = todo.pop()
        if isinstance(value, ast.IfExp):
            todo += [(value.body, where), (value.orelse, where)]
        elif isinstance(value, ast.Call):
            out.append((value, where))
        else:
            return []
    return out


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
from synccheck.analyzer.project.events import FlowCtx, FlowHelper, _text, _val, assign, expr
from synccheck.analyzer.project.inlining import inline, stored_outputs
from synccheck.analyzer.project.event_methods import _name
from synccheck.analyzer.project.micro_step import _each
