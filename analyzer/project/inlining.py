"""Stage 6 of the pipeline (sync dataflow), events part 3: a project function analysed in place.

``inline`` walks a callee's body with the caller's state and its arguments bound to the parameters,
memoized on that input: what the callee does to sync state and which events it runs are then the
caller's, at the call. A callee is walked only when that can change what happens to gradients
(``_worth_inlining``): it runs an event through the calls it makes, returns a sync control or a test
the caller branches on, or calls a value it was handed that may be a model or a callback.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project.definitions import Function, called_name
from synccheck.analyzer.project.state import FROZEN, EnvVal
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.value_helpers import _class_attrs
from synccheck.analyzer.project.values import Bound, Cls, Func, Inner, Inst, Obj, parameter_default


def inline(flow, fn: Function, node, receiver, args, kws, st, fr, yield_handler=None,
           control=None, seed=None) -> Optional[EnvVal]:
    """Analyse ``fn`` in place with the caller's state; None when it cannot matter or cannot be followed.
    ``seed``: values the callee starts with beyond its parameters (``self.model`` of a context object)."""
    if fn.abstract:
        return None         # a hook that subclasses fill: the base's raise is not what runs
    carries = any(a.prov or flow.program.wrappers(a.values)
                  for a in list(args) + list(kws.values()) + list((seed or {}).values())) or \
        (receiver is not None and bool(flow.program.wrappers(frozenset((receiver,)))))
    if yield_handler is None and (fn.uid in fr.stack or fr.depth >= 8 or flow.values.info(fn).has_yield):
        return None
    if yield_handler is None and not carries and not _worth_inlining(flow, fn, receiver, args, kws):
        return None
    env = dict(seed or {})
    if FROZEN in st.env:
        env[FROZEN] = st.env[FROZEN]        # (the wrappers frozen for this phase stay frozen in a helper)
    params = list(fn.params)
    positional = list(args)
    if receiver is not None and fn.is_method and params:
        env[params[0]] = _val(frozenset((receiver,)), version=("arg", id(node), 0))._replace(
            origin=origin_of(node.func.value, st) if isinstance(node.func, ast.Attribute) else None)
        held_by = _dotted(node.func.value) if isinstance(node.func, ast.Attribute) else None
        if held_by:
            # ``self.micro`` moved on in the caller (``self.micro += 1``) is the callee's ``self.micro``:
            # one count under one origin, whichever frame tests it (and ``self.accumulator.step`` is
            # ``self.step`` in ``self.accumulator.should_update()``)
            prefix = held_by + "."
            for name, known in st.env.items():
                if name.startswith(prefix):
                    env[params[0] + name[len(prefix) - 1:]] = known if known.origin is not None else \
                        known._replace(origin=("name", name, known.version))
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
            st.env.update(hit[2])
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
    stored = stored_outputs(fn, node, receiver, ends)
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
        if result.scaled is True and any(r.scaled is False for r in rets) and \
                _divided_on_a_side(fn, [n for n, r in zip(frame.ret_nodes, rets) if r.scaled is True]):
            # ``if args.fp16: return scaler.scale(loss / accum)`` ... ``return loss``: undivided on
            # the other paths
            result = result._replace(scaled=False)
    else:
        result = NONE_VAL
    st.props = dict(props)
    st.env.update(stored)
    if key is not None:
        flow.memo[key] = (props, result, stored)
    return result


def stored_outputs(fn, node, receiver, ends) -> dict:
    """What a method called on ``self`` stored on its instance from a model's forward, as the caller
    names it: ``self.vq_forward()`` whose body is ``self.E, self.vq_loss = self.netG(x)`` (KAIR's
    model classes) leaves ``self.E`` holding that forward's output for the loss the caller computes.
    Only values a forward made (with a provenance) are handed back."""
    if ends is None or receiver is None or not fn.is_method or not fn.params or \
            not isinstance(node.func, ast.Attribute):
        return {}
    held_by = _dotted(node.func.value)
    if not held_by:
        return {}
    mine, theirs = fn.params[0] + ".", held_by + "."
    # (and a count the method moved on, ``self.current_step += 1`` in an accumulator's ``accumulate()``:
    # the caller's later ``self.accumulator.should_update()`` tests the count as moved)
    return {theirs + k[len(mine):]: v for k, v in ends.env.items() if k.startswith(mine) and (
        v.prov and isinstance(node.func.value, ast.Name) or v.origin is not None and v.origin[0] == "shift")}


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
    if _calls_a_global_model(flow, fn):
        return True                         # ``def compute_loss(batch): return model(batch)...`` in a script
    if "call" not in words:
        return False
    if fn.parent is not None:
        return True                         # a closure: it may call the caller's model
    for a in list(args) + list(kws.values()):
        if any(isinstance(v, _CALLABLE) or isinstance(v, FlowPartial) for v in a.values):
            return True
    return isinstance(receiver, Inst) and _holds_callables(flow, receiver)


def _calls_a_global_model(flow, fn: Function) -> bool:
    """Does the function call a module-level name that holds a data-parallel model (a script's
    ``model = DDP(...)`` read by its helpers)?"""
    key = ("calls a global model", fn.uid)
    if key not in flow.memo:        # (asked at every call of the function that is not followed)
        local = set(fn.params) | (flow.values.info(fn).locals or set())
        names = {n.func.id for n in fn.nodes() if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id not in local and n.func.id in fn.module.globals}
        flow.memo[key] = any(flow.program.wrappers(flow.values.module_name(name, fn.module)) for name in sorted(names))
    return flow.memo[key]


def _on_paths(value: EnvVal, st) -> EnvVal:
    """``value`` restricted to the paths that reach state ``st`` (the guards of its properties)."""
    if st is None or not st.props:
        return value
    reach = 0
    for guard in st.props.values():
        reach |= guard
    alts = tuple((g & reach, v) for g, v in value.alts if g & reach)
    return value._replace(alts=alts) if alts else value


def _literal_default(node, name: str):
    """The default of parameter ``name`` when it is a literal (True, 0, None, "x"), else None."""
    value = parameter_default(node, name)
    return value if isinstance(value, ast.Constant) else None


def _freeze(value: EnvVal):
    return (value.alts, value.prov, value.scaled, value.cond, value.origin)


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
    # (and a record's fields: ``@dataclass class Trainer: dist_model: Any``, OLMo's)
    attrs.update(name for name, _ in flow.values.record_fields(inst.cls))
    for attr in sorted(attrs):
        yield flow.values.instance_attribute(inst, attr)


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
from synccheck.analyzer.project.events import _COPIES, NONE_VAL, FlowPartial, _val, expr
from synccheck.analyzer.project.state import origin_of


def _divided_on_a_side(fn: Function, returns: list) -> bool:
    """Is one of these return statements (that divide what they return) on a side of a test that is
    not about the accumulation count (branches.count_guard)?"""
    from synccheck.analyzer.project.branches import count_guard
    tests: dict = {}

    def visit(stmts, test) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.Return):
                tests[id(stmt)] = test
            if isinstance(stmt, ast.If):
                visit(stmt.body, stmt.test)
                visit(stmt.orelse, stmt.test)
                continue
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list):
                    visit(block, test)
            for handler in getattr(stmt, "handlers", ()):
                visit(handler.body, test)

    visit(fn.node.body, None)
    return any(tests.get(id(r)) is not None and not count_guard(tests[id(r)], [r]) for r in returns)
