"""One rank's record file, streamed into a RankSummary: its counts and what the verdict needs of its
optimizer-step windows, without keeping any event (no torch).

The first window is left out of the verdict ("steady" windows are the others that ran a micro-step),
because DDP rebuilds its buckets after the first synced backward and that window's counts are not
typical. Each steady window is folded into a few running sums and counters as it closes, so a summary
has the same size after ten steps as after a million.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from synccheck.profiler import fold as F
from synccheck.profiler.records import EventReader, RankRecord

_WINDOW_KINDS = frozenset({F.FORWARD, F.BUCKET, F.COLLECTIVE, F.LATE_NO_SYNC})


class WindowCount(NamedTuple):
    micro_steps: int
    synced_micro_steps: int


@dataclass
class Steady:
    """Running sums over the steady windows."""
    windows: int = 0
    synced: int = 0
    ar_us: int = 0
    timed: int = 0                  # windows whose duration is known (not the first)
    time_us: int = 0
    # SC101: more than one synced micro-step beyond those SC102 explains
    many: int = 0
    many_sites: Counter = field(default_factory=Counter)
    many_synced: Counter = field(default_factory=Counter)
    many_micro: Counter = field(default_factory=Counter)
    many_bytes: int = 0
    many_fsdp: bool = False
    many_saving_us: float = 0.0     # all-reduce time the extra synced micro-steps took
    many_time_us: int = 0
    many_timed: int = 0
    # SC102: synced micro-steps whose no_sync came too late
    late_saving_us: float = 0.0
    late_windows: int = 0
    late_time_us: int = 0
    late_timed: int = 0
    # SC103: the last micro-step before the step did not sync
    unsynced: int = 0
    unsynced_none: int = 0          # ... with no gradient all-reduce in the window at all
    unsynced_sites: Counter = field(default_factory=Counter)


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
    allreduce_us: int = 0
    param_averages: int = 0
    collectives: Counter = field(default_factory=Counter)         # every Python-level collective
    other_collectives: Counter = field(default_factory=Counter)   # those not synchronizing gradients
    late_no_sync: Counter = field(default_factory=Counter)        # (how, path, line) -> micro-steps
    checksums: dict = field(default_factory=dict)                 # optimizer step -> checksum
    model_kinds: set = field(default_factory=set)
    blocked: list | None = None                                   # last BLOCKED event, if any
    truncated: bool = False
    frameworks: tuple = ()                                        # accelerate, lightning, ... loaded in the rank
    runs: list = field(default_factory=list)                      # [micro, synced, count] per run of alike windows
    steady: Steady = field(default_factory=Steady)
    last_step_t: int | None = None
    path: str = ""

    @property
    def allreduce_time_s(self) -> float:
        return self.allreduce_us / 1e6

    @property
    def windows(self) -> list[WindowCount]:
        """(micro-steps, synced micro-steps) of every optimizer-step window, in order."""
        return [WindowCount(m, s) for m, s, n in self.runs for _ in range(n)]

    @property
    def synced_per_step(self) -> float | None:
        st = self.steady
        return st.synced / st.windows if st.windows else None

    @property
    def step_time_s(self) -> float | None:
        st = self.steady
        return st.time_us / st.timed / 1e6 if st.timed else None

    def to_json(self) -> dict:
        step_s = self.step_time_s
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "node_rank": self.node_rank,
            "optimizer_steps": self.optimizer_steps,
            "micro_steps": self.micro_steps,
            "synced_micro_steps": self.synced_micro_steps,
            "synced_micro_steps_per_step": self.synced_per_step,
            "grad_allreduces": self.grad_allreduces,
            "grad_allreduce_bytes": self.grad_allreduce_bytes,
            "allreduce_time_s": round(self.allreduce_time_s, 6),
            "step_time_s": None if step_s is None else round(step_s, 6),
            "param_averages": self.param_averages,
            "collectives": dict(sorted(self.collectives.items())),
            "models": sorted(self.model_kinds),
            "frameworks": list(self.frameworks),
            "checksums": {str(k): v for k, v in sorted(self.checksums.items())},
            "truncated": self.truncated,
        }


def _add_totals(s: RankSummary, w: F.Totals) -> None:
    s.micro_steps += w.micro
    s.synced_micro_steps += w.synced
    s.grad_allreduces += w.n_ar
    s.grad_allreduce_bytes += w.ar_bytes
    s.allreduce_us += w.ar_us
    for (name, role), n in w.colls.items():
        s.collectives[name] += n
        if role != "grad":
            s.other_collectives[name] += n
        if role == "avg":
            s.param_averages += n
    if w.lates:
        s.late_no_sync.update(w.lates)


def _close_window(s: RankSummary, w: F.Totals, t, path, line) -> None:
    _add_totals(s, w)
    index = s.optimizer_steps
    s.optimizer_steps += 1
    runs = s.runs
    if runs and runs[-1][0] == w.micro and runs[-1][1] == w.synced:
        runs[-1][2] += 1
    else:
        runs.append([w.micro, w.synced, 1])
    duration = t - s.last_step_t if isinstance(t, int) and s.last_step_t is not None else None
    if isinstance(t, int):
        s.last_step_t = t
    if index == 0 or not w.micro:
        return
    st = s.steady
    st.windows += 1
    st.synced += w.synced
    st.ar_us += w.ar_us
    if duration is not None and duration > 0:
        st.timed += 1
        st.time_us += duration
    if w.synced - w.late > 1:
        st.many += 1
        st.many_sites.update(w.sites)
        st.many_synced[w.synced] += 1
        st.many_micro[w.micro] += 1
        st.many_bytes += w.ar_bytes
        st.many_fsdp = st.many_fsdp or any(k.startswith("fsdp") for k in w.kinds)
        # The fix keeps one synced micro-step per window: the others' share of its all-reduce time goes.
        st.many_saving_us += w.ar_us * (w.synced - w.late - 1) / w.synced
        if duration is not None and duration > 0:
            st.many_timed += 1
            st.many_time_us += duration
    if w.late and w.synced:
        st.late_windows += 1
        st.late_saving_us += w.ar_us * min(w.late, w.synced - 1) / w.synced
        if duration is not None and duration > 0:
            st.late_timed += 1
            st.late_time_us += duration
    if w.last is False:
        st.unsynced += 1
        if w.n_ar == 0:
            st.unsynced_none += 1
        st.unsynced_sites[(path, line)] += 1


def _close_run(s: RankSummary, w: F.Totals, path, line, n: int, timed: int, time_us: int, t_last: int) -> None:
    """_close_window for n more windows like the last one (not the first window; w.micro > 0), of which
    `timed` took `time_us` in all: the same sums, in the same order where they are floats."""
    s.micro_steps += w.micro * n
    s.synced_micro_steps += w.synced * n
    s.grad_allreduces += w.n_ar * n
    s.grad_allreduce_bytes += w.ar_bytes * n
    s.allreduce_us += w.ar_us * n
    for (name, role), k in w.colls.items():
        s.collectives[name] += k * n
        if role != "grad":
            s.other_collectives[name] += k * n
        if role == "avg":
            s.param_averages += k * n
    for key, k in w.lates.items():
        s.late_no_sync[key] += k * n
    s.optimizer_steps += n
    s.runs[-1][2] += n
    s.last_step_t = t_last
    st = s.steady
    st.windows += n
    st.synced += w.synced * n
    st.ar_us += w.ar_us * n
    st.timed += timed
    st.time_us += time_us
    if w.synced - w.late > 1:
        st.many += n
        for key, k in w.sites.items():
            st.many_sites[key] += k * n
        st.many_synced[w.synced] += n
        st.many_micro[w.micro] += n
        st.many_bytes += w.ar_bytes * n
        saving = w.ar_us * (w.synced - w.late - 1) / w.synced
        for _ in range(n):
            st.many_saving_us += saving
        st.many_timed += timed
        st.many_time_us += time_us
    if w.late and w.synced:
        st.late_windows += n
        saving = w.ar_us * min(w.late, w.synced - 1) / w.synced
        for _ in range(n):
            st.late_saving_us += saving
        st.late_timed += timed
        st.late_time_us += time_us
    if w.last is False:
        st.unsynced += n
        if w.n_ar == 0:
            st.unsynced_none += n
        st.unsynced_sites[(path, line)] += n


def summarize(record: RankRecord) -> RankSummary:
    """Read one rank file, start to end, in bounded memory."""
    meta = record.meta
    s = RankSummary(rank=record.rank, host=str(meta.get("host", "")), pid=record.pid,
                    node_rank=meta.get("node_rank"), frameworks=tuple(meta.get("frameworks") or ()),
                    path=record.path)
    reader = EventReader(record.path)
    fold = F.Fold()
    chunk: list = []       # the events of a window written in full, until its step
    prog = None            # the latest summary of the open window

    def time_of(ev):
        t = ev[1] if len(ev) > 1 else 0
        return t if isinstance(t, int) else 0

    def fold_chunk():
        # Bucket events are appended when the all-reduce completes but carry its start time: order the
        # window by time; its step stays last, as the writer (which folds as events come) saw it.
        events = chunk
        if chunk[-1][0] == F.STEP:
            events = sorted(chunk[:-1], key=time_of)
            events.append(chunk[-1])
        else:
            events.sort(key=time_of)
        for ev in events:
            res = fold.feed(ev)
            if res is None:
                continue
            step = res[-1]
            if len(step) > 6 and step[6] is not None:
                s.checksums[int(step[2])] = step[6]
            if res[0] == "close":
                _close_window(s, res[1], step[1], step[4], step[5])
        chunk.clear()

    # A run of agg records with the same totals (one Totals object, see EventReader) and step line is
    # counted here and applied at once: only the step times differ.
    run = None             # [totals, path, line, windows, timed windows, their time, time of the last]

    def flush_run():
        nonlocal run
        if run is not None and run[3]:
            _close_run(s, *run)
        run = None

    for ev in reader.events():
        kind = ev[0]
        if kind == F.AGG:
            totals, t = ev[7], ev[1]
            if ev[6] is not None:
                s.checksums[int(ev[2])] = ev[6]
            prog = None
            if run is not None and totals is run[0] and not chunk and ev[4] == run[1] and ev[5] == run[2] \
                    and type(t) is int:
                d = t - run[6]
                run[6] = t
                run[3] += 1
                if d > 0:
                    run[4] += 1
                    run[5] += d
                continue
            flush_run()
            if chunk:
                fold_chunk()
            fold.close_with(totals, ev)
            _close_window(s, totals, t, ev[4], ev[5])
            if s.optimizer_steps > 1 and totals.micro and type(t) is int:
                run = [totals, ev[4], ev[5], 0, 0, 0, t]
            continue
        flush_run()
        if kind in _WINDOW_KINDS:
            chunk.append(ev)
        elif kind == F.STEP:
            chunk.append(ev)
            fold_chunk()
            prog = None
        elif kind == F.PROG:
            prog = ev[2]
        elif kind == F.MODEL:
            fold.feed(ev)
            s.model_kinds.add(ev[3])
        elif kind == F.BLOCKED:
            s.blocked = ev
    flush_run()
    if chunk:
        fold_chunk()
    # What the rank did after its last step: its events, or else the last "prog" summary of them.
    if fold.win.events or fold.fsdp_open is not None:
        _add_totals(s, fold.snapshot())
    elif prog is not None:
        _add_totals(s, prog)
    s.truncated = bool(reader.bad_lines)
    return s


def _summarize_or_note(record: RankRecord):
    try:
        return summarize(record), None
    except OSError as exc:
        return None, f"rank {record.rank}: cannot read {record.path}: {exc.strerror or exc}"
    except Exception as exc:     # an unknown version met late, a file rewritten while read: one line
        return None, f"rank {record.rank}: {exc}"


# Below this much data, starting a pool costs more than it saves.
POOL_MIN_FILES = 8
POOL_MIN_BYTES = 16 << 20


def summarize_all(records: list[RankRecord], jobs: int | None = None) -> tuple[list[RankSummary], list[str]]:
    """Every record summarized, in a pool of processes when there is enough to read. Returns (summaries in
    the records' order, notes for the files that could not be read)."""
    if jobs is None:
        jobs = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1), 8)
    size = 0
    for r in records:
        try:
            size += os.path.getsize(r.path)
        except OSError:
            pass
    results = None
    if jobs > 1 and len(records) >= POOL_MIN_FILES and size >= POOL_MIN_BYTES:
        results = _in_pool(records, jobs)
    if results is None:
        results = [_summarize_or_note(r) for r in records]
    summaries = [s for s, _ in results if s is not None]
    notes = [n for _, n in results if n is not None]
    return summaries, notes


def _in_pool(records: list[RankRecord], jobs: int):
    import multiprocessing
    import threading

    # fork is the cheap start (no re-import); only where this process has no other thread to inherit.
    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return None
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(processes=min(jobs, len(records))) as pool:
            chunk = max(1, len(records) // (jobs * 16))
            return list(pool.imap(_summarize_or_note, records, chunksize=chunk))
    except (OSError, RuntimeError):
        return None
