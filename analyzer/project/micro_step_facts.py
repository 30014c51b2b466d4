"""Stage 7, part 2: what each rule asks of the micro-steps (facts.py groups them by model and loop):
steps on unsynced gradients (SC103), wasted all-reduces (SC101), windows wiped by ``zero_grad``
(SC201), backwards whose micro-steps accumulate (SC202), controls entered after the forward (SC102),
a static graph's first micro-step off (SC106)."""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.facts import (NON_BOUNDARY, _gated_window, _late_wipes, _outside, assignments,
                                              exists, populations)
from synccheck.analyzer.project.definitions import enclosing_function
from synccheck.analyzer.project.state import PLAIN
from synccheck.analyzer.project.traversal import walk


def unsynced_steps(flow) -> list:
    """(step site, token, population, group) where every boundary micro-step of a gate group steps
    on gradients that were never all-reduced: SC103's fact."""
    out = []
    for pop in populations(flow):
        if not pop.data_parallel:
            continue
        found = _unsynced_group(flow, pop, pop.groups(("stepped",)), True)
        for switches in _unsynced_splits(flow, pop):
            if found is not None:
                break
            found = _unsynced_group(flow, pop, pop.groups(("stepped",), split=switches), False)
            if found is not None:
                pop.switches = switches
        if found is not None:
            out.append(found)
    return out


def _unsynced_splits(flow, pop):
    """More atoms to tell the step's outcomes apart by, tried in turn when the gate alone finds no
    unsynced boundary."""
    # ``no_sync() if args.grad_accum > 1 else nullcontext()``: where the run accumulates, every
    # boundary is unsynced (with one micro-step per step there is nothing to get wrong)
    switches = _accumulation_switches(flow, pop)
    if switches:
        yield switches
    if not pop.gate and not any(across for _, kind, _, across, _ in pop.records if kind == "stepped"):
        # no accumulation: the optimizer steps after every batch, but sync is off on every N-1 of
        # N (``no_sync() if (step + 1) % interval != 0``, a "sync every N batches" option without
        # any averaging of the parameters): those steps apply each rank's own gradients. (Every
        # micro-step is stepped in its own iteration: none waits for a later one's step.)
        periodic = [a.index for a in flow.atoms.atoms if a.mod is not None]
        if periodic:
            yield periodic


def _unsynced_group(flow, pop, groups: dict, by_gate: bool) -> Optional[tuple]:
    for group, outcomes in groups.items():
        if outcomes and (all(t.synced == "off" for t, _, _ in outcomes) or
                         (by_gate and _synced_on_last_only(pop, group))) and \
                not any(t.misses_forward and t.by is not None and _is_flag(flow, t.by) for t, _, _ in outcomes):
            token, _, resolver = sorted(outcomes, key=repr)[0]
            return resolver, token, pop, group
    return None


# ``args.grad_accum > 1``, ``self.accum_steps != 1``: whether the run accumulates at all
_ACCUMULATES = re.compile(r"^\s*(?:not\s+)?\(?\s*[\w.\[\]'\"]+\s*(?:>|!=|>=|==|<=|<)\s*[12]\s*\)?\s*$")
# nanoGPT's ``micro_step == accum - 1`` with the micro-step written as 0 (``0 == accum - 1``): a
# constant, however often it is computed again (baby-llama2-chinese's flag, set before every forward)
_CONSTANT_LAST = re.compile(r"^\s*\(?\s*0\s*==\s*[\w.\[\]'\"]+\s*-\s*1\s*\)?\s*$|"
                            r"^\s*\(?\s*[\w.\[\]'\"]+\s*-\s*1\s*==\s*0\s*\)?\s*$")


def _accumulation_switches(flow, pop) -> list:
    """Atoms of tests on the accumulation count against 1 (``accum > 1``), on values the loop does
    not change: they hold all run."""
    from synccheck.analyzer.project.branches import _COUNT_WORDS
    out = []
    for atom, volatile in _plain_atoms(flow, pop):
        # (a test in a method the loop calls reads the caller's objects: ``self.accum > 1`` holds all run)
        stable = not volatile or (isinstance(atom.key, tuple) and atom.key[:1] == ("STABLE",))
        if _COUNT_WORDS.search(atom.text) and (stable and _ACCUMULATES.match(atom.text) or
                                               _CONSTANT_LAST.match(atom.text)):
            out.append(atom.index)
    return out


