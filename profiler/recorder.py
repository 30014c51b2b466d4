"""Per-rank record file, written from inside a training worker.

Each rank appends JSON lines to its own file in the `--out` folder. Nothing is written before the rank
is known: `mp.spawn` workers and torchrun's function entry points learn their rank only at
`init_process_group`, and the torchrun agent (which imports torch.distributed too) never initializes the
default process group, so it never opens a file.

Durability without `atexit`: `os._exit`, SIGKILL and torch 2.13's gloo teardown abort all skip atexit
handlers, so records go to the kernel with `os.write` at every optimizer step (a SIGKILLed process keeps
what the kernel already has), at a blocking barrier and at `destroy_process_group` (the end of a script:
what came after the last optimizer step is kept), plus a small background flusher so that a rank blocked
in a collective still shows its last micro-steps and the collective it is blocked in.

Size at scale: the first optimizer steps (a warm-up, and the steps after DDP rebuilds its buckets) are
written event by event, as is any step unlike the recent ones; every other step is folded (fold.py) into
one "agg" record of about a hundred bytes, whatever its number of buckets and micro-steps. Between steps a
flush writes one "prog" record (the open step so far) instead of its events. Paths are written once per
file (a "path" record) and referred to by number.

This module imports only the standard library; the torch hooks live in `hooks.py`.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections import OrderedDict

from synccheck.profiler import fold as F

# 2: paths interned once per file, ordinary optimizer steps folded into one "agg" record each.
# 1: one line per event, paths inline (still read).
FORMAT_VERSION = 2

# Environment set by the launcher (`synccheck profile`); a worker without them records nothing.
ENV_OUT = "SYNCCHECK_PROFILE_OUT"
ENV_SESSION = "SYNCCHECK_PROFILE_SESSION"
ENV_COMM_HOOK = "SYNCCHECK_PROFILE_COMM_HOOK"
# "1": write every window in full (no aggregate records), e.g. to look at a long run in --trace.
ENV_FULL = "SYNCCHECK_PROFILE_FULL"
# Seconds between two "prog" records written by the background flusher (the launcher sets it from
# --hang-timeout, so that a long optimizer step still shows progress in time).
ENV_PROGRESS = "SYNCCHECK_PROFILE_PROGRESS_S"
PROGRESS_INTERVAL_S = 5.0

# Event kinds and their layout: see fold.py.
META, MODEL, FORWARD, BUCKET, COLLECTIVE = F.META, F.MODEL, F.FORWARD, F.BUCKET, F.COLLECTIVE
LATE_NO_SYNC, STEP, BLOCKED, AGG, PROG, PATH = F.LATE_NO_SYNC, F.STEP, F.BLOCKED, F.AGG, F.PROG, F.PATH
PROGRESS_KINDS = F.PROGRESS_KINDS

# Which windows are written in full: the first WARMUP_WINDOWS optimizer steps, AFTER_REBUILD steps after
# DDP's bucket rebuild, and a window unlike the recent ones (a new signature; at most DETAIL_BUDGET in a
# row, then one per DETAIL_REFILL steps, so a run whose every step differs still stays small). Every
# other window is one aggregate record.
WARMUP_WINDOWS = 8
AFTER_REBUILD = 2
DETAIL_BUDGET = 8
DETAIL_REFILL = 64
RECENT_SIGNATURES = 32
MAX_WINDOW_EVENTS = 4096   # a window with more events than this is only ever aggregated

FLUSH_INTERVAL_S = 0.5
BLOCKED_AFTER_S = 1.0


# One encoder for every flush: json.dumps with non-default separators builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def now_us() -> int:
    return time.time_ns() // 1000


class Recorder:
    """Buffers events in memory and appends them to this rank's record file."""

    def __init__(self) -> None:
        self.out_dir = os.environ.get(ENV_OUT)
        self.session = os.environ.get(ENV_SESSION, "")
        self.active = False          # a rank file is open and events are kept
        self.rank: int | None = None
        self.world_size: int | None = None
        self.steps = 0
        # A process forked from a recording rank (a DataLoader worker) inherits the initialized process
        # group but is not a rank: it records nothing until it calls init_process_group itself.
        self.forked = False
        self.failed = False
        self._buf: list = []
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # (name, path, line, t) of the blocking collective in progress, for the hang report.
        self.current: tuple | None = None
        self._blocked_reported: tuple | None = None
        self.full = os.environ.get(ENV_FULL) == "1"
        try:
            self.progress_interval_s = float(os.environ.get(ENV_PROGRESS) or PROGRESS_INTERVAL_S)
        except ValueError:
            self.progress_interval_s = PROGRESS_INTERVAL_S
        self._prog_t = float("-inf")    # when the background flusher last wrote a "prog" record
        self._reset_windows()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    # -- lifecycle -------------------------------------------------------------------------------------

    def try_activate(self, dist) -> bool:
        """Open this rank's file once the default process group exists. Cheap when it does not."""
        if self.active:
            return True
        if self.failed or self.forked or not self.out_dir:
            return False
        try:
            if not dist.is_initialized():
                return False
            rank, world_size = dist.get_rank(), dist.get_world_size()
            backend = str(dist.get_backend())
        except Exception:
            return False
        return self._open(rank, world_size, backend)

    def _reset_windows(self) -> None:
        self._fold = F.Fold()
        self._paths: dict = {}           # path -> id, as interned in this file
        self._out: list = []             # lines of the flush in progress
        self._detail = True              # the open window is written event by event
        self._win_events: list | None = []   # the open window's events, while it may still be folded
        self._closed = 0                 # windows closed (optimizer steps, merged ones not counted)
        self._recent: OrderedDict = OrderedDict()   # signatures of recent windows
        self._budget = DETAIL_BUDGET
        self._force = 0
        self._prog_mark = 0              # events of the open window already summed up in a "prog" record

    def _open(self, rank: int, world_size: int, backend: str, host: str | None = None,
              background: bool = True) -> bool:
        host = host or socket.gethostname()
        path = os.path.join(self.out_dir, f"rank-{rank:05d}.{host}.{os.getpid()}.jsonl")
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            self.failed = True
            print(f"synccheck: rank {rank} cannot write its records to {path}: {exc.strerror}", file=sys.stderr)
            return False
        self.rank, self.world_size = rank, world_size
        meta = {
            "version": FORMAT_VERSION,
            "session": self.session,
            # torchrun gives every node of one job the same run id; the report uses it to merge nodes.
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "rank": rank,
            "world_size": world_size,
            "local_rank": _int_env("LOCAL_RANK"),
            "node_rank": _int_env("GROUP_RANK"),
            "host": host,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": list(sys.argv),
            "backend": backend,
            # training frameworks already loaded when the group was made: the verdict words its fixes for them
            "frameworks": sorted(m for m in ("accelerate", "lightning", "pytorch_lightning", "deepspeed")
                                 if m in sys.modules),
            "t0": now_us(),
        }
        self.active = True
        self._buf.insert(0, [META, meta])
        self.flush()
        if background:
            self._thread = threading.Thread(target=self._flusher, name="synccheck-flusher", daemon=True)
            self._thread.start()
        return True

    def reopen_after_fork(self) -> None:
        """init_process_group was called in a forked child: it is a rank of its own."""
        self.forked = False

    def _after_fork(self) -> None:
        was_recording = self.active
        self.active = False
        self.rank = self.world_size = None
        self.steps = 0
        self._buf = []
        self._lock = threading.Lock()
        self._thread = None
        self.current = None
        self._reset_windows()
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self.forked = was_recording or self.forked

    # -- writing ---------------------------------------------------------------------------------------

    def event(self, ev: list) -> None:
        # list.append is atomic under the GIL: the gloo thread (bucket completion) and the main thread
        # may both append.
        self._buf.append(ev)

    def force_detail(self) -> None:
        """Write the next windows in full (DDP has just rebuilt its gradient buckets)."""
        self._force = AFTER_REBUILD

    def flush(self, background: bool = False) -> None:
        buf = self._buf
        if self._fd is None or not buf and (self._detail or self._fold.win.events <= self._prog_mark):
            return
        with self._lock:
            n = len(buf)
            chunk = buf[:n]
            # Delete exactly what was taken: events appended meanwhile by another thread stay queued.
            del buf[:n]
            self._out = out = []
            self._fold_chunk(chunk, out, background)
            self._out = []
            if out:
                self._write("".join(out).encode())

    def _fold_chunk(self, chunk: list, out: list, background: bool = False) -> None:
        fold = self._fold
        for ev in chunk:
            kind = ev[0]
            if kind in (META, MODEL, BLOCKED):
                # rank-level lines, written as they come whatever the window
                if kind == MODEL:
                    fold.feed(ev)
                out.append(self._line(ev))
                continue
            res = fold.feed(ev)
            if self._detail:
                out.append(self._line(ev))
                if res is not None and res[0] == "close":
                    self._window_closed(res[1], ev, True, out)
            elif res is None:
                events = self._win_events
                if events is not None:
                    events.append(ev)
                    if len(events) > MAX_WINDOW_EVENTS:
                        self._win_events = None
            elif res[0] == "merge":
                out.append(self._line(ev))
            else:
                self._window_closed(res[1], ev, False, out)
        if not self._detail and fold.win.events > self._prog_mark and not (
                background and time.monotonic() - self._prog_t < self.progress_interval_s):
            # Between steps (a barrier, destroy_process_group, the background flusher every few seconds):
            # what the open window did so far, in one line, so a kill keeps it and a hang shows progress.
            self._prog_mark = fold.win.events
            self._prog_t = time.monotonic()
            out.append(_encode([PROG, now_us(), *fold.snapshot().fields(self._intern)]) + "\n")

    def _window_closed(self, totals, step: list, written: bool, out: list) -> None:
        self._closed += 1
        signature = totals.signature(step)
        if not written:
            events = self._win_events
            detail = events is not None and (self._force > 0 or (
                signature not in self._recent and self._budget > 0))
            if detail:
                if self._force <= 0:
                    self._budget -= 1
                for ev in events:
                    out.append(self._line(ev))       # (_line may append a path line first)
                out.append(self._line(step))
            else:
                out.append(_encode([AGG, step[1], step[2], step[3], self._intern(step[4]), step[5],
                                    step[6] if len(step) > 6 else None,
                                    *totals.fields(self._intern)]) + "\n")
        recent = self._recent
        recent[signature] = None
        recent.move_to_end(signature)
        if len(recent) > RECENT_SIGNATURES:
            recent.popitem(last=False)
        if self._closed % DETAIL_REFILL == 0 and self._budget < DETAIL_BUDGET:
            self._budget += 1
        if self._force > 0:
            self._force -= 1
        self._win_events = []
        self._prog_mark = 0
        self._detail = self.full or self._closed < WARMUP_WINDOWS or self._force > 0

    def _intern(self, path):
        if not isinstance(path, str):
            return path
        pid = self._paths.get(path)
        if pid is None:
            pid = self._paths[path] = len(self._paths)
            self._out.append(_encode([PATH, pid, path]) + "\n")
        return pid

    def _line(self, ev: list) -> str:
        i = F.PATH_FIELD.get(ev[0])
        if i is not None and len(ev) > i and isinstance(ev[i], str):
            ev = list(ev)
            ev[i] = self._intern(ev[i])
        return _encode(ev) + "\n"

    def _write(self, data: bytes) -> None:
        fd = self._fd
        if fd is None:
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError as exc:
            # Disk full or the folder vanished: say so once and stop recording, never break training.
            self.active = False
            self.failed = True
            print(f"synccheck: rank {self.rank} stopped recording: {exc.strerror}", file=sys.stderr)

    def _flusher(self) -> None:
        while self.active:
            time.sleep(FLUSH_INTERVAL_S)
            try:
                self.flush(background=True)
                current = self.current
                if current is not None and current is not self._blocked_reported:
                    name, path, line, t = current
                    if now_us() - t > BLOCKED_AFTER_S * 1e6:
                        # The main thread has been inside this blocking collective for a while: note it,
                        # so a hang report names it even where py-spy cannot attach.
                        self._blocked_reported = current
                        self.event([BLOCKED, t, name, path, line])
                        self.flush()
            except Exception:
                return


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def write_process_marker(out_dir: str, session: str, role: str) -> None:
    """One small file per Python process that imported torch, so the report can tell "the command never
    initialized torch.distributed" apart from "no Python process was ever hooked"."""
    try:
        path = os.path.join(out_dir, f"proc.{socket.gethostname()}.{os.getpid()}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"session": session, "pid": os.getpid(), "ppid": os.getppid(), "role": role,
                       "argv": list(sys.argv)}, fh)
    except OSError:
        pass
