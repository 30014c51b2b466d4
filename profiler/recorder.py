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

This module imports only the standard library; the torch hooks live in `hooks.py`.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

FORMAT_VERSION = 1

# Environment set by the launcher (`synccheck profile`); a worker without them records nothing.
ENV_OUT = "SYNCCHECK_PROFILE_OUT"
ENV_SESSION = "SYNCCHECK_PROFILE_SESSION"
ENV_COMM_HOOK = "SYNCCHECK_PROFILE_COMM_HOOK"

# Event kinds (first element of every record line). Kept short: a line is written per micro-step.
META = "meta"       # ["meta", {...}]                                   once, first line
MODEL = "model"     # ["model", t, model_id, kind, n_params, n_bytes, path, line]
FORWARD = "fwd"     # ["fwd", t, model_id, synced, path, line]           one per micro-step
BUCKET = "bkt"      # ["bkt", t, dur, model_id, n_bytes, communicated]   one per DDP gradient bucket
COLLECTIVE = "coll" # ["coll", t, dur, name, n_bytes, role, path, line]  Python-level collective
LATE_NO_SYNC = "late"  # ["late", t, model_id, how, path, line]          SC102 evidence
STEP = "step"       # ["step", t, n, optimizer_index, path, line, checksum]
BLOCKED = "blk"     # ["blk", t, name, path, line]                      written by the flusher thread

PROGRESS_KINDS = frozenset({FORWARD, BUCKET, COLLECTIVE, STEP})

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

    def _open(self, rank: int, world_size: int, backend: str) -> bool:
        host = socket.gethostname()
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

    def flush(self) -> None:
        buf = self._buf
        if not buf or self._fd is None:
            return
        with self._lock:
            n = len(buf)
            if not n:
                return
            chunk = buf[:n]
            # Delete exactly what was taken: events appended meanwhile by another thread stay queued.
            del buf[:n]
            data = "".join(_encode(ev) + "\n" for ev in chunk).encode()
            self._write(data)

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
                self.flush()
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