def _plain_atoms(flow, pop):
    """(atom, volatile) for the atoms of plain tests: not the gate's, not a mod form, a loop's last
    turn or a first-iteration test."""
    for atom in flow.atoms.atoms:
        if atom.index in pop.gate or atom.mod is not None or atom.loop is not None or atom.first is not None:
            continue
        yield atom, flow.atom_info.get(atom.index, ((), True))[1]


def _synced_on_last_only(pop, group: int) -> bool:
    """At the boundaries of a counter gate (``(i + 1) % accum == 0``), is sync on only on the loop's
    last iteration (``model.no_sync() if i < n - 1 else nullcontext()``)? Every other boundary then
    steps on gradients never all-reduced."""
    atoms = pop.flow.atoms.atoms
    last = [a.index for a in atoms if a.loop is not None and a.loop == pop.loop]
    if len(last) != 1 or not any(atoms[k].mod is not None for k in pop.gate):
        return False
    gate_bits = 0
    for k in pop.gate:
        gate_bits |= 1 << k
    last_bit = 1 << last[0]
    universe = pop.flow.atoms.universe & pop.width_mask
    unsynced = False
    for token, kind, _, _, guard in pop.records:
        if kind != "stepped":
            continue
        for a in assignments(guard & universe):
            if a & gate_bits != group or a & last_bit:
                continue
            if token.synced != "off":
                return False            # a boundary before the last one syncs
            unsynced = True
    return unsynced


def wasted(flow) -> list:
    """(backward site, model, population, group) where every accumulating micro-step of a gate group
    all-reduced its gradients, all but the boundary's for nothing: SC101's fact."""
    out = []
    unsynced = {id(pop) for _, _, pop, _ in unsynced_steps(flow)}
    for pop in populations(flow):
        if not pop.data_parallel or not pop.accumulating or id(pop) in unsynced:
            continue
        if any(t.misses_forward or t.forward_outside for t, *_ in pop.records):
            continue
        found = _all_synced(pop, pop.groups(NON_BOUNDARY))
        if found is None:
            # ``if self.use_amp: with self.sync_ctx(sync): ... else: loss.backward()``: a switch that
            # holds all run may leave one of its sides without a control
            switches = _run_switches(flow, pop)
            found = _all_synced(pop, pop.groups(NON_BOUNDARY, split=switches)) if switches else None
            if found is not None:
                pop.switches = switches
        if found is not None:
            out.extend(found)
    return out


def repeated_in_one_step(flow) -> list:
    """(backward site, model, the later backward's site) where a DDP model runs a backward, then another
    backward after a forward of its own, and only then the optimizer steps, with no sync control
    between: the first all-reduce is wasted (a GAN's discriminator on real images, then on fakes).
    SC101's straight-line form: no loop makes these micro-steps, one iteration runs them all."""
    resolutions = flow.records.resolutions
    stepped = {(t.site, t.model) for (t, kind, _, _), guard in resolutions.items() if kind == "stepped" and guard}
    in_loops = {site for site, *_ in wasted(flow)}
    # (a model whose sync is controlled somewhere here: the author saves its all-reduces already, and
    # the boundary's double all-reduce of a no_sync window over both is the window's, not this rule's)
    controlled = {t.model for (t, *_), guard in resolutions.items() if guard and t.synced != "on"}
    out = []
    for (token, kind, later, across), guard in resolutions.items():
        model = token.model
        if kind != "superseded" or across or not guard or model == PLAIN or later == token.site:
            continue
        if model.kind != "ddp" or getattr(model, "single", False) or token.site in in_loops or model in controlled:
            continue
        if token.synced != "on" or token.shared or token.misses_forward or token.forward_outside:
            continue
        if (later, model) not in stepped or not _straight_between(flow, token.site, later):
            continue
        out.append((token.site, model, later))
    return sorted(set(out), key=lambda found: found[0])


# a call between the two backwards that may step or use the gradients (SAM's ``first_step``, a
# clip-and-step helper): the first backward's all-reduce is then needed
_USES_GRADIENTS = re.compile(r"step\w*\s*\(|\.grad\b|clip\w*\s*\(|unscale|all_reduce|zero_grad|retain_graph", re.I)


