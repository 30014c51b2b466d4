"""Stage 7: the facts rules query, read off the sync dataflow's records (the queries themselves:
micro_step_facts.py).

A *micro-step* is one trip through a loop that runs a backward. Its backward leaves a token (see
state.py); how that token is resolved says what kind of micro-step it was:

* ``stepped``: the optimizer stepped next -- a *boundary* micro-step;
* ``superseded``: the next backward of the same model came first -- an *accumulating* micro-step
  (and its all-reduce, if DDP did one, was wasted);
* ``wiped``: ``zero_grad`` came first -- its gradients were thrown away.

Verdicts are drawn per *group*: the assignments of the conditions that decide whether this backward
is followed by a step (its gate). A verdict must hold on every assignment of a group -- every path
that agrees on the gate -- so a condition unrelated to the schedule (``if log_this_step:``) never
produces a finding on its own, while an off-by-one between the sync condition and the step's
condition, which excludes the synced case on the boundary, does.
"""
from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
# the gradient-cache idiom: in gradient_cache.py (window_cache stays importable from here)
from synccheck.analyzer.project.gradient_cache import window_cache
from synccheck.analyzer.project.guards import MAX_ATOMS, assignments, depends_on, exists
from synccheck.analyzer.project.state import PLAIN
from synccheck.analyzer.project.type_tests import _distributed_value


class Backward(NamedTuple):
    module: object
    node: object
    via: str
    scaled: Optional[bool]
    window: bool = False     # its loop recomputes a loss over the whole window's cached outputs (SC202)


class Records:
    """What one Flow saw. Guards OR together across the fixpoint's rounds."""

    def __init__(self, flow) -> None:
        self.flow = flow
        self.nodes: dict = {}            # site -> (module, node)
        self.resolutions: dict = {}      # (token, kind, resolver site, across a loop?) -> guard
        self.reach: dict = {}            # step site -> guard
        self.zero_ran: dict = {}         # zero_grad site -> guard where it clears gradients
        self.forwards: dict = {}         # (site, model, decided, by, first, enclosing loops) -> guard
        self.backwards: dict = {}        # site -> Backward
        self.missed: dict = {}           # (control or flag site, backward site, model, kind) -> guard
        self.loops_at: dict = {}         # zero_grad / step site -> ids of the loops it ran in (callers' included)
        self.stacks: dict = {}           # backward site -> the calls it was first reached through
        self.step_contexts: dict = {}    # step site -> the sets of loops around each run of it (a helper's
                                         # step called in the loop and again after it: two contexts)
        self.window_loops: dict = {}     # loop id -> whether it is a gradient-cache loop (see window_cache)
        self.switches: set = set()       # stable atoms of the tests that guard a zero_grad (Flow.if_)
        self.helper_flags: set = set()   # with-item sites of helper contexts that write the DDP flag
        self.bypassed: set = set()       # forward sites that call the module inside a DDP wrapper
        self.recounted: dict = {}        # accumulate() site -> the accumulate() of the same accelerator it is inside

    def node(self, site, module, node) -> None:
        self.nodes.setdefault(site, (module, node))

    def resolve(self, token, kind: str, site, guard: int) -> None:
        g = guard
        if token.frozen is not None:
            # a micro-step of an earlier turn: its own condition, and the switches that hold all run
            # and decide whether a zero_grad runs (``if self.accum_count == 1:``) as the resolver found them
            g = token.frozen
            if self.switches:
                now = guard
                for k in range(len(self.flow.atoms.atoms)):
                    if k not in self.switches:
                        now = exists(now, k)
                g &= now
        key = (token._replace(frozen=None), kind, site, token.frozen is not None)
        self.resolutions[key] = self.resolutions.get(key, 0) | g

    def zeroed(self, site, guard: int) -> None:
        self.zero_ran[site] = self.zero_ran.get(site, 0) | guard

    def reached(self, site, guard: int) -> None:
        self.reach[site] = self.reach.get(site, 0) | guard

    def forward(self, site, model, decided, by, first, guard: int) -> None:
        key = (site, model, decided, by, first, tuple(self.flow.loop_stack))
        self.forwards[key] = self.forwards.get(key, 0) | guard

    def backward(self, site, module, node, via: str, loss, fr) -> None:
        scaled = loss.scaled if loss is not None else None
        old = self.backwards.get(site)
        if old is not None:
            # scaled on some path (or unknown) is scaled: only a loss undivided everywhere is reported
            if old.scaled is not False or scaled is not False:
                scaled = True if (old.scaled or scaled) else None
        window = self._window(self.flow.loop_stack[-1] if self.flow.loop_stack else None)
        self.backwards[site] = Backward(module, node, via, scaled, window or (old is not None and old.window))

    def _window(self, loop) -> bool:
        if loop is None:
            return False
        known = self.window_loops.get(loop)
        if known is None:
            info = self.flow.loop_infos.get(loop)
            owner = self.flow.loop_owner.get(loop)
            known = info is not None and owner is not None and window_cache(owner[0], info.node)
            self.window_loops[loop] = known
        return known

    def misses_forward(self, by, site, model, kind: str, guard: int) -> None:
        key = (by, site, model, kind)
        self.missed[key] = self.missed.get(key, 0) | guard


