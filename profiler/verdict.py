"""From per-rank records to counts and findings (SC101, SC102, SC103), with no torch.

The unit is the **optimizer-step window**: the micro-steps, gradient all-reduces and collectives
between one optimizer step and the next. The ideal for data-parallel gradient accumulation is one synced
micro-step per window: the boundary micro-step, whose backward all-reduces the gradients accumulated by
the unsynced ones before it. The first window is left out of the verdict, because DDP rebuilds its
buckets after the first synced backward and that window's counts are not typical.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from synccheck.profiler.groups import differences, rank_ranges
from synccheck.profiler.records import RankRecord
from synccheck.profiler.summary import RankSummary, summarize, summarize_all  # noqa: F401 (re-exported)

SEVERITY = {"SC101": "warning", "SC102": "warning", "SC103": "error"}
NAMES = {"SC101": "sync-every-microstep", "SC102": "no-sync-misses-forward", "SC103": "unsynced-step"}


@dataclass
class Finding:
    code: str
    message: str
    rank: int | None
    path: str | None
    line: int | None
    ranks: list = field(default_factory=list)
    # (all-reduce us per optimizer step the fix removes, step us or None) per rank, for SC101/SC102
    savings: list = field(default_factory=list)
    saving: dict | None = None

    @property
    def severity(self) -> str:
        return SEVERITY[self.code]

    def to_json(self) -> dict:
        return {"code": self.code, "name": NAMES[self.code], "severity": self.severity,
                "message": self.message, "rank": self.rank, "ranks": self.ranks,
                "path": self.path, "line": self.line, "saving": self.saving}



def _where(path, line) -> str:
    return f"{path}:{line}" if path else "?"


def rank_findings(s: RankSummary, averaging_seen: bool) -> list[Finding]:
    findings: list[Finding] = []
    st = s.steady
    step_us = st.time_us / st.timed if st.timed else None

    # SC101: more than one synced micro-step per optimizer step, beyond those SC102 explains.
    if st.many:
        (path, line), _ = st.many_sites.most_common(1)[0] if st.many_sites else ((None, None), 0)
        typical = st.many_synced.most_common(1)[0][0]
        micro = st.many_micro.most_common(1)[0][0]
        mb = st.many_bytes / st.many / 1e6
        if st.many_fsdp:
            fix = ("FSDP reduce-scatters every micro-step's gradients; `set_requires_gradient_sync(False)` "
                   "(FSDP2) or `no_sync()` (FSDP1) on the non-boundary micro-steps trades that communication "
                   "for memory")
        elif "accelerate" in s.frameworks:
            fix = ("run every micro-step inside `with accelerator.accumulate(model):`, with "
                   "`Accelerator(gradient_accumulation_steps=N)`")
        else:
            fix = ("run the forward *and* backward of every non-boundary micro-step inside `model.no_sync()` "
                   "(or use synccheck.runtime.GradientAccumulator)")
        f = Finding(
            "SC101",
            f"{st.many} of {st.windows} optimizer steps synchronized gradients on {typical} of {micro} "
            f"micro-steps (ideal: 1), {mb:.2f} MB all-reduced per step; {fix}",
            s.rank, path, line)
        f.savings.append((st.many_saving_us / st.windows, step_us))
        findings.append(f)

    # SC102: no_sync entered (or the flag cleared) after a synced forward: that backward synced anyway.
    late_total = sum(s.late_no_sync.values())
    for (how, path, line), count in s.late_no_sync.items():
        if how == "no_sync":
            msg = (f"`no_sync()` entered after the forward ({count} micro-steps): DDP decides in the forward "
                   "whether the backward all-reduces, so these backwards synchronized anyway; move the forward "
                   "inside the `with model.no_sync():` block")
        else:
            msg = (f"`require_backward_grad_sync` switched off after the forward ({count} micro-steps): DDP "
                   "reads it in the forward, so these backwards synchronized anyway; set it before the forward")
        f = Finding("SC102", msg, s.rank, path, line)
        if st.windows and late_total:
            f.savings.append((st.late_saving_us * count / late_total / st.windows, step_us))
        findings.append(f)

    # SC103: the optimizer stepped on gradients whose last micro-step was never all-reduced.
    if not averaging_seen and st.unsynced:
        (path, line), _ = st.unsynced_sites.most_common(1)[0]
        if st.unsynced_none == st.unsynced:
            what = "with no gradient all-reduce since the previous step"
        else:
            what = "right after a micro-step that skipped gradient sync"
        findings.append(Finding(
            "SC103",
            f"{st.unsynced} of {st.windows} optimizer steps ran {what}: each rank stepped on its own "
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
    """One finding per (code, location), listing every rank where it occurred; for SC101/SC102 the fix's
    value, averaged over those ranks, is added to the message."""
    merged: dict = {}
    seen: dict = {}
    for f in sorted(per_rank, key=lambda f: (f.rank if f.rank is not None else -1)):
        key = (f.code, f.path, f.line)
        if key in merged:
            target = merged[key]
            if f.rank is not None and f.rank not in seen[key]:
                seen[key].add(f.rank)
                target.ranks.append(f.rank)
            target.savings.extend(f.savings)
            continue
        f.ranks = [f.rank] if f.rank is not None else []
        seen[key] = set(f.ranks)
        merged[key] = f
    for f in merged.values():
        _add_saving(f)
    return sorted(merged.values(), key=lambda f: (f.code, f.path or "", f.line or 0))


def _add_saving(f: Finding) -> None:
    if not f.savings:
        return
    saving_us = sum(v for v, _ in f.savings) / len(f.savings)
    steps = [t for _, t in f.savings if t]
    step_us = sum(steps) / len(steps) if steps else None
    if saving_us <= 0:
        return
    share = saving_us / step_us if step_us else None
    f.saving = {"allreduce_s_per_step": round(saving_us / 1e6, 6),
                "step_s": None if step_us is None else round(step_us / 1e6, 6),
                "share_of_step": None if share is None else round(share, 4)}
    text = f"; measured on this run, the fix removes {_ms(saving_us)} of all-reduce time per optimizer step"
    if share is not None:
        text += f" ({share:.0%} of the {_ms(step_us)} step)"
    f.message += text


def _ms(us: float) -> str:
    return f"{us / 1e3:.3g} ms" if us < 1e6 else f"{us / 1e6:.3g} s"


@dataclass
class Report:
    summaries: list[RankSummary]
    findings: list[Finding]
    notes: list[str]
    world_size: int | None
    divergence: dict | None
    averaging_seen: bool


def analyse(records: list[RankRecord], notes: list[str] | None = None) -> Report:
    """Read every rank's file (a stream each, in a pool when there are many) and judge them."""
    summaries, read_notes = summarize_all(records)
    world_size = max((int(r.meta.get("world_size") or 0) for r in records), default=0) or None
    return judge(summaries, list(notes or []) + read_notes, world_size)