def _straight_between(flow, first, later) -> bool:
    """Are both backwards in one function's body, the later one after the first, with nothing between
    them (the first one's call included) that steps or reads the gradients? Or each in a method that
    one function calls, the first call before the second (a GAN's ``_d_real(real)`` then
    ``_d_fake(n)``), with nothing that steps or reads the gradients between the two backwards?"""
    a, b = flow.records.nodes.get(first), flow.records.nodes.get(later)
    if a is None or b is None or a[1] is None or b[1] is None:
        return False
    if a[0] is b[0] and _text_between(a[0], a[1].lineno, b[1].lineno) is not None and \
            enclosing_function(a[0], a[1]) is enclosing_function(b[0], b[1]):
        text = _text_between(a[0], a[1].lineno, b[1].lineno)
        return not _USES_GRADIENTS.search(text) and "def " not in text
    sa, sb = flow.records.stacks.get(first), flow.records.stacks.get(later)
    if sa is None or sb is None:
        return False
    k = 0
    while k < len(sa) and k < len(sb) and sa[k][1] is sb[k][1]:
        k += 1
    rest_a, rest_b = sa[k:], sb[k:]
    if len(rest_a) > 1 or len(rest_b) > 1 or not (rest_a or rest_b):
        return False
    ca, cb = (rest_a[0] if rest_a else a), (rest_b[0] if rest_b else b)
    if ca[0] is not cb[0] or enclosing_function(ca[0], ca[1]) is not enclosing_function(cb[0], cb[1]):
        return False
    between = _text_between(ca[0], ca[1].lineno, cb[1].lineno)
    if between is None or _USES_GRADIENTS.search(between) or "def " in between:
        return False
    if rest_a:      # the rest of the first backward's function, after it
        fn = enclosing_function(a[0], a[1])
        after = _text_between(a[0], a[1].lineno + 1, (fn.node.end_lineno or a[1].lineno) + 1) if fn else None
        if fn is None or after is None or _USES_GRADIENTS.search(after):
            return False
    if rest_b:      # the second backward's function, up to it
        fn = enclosing_function(b[0], b[1])
        before = _text_between(b[0], fn.node.body[0].lineno, b[1].lineno) if fn else None
        if fn is None or before is None or _USES_GRADIENTS.search(before) or "def " in before:
            return False
    return True


def _text_between(module, start: int, end: int):
    """The module's lines ``start`` to ``end`` (not included), comments dropped; None if empty."""
    if not start < end:
        return None
    lines = module.text.splitlines()[start - 1:end - 1]
    return "\n".join(line.split("#", 1)[0] for line in lines)


def _all_synced(pop, groups: dict) -> Optional[list]:
    """The backwards of every gate group whose micro-steps all sync (each side of ``if use_apex:
    scaler.scale(loss).backward() ... else: loss.backward()`` is reported); None when no group does."""
    out, seen = [], set()
    for group, outcomes in groups.items():
        if outcomes and all(t.synced == "on" for t, _, _ in outcomes):
            out += [(site, pop.model, pop, group) for site in sorted({t.site for t, kind, _ in outcomes})
                    if site not in seen]
            seen.update(t.site for t, _, _ in outcomes)
    return out or None


# a switch about the wrapper or its sync (``has_no_sync``, ``args.data_parallel in ["sdp", "fsdp"]``)
# decides whether there is a control to use: its other side has none to forget
_WRAPPER_WORDS = re.compile(r"sync|parallel|ddp|fsdp|sdp|shard|strateg|deepspeed|zero|accelerat|fabric|wrap", re.I)


def _run_switches(flow, pop) -> list:
    """Atoms of plain tests that hold all run (``self.use_amp``, ``args.fp16``): not the gate's, not
    counts, loop turns or ranks, and tested on values the loop does not change."""
    from synccheck.analyzer.project.branches import _COUNT_WORDS
    from synccheck.analyzer.project.rank_tests import DISTRIBUTED_TEST, RANK_NAME
    out = []
    for atom, volatile in _plain_atoms(flow, pop):
        if volatile or _COUNT_WORDS.search(atom.text) or RANK_NAME.search(atom.text) or \
                DISTRIBUTED_TEST.search(atom.text) or _WRAPPER_WORDS.search(atom.text) or "(" in atom.text:
            continue
        if _chooses_the_backward(flow, pop, atom.index):
            out.append(atom.index)
    return out


