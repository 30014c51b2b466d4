"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing): one process track per rank.

Threads inside a rank's track: micro-steps (forward to the next forward or optimizer step, i.e. forward
plus backward), gradient all-reduces (one slice per DDP bucket, start to completion), Python-level
collectives, and optimizer steps (instant events, plus a slice for each optimizer-step window).
"""
from __future__ import annotations

import json

from synccheck.profiler import recorder as R
from synccheck.profiler.records import RankRecord, read_rank_file

TID_MICRO, TID_ALLREDUCE, TID_COLLECTIVE, TID_STEP = 1, 2, 3, 4
THREAD_NAMES = {TID_STEP: "optimizer steps", TID_MICRO: "micro-steps", TID_ALLREDUCE: "gradient all-reduce",
                TID_COLLECTIVE: "collectives"}


def build_trace(records: list[RankRecord]) -> dict:
    """The records' events are read one rank at a time (those of `records` that hold none are read from
    their file); an optimizer step written as one aggregate record is one slice."""
    events: list[dict] = []
    t_base = min((int(r.meta["t0"]) for r in records if isinstance(r.meta.get("t0"), int)), default=0)
    for handle in records:
        r = handle if handle.events else (read_rank_file(handle.path) or handle)
        pid = r.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"rank {r.rank} ({r.meta.get('host', '')}, pid {r.pid})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": r.rank}})
        for tid, name in THREAD_NAMES.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        evs = sorted((ev for ev in r.events if len(ev) > 1 and isinstance(ev[1], int)), key=lambda ev: ev[1])
        open_micro = None    # (t, synced, path, line, index)
        window_start = None
        micro_index = 0
        window_micro = window_synced = 0

        def close_micro(t_end):
            nonlocal open_micro
            if open_micro is not None:
                t0, synced, path, line, idx = open_micro
                events.append({"ph": "X", "pid": pid, "tid": TID_MICRO, "ts": t0 - t_base,
                               "dur": max(t_end - t0, 1),
                               "name": f"micro-step {idx} ({'synced' if synced else 'no_sync'})",
                               "cat": "micro-step", "args": {"synced": bool(synced), "source": f"{path}:{line}"}})
                open_micro = None

        prev_step = None     # time of the previous optimizer step: where an aggregated window began
        for ev in evs:
            kind, t = ev[0], ev[1]
            if kind == R.FORWARD:
                close_micro(t)
                micro_index += 1
                window_micro += 1
                window_synced += 1 if ev[3] else 0
                open_micro = (t, ev[3], ev[4], ev[5], micro_index)
                if window_start is None:
                    window_start = t
            elif kind == R.BUCKET:
                events.append({"ph": "X", "pid": pid, "tid": TID_ALLREDUCE, "ts": t - t_base,
                               "dur": max(ev[2], 1), "name": "all-reduce bucket" if ev[5] else "comm hook (no comm)",
                               "cat": "allreduce", "args": {"bytes": ev[4], "model": ev[3]}})
            elif kind == R.COLLECTIVE:
                _, _, dur, name, n_bytes, role, path, line = ev[:8]
                if role == "hook":
                    continue
                if dur is None or dur < 0:
                    events.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_COLLECTIVE, "ts": t - t_base,
                                   "name": f"{name} (async)", "cat": role,
                                   "args": {"bytes": n_bytes, "source": f"{path}:{line}"}})
                else:
                    events.append({"ph": "X", "pid": pid, "tid": TID_COLLECTIVE, "ts": t - t_base,
                                   "dur": max(dur, 1), "name": name, "cat": role,
                                   "args": {"bytes": n_bytes, "source": f"{path}:{line}"}})
            elif kind == R.LATE_NO_SYNC:
                events.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_MICRO, "ts": t - t_base,
                               "name": "SC102 no_sync after forward", "cat": "finding",
                               "args": {"source": f"{ev[4]}:{ev[5]}"}})
            elif kind == R.STEP:
                close_micro(t)
                events.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_STEP, "ts": t - t_base,
                               "name": f"optimizer step {ev[2]}", "cat": "step",
                               "args": {"checksum": ev[6] if len(ev) > 6 else None}})
                if window_start is not None:
                    events.append({"ph": "X", "pid": pid, "tid": TID_STEP, "ts": window_start - t_base,
                                   "dur": max(t - window_start, 1),
                                   "name": f"step {ev[2]}: {window_synced}/{window_micro} micro-steps synced",
                                   "cat": "window"})
                window_start = None
                window_micro = window_synced = 0
                prev_step = t
            elif kind == R.AGG:
                close_micro(t)
                totals = ev[7]
                events.append({"ph": "i", "s": "t", "pid": pid, "tid": TID_STEP, "ts": t - t_base,
                               "name": f"optimizer step {ev[2]}", "cat": "step", "args": {"checksum": ev[6]}})
                start = prev_step
                if start is not None:
                    events.append({"ph": "X", "pid": pid, "tid": TID_STEP, "ts": start - t_base,
                                   "dur": max(t - start, 1),
                                   "name": f"step {ev[2]}: {totals.synced}/{totals.micro} micro-steps synced",
                                   "cat": "window", "args": {"all-reduces": totals.n_ar, "bytes": totals.ar_bytes,
                                                             "all-reduce us": totals.ar_us}})
                window_start = None
                window_micro = window_synced = 0
                prev_step = t
            elif kind == R.BLOCKED:
                events.append({"ph": "i", "s": "p", "pid": pid, "tid": TID_COLLECTIVE, "ts": t - t_base,
                               "name": f"blocked in {ev[2]}", "cat": "hang",
                               "args": {"source": f"{ev[3]}:{ev[4]}"}})
        if open_micro is not None:
            close_micro(open_micro[0] + 1)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "synccheck profile", "time_base_us": t_base}}


def write_trace(path: str, records: list[RankRecord]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(build_trace(records), fh, separators=(",", ":"))
        fh.write("\n")