# ---------------------------------------------------------------------------------------------------
# queries

NON_BOUNDARY = ("superseded", "wiped")


class Population:
    """The micro-steps of one model in one loop: the tokens of every backward it runs there, and
    how they were resolved, grouped by the step's gate."""

    def __init__(self, flow, model, loop, records: list) -> None:
        self.flow = flow
        self.model = model
        self.loop = loop
        # (token, kind, resolver, across, guard). Only what happens *between* micro-steps tells their
        # kind: a backward superseded within its own iteration (two losses of one step, a GAN's
        # generator loss through D) says nothing about accumulation, nor does a shared backward.
        # Under ``accelerator.accumulate`` the step itself is gated, so a wipe later in the same
        # iteration (``model.zero_grad()`` after ``optimizer.step()``) throws the window away.
        # (Not for a model whose sync is managed by hand, local SGD's parameter averaging: its step is
        # not gated, and a zero_grad after it wipes nothing of a window.)
        hand = flow.program.managed_models()
        for k, tested in flow.type_atoms.items():
            if model in tested:
                # ``if enabled and isinstance(net, DDP): with net.no_sync()`` in a helper handed this
                # wrapper (or a plain module on other runs): for this model's micro-steps the test holds
                holds = flow.atoms.formula(flow.atoms.atoms[k], True)
                records = [r[:4] + (r[4] & holds,) for r in records if r[4] & holds]
        if getattr(model, "kind", None) in ("ddp", "fsdp", "apex"):
            # ``model.no_sync() if args.distributed and last else nullcontext()``: a DDP wrapper exists
            # only in a distributed job, so for its micro-steps a test of being distributed holds
            for atom in flow.atoms.atoms:
                value = _distributed_value(atom.text)
                if value is not None:
                    holds = flow.atoms.formula(atom, value)
                    kept = [r[:4] + (r[4] & holds,) for r in records if r[4] & holds]
                    records = kept if kept else records
        all_records = records
        records = [r for r in records if r[1] == "stepped" or (r[3] and not r[0].shared)
                   or (r[1] == "wiped" and _gated_window(r[0], hand) and not r[0].shared)]
        # a zero_grad outside the micro-steps' loop (at the top of each epoch) drops an unfinished
        # window at the epoch's end; it does not wipe micro-steps
        records = [r for r in records if r[1] != "wiped" or _inside(flow, r[2], loop)]
        # A ``zero_grad()`` that is a statement of the loop's own body, after the ``if boundary: step()``
        # block, wipes each micro-step later in its own iteration: kept apart (wiped() reads them), as
        # the same wipe where the step came clears what was just stepped
        self.late_wipes = [r for r in all_records if r[1] == "wiped" and not r[3] and not r[0].shared
                           and not _gated_window(r[0], hand) and _in_loop_body(flow, r[2], loop)]
        self.records = records
        self.switches: list = []        # more atoms its findings' groups were told apart by (wasted)
        atoms = len(flow.atoms.atoms)
        self.width_mask = (1 << (1 << atoms)) - 1 if atoms < MAX_ATOMS else -1
        stepped = 0
        for token, kind, resolver, across, guard in records:
            if kind == "stepped":
                stepped |= guard
        self.stepped = stepped & self.width_mask
        # (``it == 0`` picks one micro-step, the very first: no schedule of steps is made of it)
        self.gate = [a.index for a in flow.atoms.atoms if depends_on(self.stepped, a.index) and a.first is None]
        # a step gated by a counter (``(i + 1) % n == 0``, the last micro-step, ``micro == accum``)
        # means to accumulate; one gated by any other test (``if should_update(...)``) skips steps
        # the gate's counting tests, as bits of an assignment
        self.counting = 0
        for k in self.gate:
            if _periodic(flow.atoms.atoms[k], loop):
                self.counting |= 1 << k
        self.periodic = bool(self.counting) or any(
            # one step after the micro-steps' loop (a chunk loop inside the iteration): once per run of it
            # (also where the same helper steps in the loop too: FlowERrs' ``_optimize`` for the remainder)
            kind == "stepped" and (_outside(flow, resolver, loop) or _run_outside(flow, resolver, loop))
            for _, kind, resolver, _, _ in records)
        kinds = {kind for token, kind, _, across, _ in records if across or _gated_window(token, hand)}
        # gradients wiped between iterations under a non-counting gate: steps are skipped, not
        # accumulated, whatever else the paths through the iteration do
        self.accumulating = bool(self.stepped) and (
            ("superseded" in kinds and (self.periodic or "wiped" not in kinds)) or
            (("wiped" in kinds or self.late_wipes) and self.periodic))

    @property
    def data_parallel(self) -> bool:
        m = self.model
        return m != PLAIN and m.kind in vocab.DATA_PARALLEL and not m.single and \
            not _sharded_elsewhere(self.flow, m) and m not in self.flow.program.frozen_models()

    @property
    def managed(self) -> bool:
        return any(t.synced == "managed" for t, *_ in self.records)

    def groups(self, kinds=None, split=()) -> dict:
        """gate assignment -> {(token, kind, resolver)} of the records (of these kinds) holding on it.
        ``split``: more atoms to tell groups apart by (configuration switches, which hold all run)."""
        gate_bits = 0
        for k in list(self.gate) + list(split):
            gate_bits |= 1 << k
        out: dict = {}
        universe = self.flow.atoms.universe & self.width_mask
        for token, kind, resolver, across, guard in self.records:
            if kinds is not None and kind not in kinds:
                continue
            for a in assignments(guard & universe):
                out.setdefault(a & gate_bits, set()).add((token, kind, resolver))
        return out

    def describe(self, group: int) -> str:
        return self.flow.atoms.describe_assignment(group, list(self.gate) + list(self.switches))