def _chooses_the_backward(flow, pop, k: int) -> bool:
    """Do the micro-steps where atom k holds run other backwards than where it fails (``if use_amp:
    scaler.scale(loss).backward() else: loss.backward()``)? A switch that only picks a VAE or a log
    line tells no micro-steps apart."""
    universe = flow.atoms.universe & pop.width_mask
    sides: tuple = (set(), set())
    for token, kind, _, _, guard in pop.records:
        if kind not in NON_BOUNDARY:
            continue
        for a in assignments(guard & universe):
            sides[a >> k & 1].add(token.site)
    return bool(sides[0]) and bool(sides[1]) and sides[0] != sides[1]


def _is_flag(flow, site) -> bool:
    module, node = flow.records.nodes.get(site, (None, None))
    return node is not None and type(node).__name__ in ("Assign", "AnnAssign")


def wiped(flow) -> list:
    """(zero_grad site, token, population, group, at_boundary) where every accumulating micro-step of a
    gate group has its gradients thrown away before the step: SC201's fact. Also (``at_boundary``) a zero_grad that clears only
    where the step comes, before that micro-step's backward (``if boundary: zero_grad()`` at the top
    of the iteration, a prepared optimizer's ``zero_grad()`` first thing inside
    ``accelerator.accumulate``): the window's earlier micro-steps are wiped at every step."""
    out = []
    for pop in populations(flow):
        if not pop.stepped and not pop.records:
            found = _wiped_every_turn(flow, pop)
            if found is not None:
                out.append(found)
            continue
        if not pop.stepped or not pop.accumulating:
            continue
        late = _late_wipes(flow, pop)
        if late is not None:
            out.append(late)
            continue
        hand = flow.program.managed_models()
        if not any(kind == "wiped" and (across or _gated_window(t, hand)) for t, kind, _, across, _ in pop.records):
            continue
        # a switch that holds all run (``if self.accum_count == 1: optim.zero_grad()``) wipes every
        # micro-step of the runs where it is on
        boundary = flow.atoms.by_key.get(("ACCELERATE_SYNC_GRADIENTS",))
        for group, outcomes in pop.groups(NON_BOUNDARY, split=sorted(flow.records.switches)).items():
            if boundary is not None and pop.managed and group >> boundary.index & 1:
                # where ``accelerator.sync_gradients`` holds, the micro-step is the window's last: a
                # zero_grad there that no step follows drops the window on purpose (a NaN skip)
                continue
            if outcomes and all(kind == "wiped" for _, kind, _ in outcomes):
                for token, kind, resolver in sorted(outcomes, key=repr):
                    out.append((resolver, token, pop, group, False))
                break
        else:
            found = _wiped_at_boundary(flow, pop)
            if found is not None:
                out.append(found)
    return out


def _wiped_every_turn(flow, pop) -> Optional[tuple]:
    """nanoGPT's "flush the gradients" ``zero_grad()`` indented into the micro-step loop: every
    micro-step's gradients, the last one's included, are wiped in their own turn, and the step comes
    after the loop, on nothing. (at_boundary "all")"""
    wipes = [r for r in pop.late_wipes if r[0].site is not None]
    if not wipes:
        return None
    token, kind, resolver, across, guard = sorted(wipes, key=repr)[0]
    # the step in a loop around this one (after it, in the same turn): not a later, separate loop's
    around = set(flow.records.loops_at.get(resolver, ())) - {pop.loop}
    if not any(_outside(flow, s, pop.loop) and flow.records.loops_at.get(s) and
               set(flow.records.loops_at[s]) <= around for s in flow.records.reach):
        return None
    return resolver, token, pop, 0, "all"


