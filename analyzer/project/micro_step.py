"""Stage 6 of the pipeline (sync dataflow), events part 4: the micro-step's transfers.

How each event changes the state's properties (state.py), guard by guard: a forward records whether
DDP will all-reduce the next backward; a backward turns the pending forwards into a *token* (a
micro-step's gradients, synced or not, and by what); an optimizer step resolves the tokens of the
models it owns (a boundary), ``zero_grad`` wipes them, a sync flag write turns a model's sync on or
off, and a collective that syncs gradients by hand marks them synchronized. Each writes its record
(facts.py) for the rules.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.state import FROZEN, PLAIN, EnvVal, Forward, Token, sync_state, with_flag
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.values import ONE_UNKNOWN, Inner, Obj, Optim, Wrapper, site_of


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
    frozen = st.env.get(FROZEN)        # frozen for this phase: no gradient
    if frozen is not None:
        models = models - frozen.values
        if not models:
            return _val(ONE_UNKNOWN, _prov(*args, *kws.values()), False)
    prov = models | _prov(*args, *kws.values())
    if fr.no_grad:
        return _val(ONE_UNKNOWN)
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    managed = flow.program.managed_models()

    def transfer(prop, guard):
        if any(c.effect == "nograd" for c in prop.controls):
            yield prop, guard       # under ``torch.no_grad()`` entered on an ExitStack: no graph, no backward
            return
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


def inner_forward(flow, node, models: frozenset, args, kws, st, fr) -> EnvVal:
    """``ddp.module(x)``: a forward that bypasses the wrapper, so its backward all-reduces nothing
    (DDP prepares its reducer in its own forward). A forward through the wrapper already pending on a
    path (a second loss term through ``.module``) decides that path's backward instead."""
    prov = models | _prov(*args, *kws.values())
    if fr.no_grad:
        return _val(ONE_UNKNOWN)
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    flow.records.bypassed.add(site)

    def transfer(prop, guard):
        pending = {f.model for f in prop.forwards}
        forwards = list(prop.forwards)
        for model in sorted(models, key=repr):
            if model not in pending:
                forwards.append(Forward(model, "off", site, site))
                flow.records.forward(site, model, "off", site, prop.first, guard)
        yield prop._replace(forwards=tuple(forwards)), guard

    _each(st, transfer)
    return _val(ONE_UNKNOWN, prov, False)