def _late_wipes(flow, pop) -> Optional[tuple]:
    """(zero_grad site, token, population, group, False) when, in a group of the gate's counting tests
    where no step comes, every micro-step is wiped later in its own iteration (``zero_grad()`` after the
    ``if boundary: step()`` block, on every turn); None otherwise."""
    if not pop.late_wipes or not pop.periodic:
        return None
    counting = pop.counting
    if not counting:
        return None
    stepping = {g & counting for g in pop.groups(("stepped",))}
    universe = flow.atoms.universe & pop.width_mask
    by_group: dict = {}
    for token, kind, resolver, across, guard in pop.records + pop.late_wipes:
        if kind == "stepped":
            continue
        for a in assignments(guard & universe):
            by_group.setdefault(a & counting, []).append((token, kind, resolver))
    for group, outcomes in sorted(by_group.items()):
        if group in stepping:
            continue
        if outcomes and all(kind == "wiped" for _, kind, _ in outcomes):
            token, _, resolver = sorted(outcomes, key=repr)[0]
            return resolver, token, pop, group, False
    return None


def _in_loop_body(flow, site, loop) -> bool:
    """Is the call at ``site`` a statement of the micro-steps' loop's own body (not inside an ``if``, a
    ``try`` handler or a nested block), or of the ``finally:`` of a ``try`` that is one: one that runs
    on every turn?"""
    info = flow.loop_infos.get(loop)
    _, node = flow.records.nodes.get(site, (None, None))
    if info is None or node is None:
        return False
    every_turn = list(info.node.body)
    every_turn += [f for stmt in info.node.body if isinstance(stmt, ast.Try) for f in stmt.finalbody]
    return any(isinstance(stmt, ast.Expr) and stmt.value is node for stmt in every_turn)


def _gated_window(token, by_hand) -> bool:
    """A micro-step whose optimizer step is gated for it (``accelerator.accumulate``, a DeepSpeed
    engine), not one of a model whose sync is managed by hand (local SGD)."""
    return token.synced == "managed" and token.model not in by_hand


_COUNTING = ("accum", "grad_acc", "update_freq", "sync_gradients", "micro", "iters_to_acc", "gradient_acc",
             "backward_passes", "n_acc", "ga_steps")


def _inside(flow, site, loop) -> bool:
    loops = flow.records.loops_at.get(site)
    return loops is None or loop in loops


def _outside(flow, site, loop) -> bool:
    loops = flow.records.loops_at.get(site)
    return loops is not None and loop not in loops


def _run_outside(flow, site, loop) -> bool:
    """Did the step at ``site`` also run outside ``loop`` (a helper's step called after it too)?"""
    return any(loop not in loops for loops in flow.records.step_contexts.get(site, ()))


