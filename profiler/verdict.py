"""From per-rank records to counts and findings (SC101, SC102, SC103), with no torch.

The unit is the **optimizer-step window**: the micro-steps, gradient all-reduces and collectives
between one optimizer step and the next. The ideal for data-parallel gradient accumulation is one synced
micro-step per window: the boundary micro-step, whose backward all-reduces the gradients accumulated by
the unsynced ones before it. The first window is left out of the verdict, because DDP rebuilds its
buckets after the first synced backward and that window's counts are not typical.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from synccheck.profiler import recorder as R
from synccheck.profiler.records import RankRecord

SEVERITY = {"SC101": "warning", "SC102": "warning", "SC103": "error"}
NAMES = {"SC101": "sync-every-microstep", "SC102": "no-sync-misses-forward", "SC103": "unsynced-step"}


@dataclass
class Window:
    micro_steps: int = 0
    synced_micro_steps: int = 0
    late_no_sync: int = 0
    grad_allreduces: int = 0
    grad_bytes: int = 0
    last_micro_synced: bool | None = None
    step_path: str | None = None
    step_line: int | None = None
    forward_sites: Counter = field(default_factory=Counter)   # (path, line) of synced forwards
    kinds: set = field(default_factory=set)


@dataclass
class RankSummary:
    rank: int
    host: str
    pid: int
    node_rank: int | None
    optimizer_steps: int = 0
    micro_steps: int = 0
    synced_micro_steps: int = 0
    grad_allreduces: int = 0
    grad_allreduce_bytes: int = 0
    allreduce_time_s: float = 0.0
    param_averages: int = 0
    collectives: Counter = field(default_factory=Counter)         # every Python-level collective
    other_collectives: Counter = field(default_factory=Counter)   # those not synchronizing gradients
    late_no_sync: list = field(default_factory=list)          # (how, path, line)
    checksums: dict = field(default_factory=dict)             # optimizer step -> checksum
    windows: list = field(default_factory=list)
    model_kinds: set = field(default_factory=set)
    blocked: list | None = None                               # last BLOCKED event, if any
    last_event: list | None = None
    truncated: bool = False
    frameworks: tuple = ()                                    # accelerate, lightning, ... loaded in the rank

    def steady_windows(self) -> list[Window]:
        return [w for w in self.windows[1:] if w.micro_steps]

    def to_json(self) -> dict:
        steady = self.steady_windows()
        per_step = (sum(w.synced_micro_steps for w in steady) / len(steady)) if steady else None
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "node_rank": self.node_rank,
            "optimizer_steps": self.optimizer_steps,
            "micro_steps": self.micro_steps,
            "synced_micro_steps": self.synced_micro_steps,
            "synced_micro_steps_per_step": per_step,
            "grad_allreduces": self.grad_allreduces,
            "grad_allreduce_bytes": self.grad_allreduce_bytes,
            "allreduce_time_s": round(self.allreduce_time_s, 6),
            "param_averages": self.param_averages,
            "collectives": dict(sorted(self.collectives.items())),
            "models": sorted(self.model_kinds),
            "frameworks": list(self.frameworks),
            "checksums": {str(k): v for k, v in sorted(self.checksums.items())},
        }


@dataclass
class Finding:
    code: str
    message: str
    rank: int | None
    path: str | None
    line: int | None
    ranks: list = field(default_factory=list)

    @property
    def severity(self) -> str:
        return SEVERITY[self.code]

    def to_json(self) -> dict:
        return {"code": self.code, "name": NAMES[self.code], "severity": self.severity,
                "message": self.message, "rank": self.rank, "ranks": self.ranks,
                "path": self.path, "line": self.line}



def _count_grad_allreduce(s, window, n_bytes: int) -> None:
    """One gradient all-reduce (a DDP bucket or an FSDP/manual reduction), in the rank and its window."""
    window.grad_allreduces += 1
    window.grad_bytes += n_bytes
    s.grad_allreduces += 1
    s.grad_allreduce_bytes += n_bytes

def summarize(record: RankRecord) -> RankSummary:
    meta = record.meta
    s = RankSummary(rank=record.rank, host=str(meta.get("host", "")), pid=record.pid,
                    node_rank=meta.get("node_rank"), truncated=record.truncated,
                    frameworks=tuple(meta.get("frameworks") or ()))
    kinds: dict[str, str] = {}
    # Bucket events are appended when the all-reduce completes but carry its start time: order by time.
    events = sorted(record.events, key=lambda ev: ev[1] if len(ev) > 1 and isinstance(ev[1], int) else 0)
    window = Window()
    # FSDP reads its sync switch during backward, so a micro-step's "synced" is what its backward did:
    # any gradient reduce-scatter/all-reduce before the next forward or step.
    open_fsdp_micro = None     # [window, synced]
    step_pending_merge = False

    def close_fsdp_micro():
        nonlocal open_fsdp_micro
        if open_fsdp_micro is not None:
            w, synced = open_fsdp_micro
            if synced:
                w.synced_micro_steps += 1
                s.synced_micro_steps += 1
            w.last_micro_synced = synced
            open_fsdp_micro = None

    for ev in events:
        kind = ev[0]
        if kind == R.MODEL:
            kinds[ev[2]] = ev[3]
            s.model_kinds.add(ev[3])
        elif kind == R.FORWARD:
            close_fsdp_micro()
            step_pending_merge = False
            model_kind = kinds.get(ev[2], "ddp")
            window.micro_steps += 1
            window.kinds.add(model_kind)
            s.micro_steps += 1
            if model_kind == "ddp":
                synced = bool(ev[3])
                window.last_micro_synced = synced
                if synced:
                    window.synced_micro_steps += 1
                    s.synced_micro_steps += 1
                    window.forward_sites[(ev[4], ev[5])] += 1
            else:
                open_fsdp_micro = [window, False]
                window.forward_sites[(ev[4], ev[5])] += 1
        elif kind == R.BUCKET:
            _, t, dur, _model, n_bytes, communicated = ev[:6]
            if communicated:
                _count_grad_allreduce(s, window, n_bytes)
            if dur and dur > 0:
                s.allreduce_time_s += dur / 1e6
        elif kind == R.COLLECTIVE:
            _, t, dur, name, n_bytes, role = ev[:6]
            if role == "hook":
                continue  # issued by a DDP comm hook: counted with its bucket
            s.collectives[name] += 1
            if role != "grad":
                s.other_collectives[name] += 1
            if role == "grad":
                _count_grad_allreduce(s, window, n_bytes)
                if dur and dur > 0:
                    s.allreduce_time_s += dur / 1e6
                if open_fsdp_micro is not None:
                    open_fsdp_micro[1] = True
            elif role == "avg":
                s.param_averages += 1
        elif kind == R.LATE_NO_SYNC:
            window.late_no_sync += 1
            s.late_no_sync.append((ev[3], ev[4], ev[5]))
        elif kind == R.STEP:
            close_fsdp_micro()
            if len(ev) > 6 and ev[6] is not None:
                s.checksums[int(ev[2])] = ev[6]
            if step_pending_merge:
                # Several optimizers stepping back to back (a GAN, a per-module optimizer): one boundary.
                continue
            window.step_path, window.step_line = ev[4], ev[5]
            s.windows.append(window)
            s.optimizer_steps += 1
            window = Window()
            step_pending_merge = True
        elif kind == R.BLOCKED:
            s.blocked = ev
        if kind in R.PROGRESS_KINDS:
            s.last_event = ev
    close_fsdp_micro()
    return s


def _where(path, line) -> str:
    return f"{path}:{line}" if path else "?"


def rank_findings(s: RankSummary, averaging_seen: bool) -> list[Finding]:
    findings: list[Finding] = []
    steady = s.steady_windows()

    # SC101: more than one synced micro-step per optimizer step, beyond those SC102 explains.
    too_many = [w for w in steady if w.synced_micro_steps - w.late_no_sync > 1]
    if too_many:
        sites = Counter()
        for w in too_many:
            sites.update(w.forward_sites)
        (path, line), _ = sites.most_common(1)[0] if sites else ((None, None), 0)
        typical = Counter(w.synced_micro_steps for w in too_many).most_common(1)[0][0]
        micro = Counter(w.micro_steps for w in too_many).most_common(1)[0][0]
        mb = sum(w.grad_bytes for w in too_many) / len(too_many) / 1e6
        fsdp = any(k.startswith("fsdp") for w in too_many for k in w.kinds)
        if fsdp:
            fix = ("FSDP reduce-scatters every micro-step's gradients; `set_requires_gradient_sync(False)` "
                   "(FSDP2) or `no_sync()` (FSDP1) on the non-boundary micro-steps trades that communication "
                   "for memory")
        elif "accelerate" in s.frameworks:
            fix = ("run every micro-step inside `with accelerator.accumulate(model):`, with "
                   "`Accelerator(gradient_accumulation_steps=N)`")
        else:
            fix = ("run the forward *and* backward of every non-boundary micro-step inside `model.no_sync()` "
                   "(or use synccheck.runtime.GradientAccumulator)")
        findings.append(Finding(
            "SC101",
            f"{len(too_many)} of {len(steady)} optimizer steps synchronized gradients on {typical} of {micro} "
            f"micro-steps (ideal: 1), {mb:.2f} MB all-reduced per step; {fix}",
            s.rank, path, line))

    # SC102: no_sync entered (or the flag cleared) after a synced forward: that backward synced anyway.
    for (how, path, line), count in Counter(s.late_no_sync).items():
        if how == "no_sync":
            msg = (f"`no_sync()` entered after the forward ({count} micro-steps): DDP decides in the forward "
                   "whether the backward all-reduces, so these backwards synchronized anyway; move the forward "
                   "inside the `with model.no_sync():` block")
        else:
            msg = (f"`require_backward_grad_sync` switched off after the forward ({count} micro-steps): DDP "
                   "reads it in the forward, so these backwards synchronized anyway; set it before the forward")
        findings.append(Finding("SC102", msg, s.rank, path, line))

    # SC103: the optimizer stepped on gradients whose last micro-step was never all-reduced.
    if not averaging_seen:
        unsynced = [w for w in steady if w.last_micro_synced is False]
        if unsynced:
            none_at_all = sum(1 for w in unsynced if w.grad_allreduces == 0)
            sites = Counter((w.step_path, w.step_line) for w in unsynced)
            (path, line), _ = sites.most_common(1)[0]
            if none_at_all == len(unsynced):
                what = "with no gradient all-reduce since the previous step"
            else:
                what = "right after a micro-step that skipped gradient sync"
            findings.append(Finding(
                "SC103",
                f"{len(unsynced)} of {len(steady)} optimizer steps ran {what}: each rank stepped on its own "
                "local gradients; the boundary micro-step (forward and backward) must run outside `no_sync()`",
                s.rank, path, line))
    return findings


def divergence(summaries: list[RankSummary]) -> dict | None:
    """Compare the parameter checksums of the ranks at the latest optimizer step all of them recorded."""
    if len(summaries) < 2:
        return None
    common = None
    for s in summaries:
        steps = set(s.checksums)
        common = steps if common is None else common & steps
    if not common:
        return None
    step = max(common)
    values = {s.rank: s.checksums[step] for s in summaries}
    groups: dict = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return {"step": step, "diverged": len(groups) > 1, "checksums": {str(r): v for r, v in values.items()},
            "groups": sorted(groups.values())}


def merge_findings(per_rank: list[Finding]) -> list[Finding]:
    """One finding per (code, location), listing every rank where it occurred."""
    merged: dict = {}
    for f in sorted(per_rank, key=lambda f: (f.rank if f.rank is not None else -1)):
        key = (f.code, f.path, f.line)
        if key in merged:
            if f.rank is not None and f.rank not in merged[key].ranks:
                merged[key].ranks.append(f.rank)
            continue
        f.ranks = [f.rank] if f.rank is not None else []
        merged[key] = f
    return sorted(merged.values(), key=lambda f: (f.code, f.path or "", f.line or 0))


@dataclass
class Report:
    summaries: list[RankSummary]
    findings: list[Finding]
    notes: list[str]
    world_size: int | None
    divergence: dict | None
    averaging_seen: bool


def analyse(records: list[RankRecord], notes: list[str] | None = None) -> Report:
    notes = list(notes or [])
    summaries = [summarize(r) for r in records]
    world_size = max((int(r.meta.get("world_size") or 0) for r in records), default=0) or None
    averaging_seen = any(s.param_averages for s in summaries)
    per_rank: list[Finding] = []
    for s in summaries:
        per_rank.extend(rank_findings(s, averaging_seen))
        if s.truncated:
            notes.append(f"rank {s.rank}: its record file ends in a partial line (the process was killed "
                         "while writing); everything before it is used")
    div = divergence(summaries)
    findings = merge_findings(per_rank)
    if div is not None:
        evidence = _divergence_text(div)
        sc103 = [f for f in findings if f.code == "SC103"]
        if sc103:
            for f in sc103:
                f.message += f"; {evidence}"
        elif div["diverged"] and not averaging_seen:
            findings.append(Finding("SC103", f"the replicas are no longer identical: {evidence}", None, None, None))
        elif div["diverged"]:
            notes.append(f"parameter averaging is in use; between averaging points the replicas differ "
                         f"({_divergence_text(div, between_averagings=True)})")
    if averaging_seen:
        unsynced = sum(1 for s in summaries for w in s.steady_windows() if w.last_micro_synced is False)
        avg = max(s.param_averages for s in summaries)
        notes.append(f"parameter averaging recognised ({avg} averaging all-reduce{'' if avg == 1 else 's'} per rank, e.g. local SGD / "
                     f"PeriodicModelAverager): the {unsynced} rank-steps without gradient sync are intended, not SC103")
    if world_size and len(summaries) < world_size:
        missing = sorted(set(range(world_size)) - {s.rank for s in summaries})
        notes.append(f"no records from rank(s) {_ranges(missing)} of {world_size} (another node writing elsewhere, "
                     "or still running: merge later with `synccheck report DIR`)")
    if summaries and all(s.optimizer_steps < 2 for s in summaries):
        notes.append("fewer than two optimizer steps recorded: the first step is left out of the verdict "
                     "(DDP rebuilds its buckets after it), so there is nothing to judge")
    return Report(summaries, findings, notes, world_size, div, averaging_seen)


def _divergence_text(div: dict, between_averagings: bool = False) -> str:
    if div["diverged"]:
        groups = " vs ".join("ranks " + ",".join(map(str, g)) if len(g) > 1 else f"rank {g[0]}"
                             for g in div["groups"])
        said = f"parameter checksums differ after optimizer step {div['step']} ({groups})"
        return said if between_averagings else f"{said}: the ranks diverged"
    return f"parameter checksums still agree after optimizer step {div['step']}"


def _ranges(values: list[int]) -> str:
    if len(values) > 8:
        return f"{values[0]}..{values[-1]} ({len(values)})"
    return ", ".join(map(str, values))