def backward(flow, node, loss: Optional[EnvVal], via: str, st, fr, engines: frozenset = frozenset()) -> None:
    flow.records.node(site_of(fr.module, node), fr.module, node)
    site = flow.report_site(fr.module, node)
    models = engines or flow.program.wrappers(loss.prov if loss is not None else frozenset())
    report_module, report_node = flow.records.nodes[site]
    flow.records.backward(site, report_module, report_node, via, loss, fr)
    flow.records.stacks.setdefault(site, tuple(flow.call_stack))
    managed = flow.program.managed_models()

    loops = tuple(flow.loop_stack)
    # the models each optimizer in reach steps: one loss through an encoder and a decoder that one
    # optimizer steps together is one micro-step, not a GAN's generator loss through D
    together = []
    if len(models) > 1:
        for value in st.env.values():
            for v in value.values:
                if isinstance(v, Optim):
                    owned = _owned(flow, frozenset((v,)))
                    if owned:
                        together.append(owned)
        if _one_stepper(flow) or _stepped_side_by_side(flow):
            # one optimizer in the loop's function, whatever it owns (and whatever we could tell it
            # owns: zero123's ``AdamW(list(unet.parameters()) + list(cc_projection.parameters()))``);
            # or every optimizer stepped in one block (PPO's ``actor_optimizer.step();
            # critic_optimizer.step()`` after one loss through both): one micro-step of both models
            together.append(models)

    def transfer(prop, guard):
        pending = frozenset(f.model for f in prop.forwards)
        # the models this backward runs through: those its loss came from whose forward ran on this
        # path (``if distributed: model = DDP(model)`` makes it a DDP backward on that path only)
        mine = (models & pending) if models else pending - _detached_forwards(fr, prop.forwards, node)
        if models:
            # a forward whose result is thrown away (``student_model(ids)``, its states read back through
            # forward hooks, NVIDIA's distillation): what the loss is made of cannot rule it out
            mine |= frozenset(f.model for f in prop.forwards if _result_discarded(flow, f.site))
        if not mine:
            mine = frozenset((PLAIN,))
        tokens = list(prop.tokens)
        forwards = list(prop.forwards)
        # several models from one forward are alternatives (a helper called with a different DDP
        # model by each script), not one loss through several models (a GAN's generator loss)
        shared = len({f.site for f in forwards if f.model in mine}) > 1 and not any(mine <= o for o in together)
        # (a GAN's generator loss, ``D(G(z))``: G's own optimizer decides G's window; D's grads from it
        # are a by-product)
        first = next((f.model for f in forwards if f.model in mine), None)
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
            elif model.kind in vocab.FORWARD_DECIDES and not model.sharded and fwd is not None:
                synced, by = fwd.decided, fwd.by
            else:
                synced, by = now, now_by
            misses = model.kind == "ddp" or model.kind == "accelerate" or (model.kind == "fabric" and not model.sharded)
            # (a helper context around the forward that restores the flag on its way out wrote it after
            # the forward, but it is the same helper that set it for the forward: no miss)
            restored = fwd is not None and fwd.flag_after is not None and fwd.flag_after == fwd.by and \
                fwd.flag_after in flow.records.helper_flags
            # (``accelerator.accumulate(model)`` entered after the forward is as late as ``no_sync``)
            misses = misses and fwd is not None and not restored and (
                (fwd.decided == "on" and (now == "off" or (now == "managed" and now_by is not None)))
                or fwd.flag_after is not None)
            if misses:
                flow.records.misses_forward(now_by if fwd.flag_after is None else fwd.flag_after, site, model,
                                            "flag" if fwd.flag_after is not None and fwd.flag_after not in flow.records.helper_flags else "control",
                                            guard)
            outside = model.kind in vocab.FORWARD_DECIDES and not model.sharded and fwd is not None and \
                fwd.decided == "off" and now == "on"
            shared_here = shared and not (model == first and any(model in o and len(o) < len(mine) for o in together))
            tokens.append(Token(model, site, synced, by, outside, misses, loops, shared_here))
        yield prop._replace(tokens=tuple(tokens), forwards=tuple(forwards)), guard

    _each(st, transfer)


def _one_stepper(flow) -> bool:
    """Does the loop's function step one optimizer only (``opt.step()``, ``scaler.step(opt)``)? A GAN
    steps two (``opt_g.step()``, ``opt_d.step()``)."""
    key = ("one stepper",)
    if key not in flow.memo:
        names = set()
        for n in walk(flow.root_node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step":
                given = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "optimizer"), None)
                target = given if given is not None and _name(n.func.value).endswith("scaler") else n.func.value
                name = _name(target)
                if name and not any(w in name for w in ("sched", "lr", "ema", "warmup")):    # (_name lowercases)
                    names.add(name)
        flow.memo[key] = len(names) == 1
    return flow.memo[key]


def _stepped_side_by_side(flow) -> bool:
    """Does the loop's function step all its optimizers (two or more) in one block, one statement after
    another (``actor_optimizer.step(); critic_optimizer.step()``)? A GAN steps each after its own
    backward."""
    key = ("side by side",)
    if key not in flow.memo:
        blocks = set()
        count = 0
        for n in walk(flow.root_node):
            for field in ("body", "orelse"):
                block = getattr(n, field, None)
                if not isinstance(block, list):
                    continue
                steps = [i for i, st in enumerate(block)
                         if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and
                         isinstance(st.value.func, ast.Attribute) and st.value.func.attr == "step" and
                         not any(w in _name(st.value.func.value) for w in ("sched", "lr", "ema", "warmup"))]
                if steps:
                    blocks.add(id(block))
                    count += len(steps)
                    # (side by side: no backward between the first step and the last, as a GAN has)
                    if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "backward"
                           for st in block[steps[0]:steps[-1] + 1] for c in walk(st)):
                        blocks.add(None)
        flow.memo[key] = count >= 2 and len(blocks) == 1
    return flow.memo[key]


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
    # (after the loop: an optimizer of a plain module beside a wrapper's, one per caller, adds no model;
    # tested inside the loop, the answer hung on which of the two a frozenset gave first)
    return frozenset(out) if out else None