def _wiped_at_boundary(flow, pop) -> Optional[tuple]:
    """A zero_grad that clears only where the step is reached wiped a micro-step of an earlier turn
    (one that agrees with it on the tests that do not change from turn to turn: ``if args.deepspeed``
    sends every turn the same way)."""
    if flow.atoms.overflowed:
        # a test past the atom table is modelled as either way: a step behind it looks reached on
        # every micro-step, and "only where the step is reached" would be said of any zero_grad
        return None
    universe = flow.atoms.universe & pop.width_mask
    steps = 0
    for token, kind, resolver, across, guard in pop.records:
        if kind == "stepped":
            steps |= flow.records.reach.get(resolver, 0)
    steps &= universe
    info = flow.loop_infos.get(pop.loop)
    turning = [a.index for a in flow.atoms.atoms
               if info is None or flow._loop_dependent(a, info) and not flow.holds_through(a, info)]

    def fixed(formula: int) -> int:
        for k in turning:
            formula = exists(formula, k)
        return formula & universe

    for token, kind, resolver, across, guard in sorted(pop.records, key=repr):
        if kind != "wiped" or not (across or _gated_window(token, flow.program.managed_models())):
            continue
        if _skips_the_turn(flow, resolver):
            continue
        ran = flow.records.zero_ran.get(resolver, 0) & universe
        # (judged where it wipes a micro-step when it is written before that backward: ``if boundary:
        # zero_grad()`` then ``if use_plain: backward() ... step()``, a run with ``use_plain`` off has
        # nothing to wipe and no step, Metric3D; one written after the backward clears what was stepped)
        where = ran & guard if _written_before(resolver, token.site) else ran
        if ran and not where & ~steps and fixed(ran) & fixed(guard):
            return resolver, token, pop, 0, True
    return None


def _skips_the_turn(flow, site) -> bool:
    """Is the zero_grad at ``site`` in a block that then leaves the turn (``if not isfinite(loss):
    optimizer.zero_grad(); continue``)? It drops a window on purpose, before no backward of its own."""
    found = flow.records.nodes.get(site)
    if found is None or found[0] is None or found[1] is None:
        return False
    module, node = found
    for n in walk(module.tree):
        for field in ("body", "orelse"):
            block = getattr(n, field, None)
            if isinstance(n, ast.If) and isinstance(block, list) and block and \
                    isinstance(block[-1], (ast.Continue, ast.Break, ast.Return, ast.Raise)) and \
                    any(isinstance(st, ast.Expr) and st.value is node for st in block):
                return True
    return False


def _written_before(a, b) -> bool:
    """Is site ``a`` (path, line, column) a line of the same file above site ``b``?"""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[1]


def accumulating_backwards(flow) -> list:
    """(site, Backward, model) of backwards whose micro-steps accumulate (the next backward comes before
    the step, in a later iteration) in a loop that steps: SC202's subject."""
    out, done = [], set()
    for pop in populations(flow):
        if not pop.accumulating or pop.managed:
            continue
        for token, kind, resolver, across, guard in pop.records:
            if token.site in done or kind not in NON_BOUNDARY:
                continue
            info = flow.records.backwards.get(token.site)
            if info is not None:
                done.add(token.site)
                out.append((token.site, info, pop.model))
    return out


def missed_forward(flow) -> list:
    """(control or flag site, backward site, model, kind) of DDP controls that cover a backward but
    not its forward (SC102's fact)."""
    return [key for key, guard in flow.records.missed.items() if guard and key[0] is not None]


def first_iteration_off(flow) -> list:
    """(forward site, model, by) where a static_graph DDP model's very first forward runs with sync
    off (SC106's fact)."""
    out = []
    repeated = None
    for (site, model, decided, by, first, loops), guard in flow.records.forwards.items():
        if model == PLAIN or model.kind != "ddp" or not model.static_graph or decided != "off" or by is None:
            continue
        if by == site and site in flow.records.bypassed:
            continue        # a forward past the wrapper (SC103's): the reducer is not touched, sync not turned off
        if repeated is None:
            repeated = _called_in_a_loop(flow)
        if repeated:
            # ``train_step`` called once per batch: its loop's first turn is not training's first
            # micro-step (a count the object keeps may have moved on); its caller's flow judges that
            break
        if not loops or not set(loops) <= set(first):
            continue
        if guard & flow.first_mask(first):
            out.append((site, model, by))
    return out


def _called_in_a_loop(flow) -> bool:
    """Is the root a function some loop of the project calls (``for batch in loader: trainer.train_step(batch)``)?"""
    from synccheck.analyzer.project.definitions import Function
    if not isinstance(flow.root, Function):
        return False
    for scope, call, _ in flow.values.callers(flow.root):
        node = scope.node if isinstance(scope, Function) else getattr(scope, "tree", None)
        if node is None:
            continue
        for loop in ast.walk(node):
            if isinstance(loop, (ast.For, ast.AsyncFor, ast.While)) and \
                    loop.lineno < call.lineno <= (loop.end_lineno or loop.lineno):
                return True
    return False

