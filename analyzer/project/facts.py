"""Stage 7: the facts rules query, read off the sync dataflow's records.

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
import re

from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
# the gradient-cache idiom: in gradient_cache.py (window_cache stays importable from here)
from synccheck.analyzer.project.gradient_cache import window_cache
from synccheck.analyzer.project.guards import MAX_ATOMS, assignments, depends_on, exists
from synccheck.analyzer.project.state import PLAIN


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


# a test of whether the job is distributed at all (not ``n_gpu > 1``: DataParallel's, one GPU per
# DDP process in the same scripts)
_DISTRIBUTED_JOB = re.compile(r"distributed|is_initialized|is_dist\b|world_size|\bddp\b|use_ddp|use_dist", re.I)


def _distributed_value(text: str) -> Optional[bool]:
    """The truth value of a test (an atom's text) in a distributed job: ``args.distributed`` True,
    ``not dist.is_initialized()`` False, ``world_size == 1`` False; None for any other test
    (``ooms == world_size * len(samples)`` says nothing of the job)."""
    if not _DISTRIBUTED_JOB.search(text):
        return None
    try:
        test = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    return _job_test(test)


def _job_test(test) -> Optional[bool]:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _job_test(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and not test.args:
        name = test.func.attr if isinstance(test.func, ast.Attribute) else getattr(test.func, "id", "")
        return True if name in ("is_initialized", "is_distributed", "is_dist_avail_and_initialized") else None
    if isinstance(test, (ast.Name, ast.Attribute)):
        name = test.attr if isinstance(test, ast.Attribute) else test.id
        return True if re.fullmatch(r"(?i)(?:args_)?(?:distributed|is_distributed|is_dist|ddp|use_ddp|use_dist|"
                                    r"use_distributed|dist_train|distributed_training)", name) else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) and \
            isinstance(test.left, (ast.Name, ast.Attribute, ast.Call)) and \
            re.search(r"(?i)world_size|num_processes", ast.unparse(test.left)):
        n, op = test.comparators[0].value, type(test.ops[0])
        if not isinstance(n, int) or isinstance(n, bool):
            return None
        if (op is ast.Gt and n == 1) or (op is ast.GtE and n == 2) or (op is ast.NotEq and n == 1):
            return True
        if (op is ast.Eq and n == 1) or (op is ast.Lt and n == 2) or (op is ast.LtE and n == 1):
            return False
    return None


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
        if getattr(model, "kind", None) in ("ddp", "fsdp"):
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
            kind == "stepped" and _outside(flow, resolver, loop) for _, kind, resolver, _, _ in records)
        kinds = {kind for token, kind, _, across, _ in records if across or _gated_window(token, hand)}
        # gradients wiped between iterations under a non-counting gate: steps are skipped, not
        # accumulated, whatever else the paths through the iteration do
        self.accumulating = bool(self.stepped) and (
            ("superseded" in kinds and (self.periodic or "wiped" not in kinds)) or
            (("wiped" in kinds or self.late_wipes) and self.periodic))

    @property
    def data_parallel(self) -> bool:
        m = self.model
        return m != PLAIN and m.kind in vocab.DATA_PARALLEL and not m.single

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


def _accumulation_switches(flow, pop) -> list:
    """Atoms of tests on the accumulation count against 1 (``accum > 1``), on values the loop does
    not change: they hold all run."""
    from synccheck.analyzer.project.branches import _COUNT_WORDS
    out = []
    for atom, volatile in _plain_atoms(flow, pop):
        # (a test in a method the loop calls reads the caller's objects: ``self.accum > 1`` holds all run)
        stable = not volatile or (isinstance(atom.key, tuple) and atom.key[:1] == ("STABLE",))
        if stable and _COUNT_WORDS.search(atom.text) and _ACCUMULATES.match(atom.text):
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


def _all_synced(pop, groups: dict) -> Optional[list]:
    for group, outcomes in groups.items():
        if outcomes and all(t.synced == "on" for t, _, _ in outcomes):
            return [(site, pop.model, pop, group) for site in sorted({t.site for t, kind, _ in outcomes})]
    return None


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
        ran = flow.records.zero_ran.get(resolver, 0) & universe
        # (judged where it wipes a micro-step when it is written before that backward: ``if boundary:
        # zero_grad()`` then ``if use_plain: backward() ... step()``, a run with ``use_plain`` off has
        # nothing to wipe and no step, Metric3D; one written after the backward clears what was stepped)
        where = ran & guard if _written_before(resolver, token.site) else ran
        if ran and not where & ~steps and fixed(ran) & fixed(guard):
            return resolver, token, pop, 0, True
    return None


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