def step(flow, node, optims: frozenset, st, fr, unknown: bool = False) -> None:
    """``optimizer.step()``; ``unknown``: an optimizer we know only by its name, which, stepped inside
    ``accelerator.accumulate``, is one accelerate prepared (the context does nothing otherwise)."""
    site = site_of(fr.module, node)
    flow.records.node(site, fr.module, node)
    models = _owned(flow, frozenset(v for v in optims if isinstance(v, (Optim, Wrapper))))
    # an optimizer accelerate prepared steps, inside ``accelerator.accumulate``, only when
    # ``accelerator.sync_gradients`` holds: off the boundary the step is a no-op
    if unknown and not any(t.synced == "managed" for prop in st.props for t in prop.tokens):
        unknown = False         # no micro-step inside ``accumulate`` here: a plain step
    prepared = bool(optims) and all(isinstance(v, Optim) and v.managed for v in optims)
    managed = prepared or unknown
    gate = _sync_gradients_atom(flow) if managed else None
    # stepping each of several optimizers in a loop is one step, in the loops around that loop
    loops = tuple(i for i in flow.loop_stack if i not in flow.optimizer_loops)
    flow.records.loops_at.setdefault(site, set()).update(loops)
    flow.records.step_contexts.setdefault(site, set()).add(frozenset(loops))

    def transfer(prop, guard):
        flow.records.reached(site, guard)
        mine = [t for t in prop.tokens if models is None or t.model in models or t.model == PLAIN]
        # a prepared optimizer inside ``accelerator.accumulate(...)`` steps at the boundary only, for
        # every model it holds: the context sets accelerate's one ``sync_gradients`` for them all,
        # while it turns sync off only for the models it names (a GAN's ``accumulate(generator)``
        # leaves the discriminator all-reducing on every micro-step)
        inside = prepared and any(c.effect == "managed" for c in prop.controls) and not flow.accumulation_forbidden
        if gate is not None and (inside or any(t.synced == "managed" for t in mine)):
            branches = ((guard & flow.atoms.formula(gate, True), True), (guard & flow.atoms.formula(gate, False), False))
        else:
            branches = ((guard, True),)
        for g, taken in branches:
            if not g:
                continue
            kept = []
            for token in prop.tokens:
                if token in mine and (taken or (token.synced != "managed" and not inside)):
                    # a step in a loop the backward is not in (a later training phase) is no boundary of it
                    kind = "stepped" if loops == token.loops[:len(loops)] else "elsewhere"
                    flow.records.resolve(token, kind, site, g)
                else:
                    kept.append(token)
            yield prop._replace(tokens=tuple(kept)), g

    _each(st, transfer)


def _only_without_accumulation(fr, node) -> bool:
    """Is the call under ``if <accumulation count> == 1:`` in its function (llm-random's
    ``if self.gradient_accumulation_steps == 1: self.optimizer.zero_grad()``): run only when nothing
    accumulates, so it wipes no window? Not inside a loop of the same function, which may accumulate
    over something else than that count."""
    scope = getattr(fr.scope, "node", None)
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
            "accum" not in (fr.module.segment(scope) or "").lower():
        return False
    guarded = False
    for n in walk(scope):
        if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and any(x is node for x in walk(n)):
            return False    # (OpenNMT's truncated-BPTT chunks: a loop of its own accumulates, whatever the count)
        if isinstance(n, ast.If) and _one_micro_step(n.test) and any(x is node for s in n.body for x in walk(s)):
            guarded = True
    return guarded


