"""What each expression does to gradient synchronization, and what it evaluates to.

Expressions are evaluated in order (arguments before the call that takes them). Calls are the events:
a forward of a data-parallel model (DDP decides here whether the next backward all-reduces), a
backward (``loss.backward()``, ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``,
``fabric.backward``, a DeepSpeed engine's), an optimizer step or ``zero_grad``, a sync flag write,
a sync context being made (``model.no_sync()``, ``accelerator.accumulate(model)``, an ``ExitStack``'s
``enter_context``), a collective that syncs gradients by hand. A call into a project function is
analysed in place (syncflow's summaries); anything else leaves the state alone and passes the
provenance of its arguments on (a loss computed from a model's output is that model's loss).

This module is part 1: the sync flow's value types (``FlowCtx``, ``FlowFactory``, ...), expressions and
assignments. The other parts: event_calls.py (calls), inlining.py (project functions analysed in place),
event_methods.py (library calls and methods that are events), micro_step.py (forward, backward,
step, zero_grad, sync flags: the transfers) and sync_control.py (sync controls and ``with``). Every
name they define stays importable from here, as ``events.<name>``.
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import EnvVal, origin_of
from synccheck.analyzer.project.values import ONE_UNKNOWN, Bag, Const, CtxFactory, Inst, Tup, _cap, site_of
from synccheck.analyzer.project.traversal import children, walk, walk_no_defs


class FlowCtx(NamedTuple):
    """A sync context as the flow sees it, with the models it names resolved in this context."""
    effect: str                  # off | managed | null | exitstack | unknown
    models: frozenset
    site: tuple
    how: str = ""
    enabled: Optional[tuple] = None      # fabric's enabled=: (true, false) guards
    counter: tuple = ()          # accelerate's accumulate(): the accelerator whose step counter it moves


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


class SyncSetter(NamedTuple):
    """``model.set_requires_gradient_sync`` taken as a value (``functools.partial`` of it)."""
    models: frozenset


NONE_VAL = EnvVal(((TRUE, frozenset((Const(None),))),))
_NONE = Const(None)
_new = tuple.__new__        # a named tuple made from its fields, as its _make and _replace make it


def is_one(value: EnvVal) -> bool:
    """Is the value the number 1 on every path (a divisor that divides by nothing)?"""
    vals = value.values
    return bool(vals) and all(isinstance(v, Const) and type(v.value) in (int, float) and v.value == 1 for v in vals)


def _versioned(value: EnvVal, version) -> EnvVal:
    """``value._replace(version=version)``, made directly for an EnvVal (assignments run all the time)."""
    return _new(EnvVal, value[:4] + (version, value[5])) if value.__class__ is EnvVal else \
        value._replace(version=version)


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

_WORLD_SIZE = re.compile(r"^(?:[\w.]*\.)?(?:world_size|get_world_size\(\)|num_gpus|n_gpu|ngpus|num_processes|"
                         r"world|nprocs|num_replicas)$", re.I)


_WORLD = re.compile(r"(?i)^(world_size|num_gpus|n_gpus?|ngpus?|nprocs|num_processes)$")


def _grows(node) -> bool:
    """A factor that makes a loss larger by the number of processes (``WORLD_SIZE``,
    ``dist.get_world_size()``, ``args.world_size``). (A constant is a weight between terms: ``* 100``.)"""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
        (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")) \
        if isinstance(node, ast.Call) else ""
    return bool(name) and (_WORLD.match(name) is not None or name == "get_world_size")


def _reading_the_flag(models: frozenset) -> frozenset:
    """The wrappers that read ``require_backward_grad_sync`` (DDP's reducer, ``replicate``): FSDP and
    FSDP2 never do (FSDP2 has ``set_requires_gradient_sync``), so the write leaves them syncing."""
    return frozenset(m for m in models if getattr(m, "kind", "") not in ("fsdp", "fsdp2", "deepspeed"))


def _attribute(flow, node, recv: EnvVal, st, fr, version=0) -> EnvVal:
    receivers = recv.values
    if len(receivers) > 1 and _NONE in receivers:
        receivers = receivers - {_NONE}      # ``model=None`` by default: an attribute of it is another path's
    test = _property_test(flow, node, receivers, st, fr)
    if test is not None:
        return test
    vals = flow.values.attribute(receivers, node.attr, node, fr.scope)
    if node.attr == "no_sync" and not any(isinstance(v, Inst) and flow.project.attribute(v.cls, "no_sync")
                                          is not None for v in recv.values):
        vals = frozenset(v for v in vals if not isinstance(v, CtxFactory)) | {
            FlowFactory("off", flow.program.wrappers(recv.values), site_of(fr.module, node), _text(fr, node))}
    return EnvVal(((TRUE, vals),), recv.prov, recv.scaled, None, version)


def _no_sync_by_alts(flow, node, recv: EnvVal, st, fr) -> Optional[EnvVal]:
    """``model.no_sync`` where ``model`` is the DDP wrapper on some paths and the plain module on the
    others (``if args.local_rank != -1: model = DDP(model)``): the sync control on the wrapper's paths
    only, so that two ``with sync_context():`` in one micro-step pick the same one. None when the
    paths overlap or every path holds the same values."""
    formulas = [f for f, _ in recv.alts]
    if len({v for _, v in recv.alts}) < 2 or \
            any(formulas[i] & formulas[j] for i in range(len(formulas)) for j in range(i + 1, len(formulas))):
        return None
    alts = []
    for formula, vals in recv.alts:
        part = EnvVal(((TRUE, vals),), recv.prov, recv.scaled, None, 0)
        alts.extend((formula & g, v) for g, v in _attribute(flow, node, part, st, fr).alts if formula & g)
    return EnvVal(tuple(alts), recv.prov, recv.scaled, None, 0)


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
        if node.attr == "no_sync" and len(recv.alts) > 1:
            split = _no_sync_by_alts(flow, node, recv, st, fr)
            if split is not None:
                return split
        return _attribute(flow, node, recv, st, fr, st.env[dotted].version if dotted in st.env else 0)
    if t is ast.Call:
        return call(flow, node, st, fr)
    if t is ast.BinOp:
        left, right = expr(flow, node.left, st, fr), expr(flow, node.right, st, fr)
        product = _UNWEIGHTED
        if isinstance(node.op, ast.Mult):
            # ``lambda_coeff * loss``: a weight between losses, not the accumulation's 1/N
            product = weighted(left, right, node.right, flow, fr)
            if product is _UNWEIGHTED:
                product = weighted(right, left, node.left, flow, fr)
        if product is not _UNWEIGHTED:
            scaled = product
        elif isinstance(node.op, (ast.Div, ast.FloorDiv)) and \
                not_the_count(node, fr.scope.node if isinstance(fr.scope, Function) else None):
            # by the world size, a measured micro-batch, or a mean over what one micro-step holds:
            # divided by something other than the micro-steps (not_the_count)
            scaled = left.scaled
        elif isinstance(node.op, (ast.Div, ast.FloorDiv)) and is_one(right) and \
                not the_step_count(node.right, fr.scope.node if isinstance(fr.scope, Function) else None):
            # ``loss / accum_steps`` where ``accum_steps`` is a parameter left at its default of 1 by
            # every caller: divided by nothing (unless the step's own test counts by it: then it is
            # the micro-steps, whatever one configuration sets them to)
            scaled = left.scaled
        elif isinstance(node.op, ast.Mult) and (_grows(node.right) or _grows(node.left)):
            # ``loss * WORLD_SIZE``: made larger, not divided by the micro-steps
            scaled = left.scaled if _grows(node.right) else right.scaled
        elif isinstance(node.op, (ast.Div, ast.Mult, ast.FloorDiv)) and (
                left.prov or right.prov or left.scaled is not None or right.scaled is not None):
            scaled = True
        elif isinstance(node.op, (ast.Div, ast.FloorDiv)) and share_of_a_count(node):
            # no loss on either side, but a share of a count (StyleGAN's ``gain = 1.0 / num_rounds``,
            # handed to the helper that runs ``loss.mean().mul(gain).backward()``): the 1/N to come
            scaled = True
        elif isinstance(node.op, (ast.Div, ast.Mult, ast.FloorDiv)):
            # no loss on either side (EDM's ``weight = (sigma ** 2 + sd ** 2) / (sigma * sd) ** 2``): a
            # number, not a loss divided; a later ``weight * (D - y) ** 2`` is a weighted fresh loss
            scaled = None
        elif left.scaled is False and right.scaled is False:
            scaled = False      # two fresh losses added: still undivided (``main_loss + aux_loss``)
        elif isinstance(node.op, (ast.Add, ast.Sub)) and {left.scaled, right.scaled} == {True, False} and \
                (left.prov if left.scaled is False else right.prov):
            # ``loss_cls + loss_box / accum_steps``: one fresh loss added undivided
            scaled = False
        else:
            scaled = True if (left.scaled or right.scaled) else (
                None if (left.scaled is None and not left.prov) and (right.scaled is None and not right.prov) else
                False if (left.prov or right.prov) else None)
        return _val(ONE_UNKNOWN, left.prov | right.prov, scaled)
    if t is ast.IfExp:
        known = flow.values._type_test(node.test, fr.scope)
        if known is not None:
            # ``model.module if hasattr(model, "module") else model`` on a model known to be a wrapper
            # (or known not to be one): the one side that is taken
            return expr(flow, node.body if known else node.orelse, st, fr)
        body, orelse = expr(flow, node.body, st, fr), expr(flow, node.orelse, st, fr)
        syncish = any(isinstance(v, (FlowCtx, FlowFactory, FlowHelper)) or isinstance(v, Const) and isinstance(v.value, bool)
                      for v in body.values | orelse.values)
        if not syncish and isinstance(node.test, ast.Call) and isinstance(node.test.func, ast.Name) and \
                node.test.func.id == "isinstance":
            # ``model.module.state_dict() if isinstance(model, DDP) else model.state_dict()`` in a save
            # block: a type test that picks no sync control splits nothing (both values, no new atom)
            true, false = TRUE, TRUE
        else:
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
        # (a test in a helper run before any loop, ``use_bias = model.model_type != "opt" or ...`` while
        # a linear head is fitted, takes no place in the condition table)
        if fr.loops or fr.depth and flow.loop_stack:
            true, false = flow.conds.cond(node, st, fr, True)
            return _val(ONE_UNKNOWN, cond=(true, false))
        for sub in children(node):
            if isinstance(sub, ast.expr) and any(isinstance(n, ast.Call) for n in walk(sub)):
                expr(flow, sub, st, fr)
        return _val(ONE_UNKNOWN)
    if t in (ast.Tuple, ast.List):
        items = [expr(flow, e, st, fr) for e in node.elts]
        # ``return loss, info``: the tuple is as divided as the losses in it (what unpacking reads)
        return _val(frozenset((Tup(tuple(i.values for i in items)),)), _prov(*items), _losses_scaled(items, node.elts))
    if t is ast.Subscript:
        chosen = _by_truth(flow, node, fr)
        if chosen is not None:
            return expr(flow, chosen, st, fr)
        key = _item_key(node, st)
        if key is not None and key[0] in st.env and st.env[key[0]].origin == ("item of", key[1]):
            return st.env[key[0]]
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
        # (a float only as the 0.0 an accumulator starts from, ``total_loss = 0.0``)
        return _val(frozenset((Const(node.value),)) if isinstance(node.value, (bool, int, type(None))) or
                    node.value == 0.0 and type(node.value) is float else ONE_UNKNOWN)
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
    if t is ast.Dict and 0 < len(node.keys) <= 64 and all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        # ``state = {"model": model, "optimizer": optimizer}``: a record whose entries keep their values
        # (``state["model"]`` in the step function it is handed is the wrapper)
        entries = [expr(flow, v, st, fr) for v in node.values]
        fields = tuple((k.value, _cap(e.values)) for k, e in zip(node.keys, entries))
        items = frozenset().union(*(e.values for e in entries))
        # ``return {"loss": loss / accum, "rec": rec.detach()}``: the record is as divided as its loss
        # (what ``out["loss"]`` reads back)
        return _val(frozenset((Bag(_cap(items), True, fields),)), _prov(*entries),
                    _losses_scaled([e for k, e in zip(node.keys, entries) if "loss" in k.value.lower()]))
    if t in (ast.GeneratorExp, ast.ListComp, ast.SetComp):
        # ``sum(loss_dict[k] / accum for k in loss_dict)``: each element's scaling is the whole's
        prov = frozenset()
        for gen in node.generators:
            iterated = expr(flow, gen.iter, st, fr).prov
            if not _detached_element(node.elt, gen.target):
                # (``[t.detach() for t in teacher_reps]``: the elements, cut from the graph, carry none
                # of the forward that made the list, TinyBERT's teacher)
                prov |= iterated
            for cond in gen.ifs:
                expr(flow, cond, st, fr)
        elt = expr(flow, node.elt, st, fr)
        # (a list of what each element is: ``[accelerator.prepare(m) for m in models]`` holds wrappers,
        # whichever index picks one later)
        made = flow.values.expr(node, fr.scope) if t is not ast.GeneratorExp else ONE_UNKNOWN
        return _val(made, prov | elt.prov, elt.scaled)
    # comprehensions, dicts, f-strings, ...: their calls still happen; provenance is the union
    prov = frozenset()
    for sub in children(node):
        if isinstance(sub, ast.expr):
            prov |= expr(flow, sub, st, fr).prov
        elif isinstance(sub, ast.comprehension):
            prov |= expr(flow, sub.iter, st, fr).prov
            for cond in sub.ifs:
                expr(flow, cond, st, fr)
    return _val(ONE_UNKNOWN, prov)


def _detached_element(elt, target) -> bool:
    """Is a comprehension's element its own variable cut from the graph: ``t.detach()``,
    ``t.detach().clone()``, ``t.item()``, ``t.data``?"""
    if not isinstance(target, ast.Name):
        return False
    node, cut = elt, False
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            cut = cut or node.func.attr in ("detach", "item", "tolist", "numpy")
            node = node.func.value
        elif isinstance(node, ast.Attribute) and node.attr == "data":
            cut, node = True, node.value
        else:
            break
    return cut and isinstance(node, ast.Name) and node.id == target.id


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
        source = getattr(stmt, "value", None)
        if source is not None and type(source) in _COPIES and type(stmt) in (ast.Assign, ast.AnnAssign) and (
                getattr(stmt, "target", None) is target or target in getattr(stmt, "targets", ())):
            origin = origin_of(source, st)
            if origin is not None:
                value = value._replace(origin=origin)
        st.env[target.id] = _versioned(value, version)
    elif t in (ast.Tuple, ast.List):
        # ``loss, datapoint_count = model.forward_loss(batch)``, ``loss, sample_size, log = criterion(...)``:
        # a loss handed back with the count it is to be normalised by is a sum over those examples
        # (flair, fairseq): whether and where 1/N comes in, the code after says, not this call
        summed = _summed_with_its_count(target) if value.scaled is False else None
        for i, el in enumerate(target.elts):
            if isinstance(el, ast.Starred):
                assign(flow, el.value, _val(ONE_UNKNOWN, value.prov), stmt, st, fr, version)
                continue
            picked = frozenset()
            for v in value.values:
                if isinstance(v, Tup) and i < len(v.items):
                    picked |= v.items[i]
                elif isinstance(v, Bag) and not v.keyed:
                    picked |= v.items        # unpacking a generator or list: one of its elements
            scaled = None if i == summed else value.scaled
            assign(flow, el, _val(picked or ONE_UNKNOWN, value.prov, scaled), stmt, st, fr, version)
    elif t is ast.Attribute:
        if target.attr == "require_backward_grad_sync":
            recv = expr(flow, target.value, st, fr)
            models = _reading_the_flag(flow.program.wrappers(recv.values))
            value_node = getattr(stmt, "value", None)
            flag(flow, stmt, models, _cond_of(flow, value, value_node, st, fr), st, fr)
            return
        dotted = _dotted(target)
        if dotted is not None:
            st.env[dotted] = _versioned(value, version)
    elif t is ast.Subscript:
        # ``outputs["loss"] = outputs["loss"] / accum``: the item, for as long as ``outputs`` is not rebound
        key = _item_key(target, st)
        if key is not None:
            st.env[key[0]] = _versioned(value, version)._replace(origin=("item of", key[1]))
            container = target.value
            # (only for the item that is the loss: ``losses["aux"] = losses["loss"] / 2`` divides another)
            named_loss = isinstance(target.slice, ast.Constant) and "loss" in str(target.slice.value).lower()
            while value.scaled is True and named_loss:
                # the container is as divided as its loss: ``return output_dict, loss_dict`` hands the
                # caller a dict whose ``loss_dict["loss"]`` the callee divided (GeoTransformer), and
                # ``info["loss_dict"]["loss"] = ...`` divides ``info`` too (wenet's batch_forward)
                base = _item_base(container) if type(container) is ast.Subscript else _dotted(container)
                known = st.env.get(base) if base is not None else None
                if known is not None and known.scaled is not True:
                    st.env[base] = known._replace(scaled=True)
                if type(container) is not ast.Subscript:
                    break
                container = container.value


def _losses_scaled(parts, nodes=()) -> Optional[bool]:
    """How divided the losses among ``parts`` (those a forward made; in plain PyTorch, those known
    fresh or divided) are, when they agree; else None."""
    losses = {p.scaled for p in parts if p.prov}
    if not losses and nodes:
        # plain PyTorch (no wrapper to come from): the entries named for a loss (``return total_loss,
        # total_kl``), known fresh or divided
        losses = {p.scaled for p, n in zip(parts, nodes) if p.scaled is not None and
                  isinstance(n, (ast.Name, ast.Attribute)) and "loss" in ast.unparse(n).lower()}
    return losses.pop() if len(losses) == 1 else None


_COUNT_NAME = re.compile(r"count|sample_size|n_?tokens|num_tokens|n_?samples|num_samples|denom|normali[sz]|"
                         r"n_items|num_items", re.I)


def _summed_with_its_count(target) -> Optional[int]:
    """The index of the loss in ``loss, datapoint_count = ...``, when another name is its count."""
    names = [e.id if isinstance(e, ast.Name) else "" for e in target.elts]
    losses = [i for i, n in enumerate(names) if "loss" in n.lower()]
    if len(losses) == 1 and any(_COUNT_NAME.search(n) for n in names if "loss" not in n.lower()):
        return losses[0]
    return None


def _property_test(flow, node, receivers, st, fr) -> Optional[EnvVal]:
    """``if self.at_boundary:`` through ``@property def at_boundary(self): return (self.step + 1) %
    self.accum == 0``: the property's test, read as the caller's condition (inlining.inline); so
    for a property that picks a sync control (``self.model.no_sync if self.accumulating else ...``)."""
    if len(receivers) != 1:
        return None
    (receiver,) = receivers
    if not isinstance(receiver, Inst):
        return None
    method = flow.project.attribute(receiver.cls, node.attr)
    if not (isinstance(method, Function) and method.is_property and
            (_returns_a_test(method) or _returns_a_sync_control(method))):
        return None
    key = ("property call", id(node))
    call = flow.memo.get(key)
    if call is None:
        call = flow.memo[key] = ast.copy_location(ast.Call(node, [], []), node)
    return inline(flow, method, call, receiver, [], {}, st, fr)


def _by_truth(flow, node: ast.Subscript, fr):
    """``{True: nullcontext, False: model.no_sync}[is_last]`` (or a name bound once to such a dict):
    the conditional expression ``nullcontext if is_last else model.no_sync``, made once per node."""
    key = ("by truth", id(node))
    if key in flow.memo:
        return flow.memo[key]
    table = flow.values.bound_once(node.value, fr.scope)
    chosen = None
    if isinstance(table, ast.Dict) and len(table.keys) == 2 and all(
            isinstance(k, ast.Constant) and isinstance(k.value, bool) for k in table.keys) and \
            {k.value for k in table.keys} == {True, False}:
        sides = {k.value: v for k, v in zip(table.keys, table.values)}
        chosen = ast.copy_location(ast.IfExp(test=node.slice, body=sides[True], orelse=sides[False]), node)
    flow.memo[key] = chosen
    return chosen


_COPIES = (ast.Name, ast.Attribute, ast.Subscript, ast.Dict, ast.BinOp)


def _item_key(node: ast.Subscript, st):
    """(env key, version of the container) for ``outputs["loss"]`` / ``self.out[0]``: a constant item of
    a name or attribute chain; None for anything else."""
    base = _item_base(node)
    if base is None:
        return None
    known = st.env.get(base)
    return f"{base}[{node.slice.value!r}]", known.version if known is not None else 0


def _item_base(node: ast.Subscript) -> Optional[str]:
    """The env key of what ``node`` takes a constant item of: ``outputs`` for ``outputs["loss"]``,
    ``info['loss_dict']`` for ``info["loss_dict"]["loss"]`` (wenet's nested dicts); None otherwise."""
    if type(node.slice) is not ast.Constant or not isinstance(node.slice.value, (str, int)):
        return None
    if type(node.value) is ast.Subscript:
        inner = _item_base(node.value)
        return None if inner is None else f"{inner}[{node.value.slice.value!r}]"
    return _dotted(node.value)


def _cond_of(flow, value: EnvVal, node, st, fr) -> tuple:
    if value.cond is not None:
        return value.cond
    const = _const_cond(value)
    if const is not None:
        return const
    if node is not None:
        return flow.conds.literal(node, st, fr)
    return (TRUE, TRUE)


def _text(fr, node) -> str:
    return (fr.module.segment(node) or ast.unparse(node)).strip()


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order. Every name of the parts is
# importable from here too, as it was before events.py was split.
from synccheck.analyzer.project.event_calls import _call_target, _factory_by_alts, _forward_by_alts, call
from synccheck.analyzer.project.inlining import (_freeze, _literal_default, _returns_a_sync_control, _returns_a_test,
                                                 inline)
from synccheck.analyzer.project.event_methods import (_COUNT_WORDS, _UNWEIGHTED, _external, _method, _name,
                                                      _native_scaler, _scale_call, _unknown, scales_by_count,
                                                      share_of_a_count,
                                                      weighted)
from synccheck.analyzer.project.micro_step import (_each, _owned, _sync_gradients_atom, backward, collective, flag,
                                                   forward, step, zero_grad)
from synccheck.analyzer.project.sync_control import (HARMLESS_CONTEXTS, _enter, _is_no_grad_call, _opaque_context,
                                                     _run_helper, pop_controls, push_controls, with_)


def the_step_count(divisor, fn_node) -> bool:
    """Is ``divisor`` what the function's own step test counts by (``(step + 1) % divisor == 0``)? A
    count that one configuration sets to 1 (chinese_pretrain's star-imported config) is still the
    number of micro-steps the loss is divided by."""
    if fn_node is None:
        return False
    text = ast.unparse(divisor)
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and ast.unparse(n.right) == text
               for n in walk_no_defs(fn_node))


def not_the_count(node: ast.BinOp, fn_node) -> bool:
    """Is this division, by its own text, never the accumulation's 1/N? Read the same in a walked body
    (expr) and in a function read from its returns (program._scaled_walk):
    - ``loss / world_size``: an average over the ranks, which DDP's all-reduce already does;
    - ``loss / (args.train_batch_size / input_ids.shape[0])``: a rescale for a short batch, or a sum
      made a mean over the batch (DialoGPT); but not ``loss * x.shape[0] / inputs.shape[0]``, a
      chunk's share of the batch (open_lm's 1/N);
    - ``sum(losses) / len(losses)``, ``total / len(turns)`` after a loop adding a loss per turn: a
      mean over what one micro-step holds."""
    return bool(_WORLD_SIZE.search(ast.unparse(node.right))) or \
        _per_batch(node.right) and not _MEASURED.search(ast.unparse(node.left)) or \
        _per_device_mean(node, fn_node) or \
        mean_over(node.left, node.right, node, fn_node)


# one process's batch, by its configured name (CorrDiff's ``batch_size_per_gpu``): not the micro-steps'
# count, which EDM writes into ``batch_gpu_total`` (per GPU times the rounds)
_PER_DEVICE_BATCH = re.compile(r"^(?:[\w.]*\.)?(?:batch_size_per_(?:gpu|device|rank|proc)|"
                               r"per_(?:gpu|device)_(?:train_)?batch_size)$", re.I)


def _per_device_mean(node: ast.BinOp, fn_node=None) -> bool:
    """``loss.sum() / batch_size_per_gpu``: a sum over this process's samples made their mean. Not when
    the micro-steps' loop counts by that size (``for mb in range(batch_size_per_gpu // micro_batch_size)``:
    the size is the whole window's, and the division its 1/N, Lumina's)."""
    divisor = ast.unparse(node.right)
    if _PER_DEVICE_BATCH.search(divisor) is None or ".sum(" not in ast.unparse(node.left):
        return False
    line = getattr(node, "lineno", 0)
    if fn_node is not None and any(isinstance(loop, ast.For) and loop.lineno < line <= (loop.end_lineno or 0) and
                                   divisor in ast.unparse(loop.iter) for loop in walk(fn_node)):
        return False
    return True


def mean_over(numerator, divisor, at, fn_node) -> bool:
    """Is ``numerator / divisor`` a mean over a collection one micro-step holds? ``sum(xs) / len(xs)``;
    or ``total / len(turns)`` (``total /= len(turns)``) where ``total`` is added to in a loop over
    ``turns`` (or ``range(len(turns))``, ``enumerate(turns)``) of this function that has ended before
    ``at`` (a division inside that loop, ``loss / len(chunks)`` per chunk, is a share of the loop)."""
    if not (type(divisor) is ast.Call and type(divisor.func) is ast.Name and divisor.func.id == "len" and
            len(divisor.args) == 1 and not divisor.keywords):
        return False
    counted = _plain_text(divisor.args[0])
    if counted is None:
        return False
    if type(numerator) is ast.Call and type(numerator.func) is ast.Name and numerator.func.id == "sum" and \
            numerator.args and _plain_text(numerator.args[0]) == counted:
        return True
    total = _dotted(numerator)
    if total is None or fn_node is None:
        return False
    for loop in walk(fn_node):
        if type(loop) is not ast.For or _plain_text(_over(loop.iter)) != counted or \
                not loop.lineno <= getattr(at, "lineno", 0) or getattr(at, "lineno", 0) <= loop.end_lineno:
            continue
        if any(type(n) is ast.AugAssign and type(n.op) is ast.Add and _dotted(n.target) == total
               for n in walk(loop)):
            return True
    return False


def _plain_text(node) -> Optional[str]:
    """The text of a name, attribute chain or constant item of one (``batch["turns"]``); else None."""
    if type(node) is ast.Subscript:
        inner = _plain_text(node.value)
        return None if inner is None or type(node.slice) is not ast.Constant else f"{inner}[{node.slice.value!r}]"
    return _dotted(node) if node is not None else None


def _over(iterated):
    """What a loop goes over: ``turns`` for ``turns``, ``enumerate(turns)``, ``range(len(turns))``."""
    while type(iterated) is ast.Call and type(iterated.func) is ast.Name and iterated.args and \
            iterated.func.id in ("enumerate", "range", "len", "reversed"):
        if iterated.func.id == "range" and len(iterated.args) != 1:
            return None
        iterated = iterated.args[0]
    return iterated


def _per_batch(divisor) -> bool:
    """Does the divisor measure a tensor (``input_ids.shape[0]``, this micro-batch's own size) and name
    no count of micro-steps (events' scaling words: ``accum``, ``micro``, ``chunks``...)? A configured
    size may be the whole batch's (OLMo's ``ce_loss / batch_size_in_tokens``: a sum over the micro-steps'
    tokens, their 1/N), and a ratio of two may be the count itself."""
    text = ast.unparse(divisor)
    lower = text.lower()
    # (``loss / self.batch_split``: the micro-batches one batch is split into)
    return bool(_MEASURED.search(text) or _TOKENS_HERE.search(text)) and "split" not in lower and \
        not any(w in lower for w in _COUNT_WORDS)


_MEASURED = re.compile(r"\.shape\b|\.size\(|numel")
# ``loss.sum(1) / mask.sum(1)``, ``/ (labels != -100).sum()``: this micro-batch's own tokens counted
_TOKENS_HERE = re.compile(r"(?:mask|label|target|\.ne\(|!=)[^/]*\.sum\(", re.I)
