"""Many ranks, read at a glance: ranks that behave the same as one group, the ranks that differ, the
slowest ranks in all-reduce, and one line per node (no torch)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from synccheck.profiler.summary import RankSummary

# A rank is named a straggler when its time in all-reduce is this many times the median rank's.
STRAGGLER_RATIO = 1.2
STRAGGLERS_SHOWN = 3


def rank_ranges(values, sep: str = ",") -> str:
    """0-3,7,9,10: consecutive ranks as ranges (runs of three or more)."""
    values = sorted(values)
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{values[i]}-{values[j]}")
        else:
            parts.extend(str(v) for v in values[i:j + 1])
        i = j + 1
    return sep.join(parts)


def behaviour(s: RankSummary) -> tuple:
    """What must be equal for two ranks to share a row: every count, not the times."""
    return (s.optimizer_steps, s.micro_steps, s.synced_micro_steps, s.grad_allreduces, s.grad_allreduce_bytes,
            s.param_averages, tuple(sorted(s.collectives.items())), s.truncated)


@dataclass
class Group:
    members: list = field(default_factory=list)      # RankSummary, by rank

    @property
    def first(self) -> RankSummary:
        return self.members[0]

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.members]

    def times(self) -> tuple[float, float]:
        values = [s.allreduce_time_s for s in self.members]
        return min(values), max(values)

    def to_json(self) -> dict:
        s = self.first
        low, high = self.times()
        return {"ranks": rank_ranges(self.ranks), "count": len(self.members),
                "optimizer_steps": s.optimizer_steps, "micro_steps": s.micro_steps,
                "synced_micro_steps": s.synced_micro_steps, "synced_micro_steps_per_step": s.synced_per_step,
                "grad_allreduces": s.grad_allreduces, "grad_allreduce_bytes": s.grad_allreduce_bytes,
                "param_averages": s.param_averages, "truncated": s.truncated,
                "allreduce_time_s": {"min": round(low, 6), "max": round(high, 6)}}


def groups(summaries: list[RankSummary]) -> list[Group]:
    """Ranks with the same counts, largest group first (then by first rank)."""
    by_key: dict = {}
    for s in sorted(summaries, key=lambda s: s.rank):
        by_key.setdefault(behaviour(s), Group()).members.append(s)
    return sorted(by_key.values(), key=lambda g: (-len(g.members), g.first.rank))


def stragglers(summaries: list[RankSummary]) -> list[dict]:
    """The ranks with the most time in all-reduce, when it is well above the median rank's."""
    if len(summaries) < 3:
        return []
    median = statistics.median(s.allreduce_time_s for s in summaries)
    if median <= 0:
        return []
    slow = sorted(summaries, key=lambda s: (-s.allreduce_time_s, s.rank))[:STRAGGLERS_SHOWN]
    return [{"rank": s.rank, "host": s.host, "allreduce_time_s": round(s.allreduce_time_s, 6),
             "median_s": round(median, 6), "ratio": round(s.allreduce_time_s / median, 3)}
            for s in slow if s.allreduce_time_s >= STRAGGLER_RATIO * median]


def nodes(summaries: list[RankSummary]) -> list[dict]:
    """One entry per host, in rank order (only meaningful when there are several)."""
    by_host: dict = {}
    for s in sorted(summaries, key=lambda s: s.rank):
        by_host.setdefault(s.host, []).append(s)
    out = []
    for host, members in by_host.items():
        times = [s.allreduce_time_s for s in members]
        steps = [s.optimizer_steps for s in members]
        slowest = max(members, key=lambda s: s.allreduce_time_s)
        out.append({"host": host, "node_rank": members[0].node_rank, "ranks": rank_ranges([s.rank for s in members]),
                    "count": len(members), "optimizer_steps": {"min": min(steps), "max": max(steps)},
                    "allreduce_time_s": {"min": round(min(times), 6), "median": round(statistics.median(times), 6),
                                         "max": round(max(times), 6)},
                    "slowest_rank": slowest.rank})
    return out


def differences(summaries: list[RankSummary]) -> list[str]:
    """Notes on the ranks that stopped before the others."""
    if len(summaries) < 2:
        return []
    most = max(s.optimizer_steps for s in summaries)
    early: dict = {}
    for s in summaries:
        if s.optimizer_steps < most:
            early.setdefault(s.optimizer_steps, []).append(s.rank)
    notes = []
    for steps, ranks in sorted(early.items()):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
        notes.append(f"{who} stopped early: {steps} optimizer steps recorded, while other ranks reached {most}")
    return notes