def _one_micro_step(test) -> bool:
    """``accum == 1``, ``accum <= 1``, ``accum < 2`` (or ``1 == accum``) for a count named for accumulation."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(left, ast.Constant) and isinstance(op, ast.Eq):
        left, right = right, left
    if not isinstance(right, ast.Constant) or not _ACCUM_NAME.search(ast.unparse(left)):
        return False
    return isinstance(op, ast.Eq) and right.value == 1 or isinstance(op, ast.LtE) and right.value == 1 or \
        isinstance(op, ast.Lt) and right.value == 2


_ACCUM_NAME = re.compile(r"(?i)accum")


def _sync_gradients_atom(flow):
    atom = flow.atoms.get(("ACCELERATE_SYNC_GRADIENTS",), "accelerator.sync_gradients")
    if atom is not None:
        flow.note_atom(atom, (), True)
    return atom


def zero_grad(flow, node, vals: frozenset, st, fr, unknown: bool = False) -> None:
    """``zero_grad()`` on an optimizer or a model; ``unknown``: on an optimizer we know only by its
    name, which leaves alone the gradients of micro-steps inside ``accelerator.accumulate`` (see step).
    An optimizer accelerate prepared clears them only where ``accelerator.sync_gradients`` holds: on
    the boundary micro-step, which is where a ``zero_grad`` before the backward throws the window away."""
    if any(isinstance(v, Wrapper) and v.kind == "deepspeed" for v in vals) or _only_without_accumulation(fr, node):
        return
    prepared = any(isinstance(v, Optim) and v.managed for v in vals)
    if prepared and not any(c.effect == "managed" for prop in st.props for c in prop.controls):
        # not inside ``accelerator.accumulate``: a prepared optimizer's does nothing we model; a plain
        # one the same name holds on other runs (``self.optimizer``: DeepSpeed's, or the DDP path's) clears
        vals = frozenset(v for v in vals if not (isinstance(v, Optim) and v.managed))
        if not any(isinstance(v, Optim) for v in vals):
            return
        prepared = False
    if fr.module.linted:
        site = site_of(fr.module, node)
        flow.records.node(site, fr.module, node)
    else:
        # inside a wrapper class of a file not linted (a project ``Optimizer.zero_grad``): the call
        # the loop's file makes is where it is reported
        site = flow.report_site(fr.module, node)
        flow.records.node(site, fr.module, node)
    flow.records.loops_at.setdefault(site, set()).update(flow.loop_stack)
    optims = frozenset(v for v in vals if isinstance(v, Optim))
    direct = flow.program.models_of(frozenset(v for v in vals if isinstance(v, (Wrapper, Obj, Inner))))
    models = _owned(flow, optims) if optims else (direct or None)
    if prepared and models and all(isinstance(m, Wrapper) and m.kind == "deepspeed" for m in models):
        return      # ``Accelerator(deepspeed_plugin=...)``: the engine zeroes at its boundary; this is a no-op
    gate = _sync_gradients_atom(flow) if prepared else None
    if prepared and gate is None:
        return

    def transfer(prop, guard):
        if gate is not None and not any(c.effect == "managed" for c in prop.controls):
            yield prop, guard   # outside ``accelerator.accumulate`` (a DeepSpeed engine's optimizer): a no-op
            return
        if gate is not None:
            on = guard & flow.atoms.formula(gate, True)
            if guard & ~on:
                yield prop, guard & ~on
            guard = on
            if not guard:
                return
        flow.records.zeroed(site, guard)
        kept = []
        for token in prop.tokens:
            if (unknown and token.synced == "managed") or (gate is not None and token.synced != "managed"):
                kept.append(token)
            elif models is None or token.model in models or token.model == PLAIN:
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
    if fr.control:
        flow.records.helper_flags.add(site)     # a helper context that writes the flag and restores it
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
    if what in _TENSOR_REDUCTIONS and not _reduces_gradients(node, fr):
        return      # ``dist.all_reduce(sample_size_t)``: a statistic the ranks share, not the gradients

    def transfer(prop, guard):
        tokens = tuple(t._replace(synced="manual") if t.synced in ("off", "unknown") else t for t in prop.tokens)
        yield prop._replace(tokens=tokens), guard

    _each(st, transfer)


# collectives that sync gradients only when handed gradients (or parameters, or a flat buffer of them)
_TENSOR_REDUCTIONS = frozenset(("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor"))
_GRADIENT_WORDS = re.compile(r"grad|param|flat|bucket|buf|weight|coalesced|tensors|\bp\b|\bg\b", re.I)


def _reduces_gradients(node, fr) -> bool:
    """Is what this reduction is handed gradients (``p.grad``, ``flat_grads``, ``buckets``), by its
    words or by a loop over parameters or gradients around it? Not a loss, a sample size, a metric."""
    if not isinstance(node, ast.Call) or not (node.args or node.keywords):
        return True
    first = node.args[0] if node.args else node.keywords[0].value
    if _GRADIENT_WORDS.search(ast.unparse(first)):
        return True
    if isinstance(first, ast.Name) and first.id in getattr(fr.scope, "params", ()):
        return True     # a project's ``def all_reduce(tensor, group=None)``: whatever its callers hand it
    return any(isinstance(ctx.info.node, (ast.For, ast.AsyncFor)) and
               _GRADIENT_WORDS.search(ast.unparse(ctx.info.node.iter)) for ctx in fr.loops)


# The events stage's parts call one another: their names are imported last, once every part has
# defined its own, so the parts may be imported in any order.
from synccheck.analyzer.project.events import _prov, _val
from synccheck.analyzer.project.event_methods import _name


def _detached_forwards(fr, forwards, at) -> frozenset:
    """The models of pending forwards whose every output the function has since rebound to a copy cut
    from the graph (``teacher_reps, teacher_atts, _ = teacher(x)``, then ``teacher_reps = [t.detach()
    for t in teacher_reps]``, TinyBERT): a loss of unknown origin does not run back through them."""
    fn = getattr(fr.scope, "node", None)
    if fn is None or not forwards:
        return frozenset()
    line = getattr(at, "lineno", 0)
    cache = fr.__dict__.setdefault("_single_assigns", {})
    assigns = cache.get(id(fn))
    if assigns is None:
        assigns = cache[id(fn)] = [n for n in walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1]
    out = set()
    for f in forwards:
        if f.site[0] != fr.module.path:
            continue
        made = next((a for a in assigns if a.lineno <= f.site[1] <= (a.end_lineno or a.lineno)), None)
        if made is None:
            continue
        target = made.targets[0]
        names = [e.id for e in (target.elts if isinstance(target, ast.Tuple) else [target])
                 if isinstance(e, ast.Name) and e.id != "_"]
        if names and all(any(_cuts(a, name) and made.lineno < a.lineno < line for a in assigns) for name in names):
            out.add(f.model)
    return frozenset(out)


def _cuts(assign: ast.Assign, name: str) -> bool:
    """``name = name.detach()`` or ``name = [t.detach() for t in name]``."""
    from synccheck.analyzer.project.events import _detached_element
    target, value = assign.targets[0], assign.value
    if not (isinstance(target, ast.Name) and target.id == name):
        return False
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)) and len(value.generators) == 1:
        gen = value.generators[0]
        return isinstance(gen.iter, ast.Name) and gen.iter.id == name and _detached_element(value.elt, gen.target)
    return _detached_element(value, ast.Name(id=name))


def _result_discarded(flow, site) -> bool:
    """Is the forward call at ``site`` a statement by itself, its result unused? (The positions of a
    module's statement calls are indexed once per module.)"""
    module = flow.program.project.module_at(site[0])
    if module is None or len(site) < 3:
        return False
    positions = module.derived.get("statement calls")
    if positions is None:
        positions = module.derived["statement calls"] = frozenset(
            (stmt.value.lineno, stmt.value.col_offset) for stmt in walk(module.tree)
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))
    return (site[1], site[2]) in positions