def judge(summaries: list[RankSummary], notes: list[str], world_size: int | None) -> Report:
    averaging_seen = any(s.param_averages for s in summaries)
    per_rank: list[Finding] = []
    for s in summaries:
        per_rank.extend(rank_findings(s, averaging_seen))
    truncated = [s.rank for s in summaries if s.truncated]
    if truncated:
        which = f"rank {truncated[0]}: its record file ends" if len(truncated) == 1 else \
            f"ranks {_ranges(truncated)}: their record files end"
        notes.append(f"{which} in a partial line (the process was killed while writing); everything before "
                     "it is used")
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
        unsynced = sum(s.steady.unsynced for s in summaries)
        avg = max(s.param_averages for s in summaries)
        notes.append(f"parameter averaging recognised ({avg} averaging all-reduce{'' if avg == 1 else 's'} per rank, e.g. local SGD / "
                     f"PeriodicModelAverager): the {unsynced} rank-steps without gradient sync are intended, not SC103")
    if world_size and len(summaries) < world_size:
        missing = sorted(set(range(world_size)) - {s.rank for s in summaries})
        notes.append(f"no records from rank(s) {_ranges(missing)} of {world_size} (another node writing elsewhere, "
                     "or still running: merge later with `synccheck report DIR`)")
    notes.extend(differences(summaries))
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
    return rank_ranges(values, ", ")