def _periodic(atom, loop) -> bool:
    """A counting test: a mod form, the last iteration of the micro-steps' own loop, or a test that
    names the accumulation (``micro == accum``, ``accelerator.sync_gradients``)."""
    if atom.loop is not None:
        return atom.loop == loop
    return atom.mod is not None or any(w in atom.text.lower() for w in _COUNTING)


def populations(flow) -> list:
    cached = getattr(flow, "_populations", None)
    if cached is not None:
        return cached
    by_key: dict = {}
    for (token, kind, resolver, across), guard in flow.records.resolutions.items():
        key = (token.model, token.loops[-1] if token.loops else None)
        by_key.setdefault(key, []).append((token, kind, resolver, across, guard))
    flow._populations = [Population(flow, model, loop, records) for (model, loop), records in by_key.items()]
    return flow._populations


def _sharded_elsewhere(flow, model) -> bool:
    """An FSDP2 model sharded in place (``fully_shard(block)``) by a script this flow's script never
    reaches: a sibling entry script that builds the same class of model from the same factory
    (``train_fsdp.py`` beside ``train_ddp_manual.py``). An instance is known by its class, so the
    sharding of one script's instance is not the other's."""
    from synccheck.analyzer.project.wrapped_models import _in_place_elsewhere

    if model.kind != "fsdp2" or not model.site:
        return False
    if not _in_place_elsewhere(flow.program.project, model, getattr(flow.root, "module", flow.root)):
        # (an import says little where the recipes of one library all import the package that holds
        # its sharding helper, torchtune's: does this training run call the function that shards?)
        return not _runs_the_sharding(flow, model)
    return True


def _runs_the_sharding(flow, model) -> bool:
    """Does this training run shard the model: does the flow's root, or a function that calls it (two
    callers up), call the function holding the in-place sharding call (``fully_shard``), four calls deep
    at most; and where it is not seen to, does no other script run it? A script's module-level code
    shards for itself only."""
    from synccheck.analyzer.project.definitions import Function, enclosing_function

    program = flow.program
    sharded_in = program.project.module_at(model.site[0])
    if sharded_in is None:
        return True
    holder = enclosing_function(sharded_in, SimpleNamespace(lineno=model.site[1]))
    root = flow.root
    if holder is None:
        return getattr(root, "module", root) is sharded_in
    starts, frontier = [root], [root]
    if isinstance(root, Function) and root.cls is not None:
        # a recipe class: ``setup()`` shards in ``_setup_model()``, ``train()`` runs the loop
        starts.extend(m for m in root.cls.methods.values() if isinstance(m, Function) and m is not root)
    for _ in range(2):
        callers = []
        for fn in frontier:
            if isinstance(fn, Function):
                for scope, _, _ in flow.values.callers(fn):
                    if scope not in starts:
                        # (a module's script body calls it: a start, with no callers of its own)
                        (callers if isinstance(scope, Function) else starts).append(scope)
        starts.extend(callers)
        frontier = callers
    if _calls_down_to(program, starts, holder):
        return True
    # not seen from here: the sharding counts for this run unless a script of its own, beside this one,
    # is seen to run it (torchtune's distributed recipe beside the single-device one; a loader reached
    # only through a registry of pipelines, FastVideo's, is no such evidence)
    root_module = getattr(root, "module", root)
    name = holder.node.name
    for module in program.project.linted():
        if module is root_module or "__main__" not in module.text or name not in module.text:
            continue
        if _calls_down_to(program, list(module.functions.values()) + [module], holder):
            return False
    return True


def _calls_down_to(program, starts: list, holder) -> bool:
    """Does a call from one of ``starts`` reach ``holder``, four calls deep at most?"""
    from synccheck.analyzer.project.definitions import Function

    seen = set()
    todo = [(s, 0) for s in starts]
    while todo:
        scope, depth = todo.pop()
        if scope is holder:
            return True
        key = id(scope)
        if key in seen or depth > 4 or len(seen) > 400:
            continue
        seen.add(key)
        nodes = scope.nodes() if isinstance(scope, Function) else ast.walk(scope.tree)
        for node in nodes:
            if isinstance(node, ast.Call):
                targets = program.syntactic_targets(node, scope)
                if targets is None and isinstance(node.func, ast.Subscript):
                    # ``PARALLELIZE[cfg.name](model, mesh)``: a registry of functions (torchtitan)
                    targets = program.call_targets(node, scope)
                for target in targets or ():
                    if isinstance(target, Function):
                        todo.append((target, depth + 1))
    return False

