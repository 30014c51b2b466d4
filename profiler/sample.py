"""`--sample PATH`: a py-spy profile of every worker, and each rank's share of time in communication.

One `py-spy record --pid WORKER` per rank, started as soon as the rank's record file appears (at
`init_process_group`), rather than one `py-spy record --subprocesses` on the whole command tree:
py-spy's subprocess discovery is where it crashes (SIGSEGV while it inspects a process that has just
been spawned, py-spy issues #638 and #724), and one crashed recorder used to lose every rank's profile.
Per rank, a recorder that dies while its worker lives is started again, and what each recorder wrote is
merged into PATH in the shape `--subprocesses` writes (one `Process PID` profile per rank). Attaching
at `init_process_group` also leaves out start-up (imports), which is not training.

py-spy attaches to the workers rather than launching the command, because `py-spy record -- CMD` does
not return CMD's exit code. `--idle` keeps the samples where the training thread waits with the GIL
released (a blocking all-reduce), and `--native` shows the C++ frames that say what it waits for
(`c10d::Work::wait`, `Reducer::finalize_backward`, gloo).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from synccheck.profiler.hang import alive, descendants, find_py_spy
from synccheck.profiler.records import rank_files, read_meta

# Frame names (Python or native) that mean "communicating or waiting for it".
_COMM_PATTERNS = ("gloo", "nccl", "c10d::", "processgroup", "allreduce", "all_reduce", "barrier", "broadcast",
                  "reduce_scatter", "allgather", "all_gather", "work::wait", "future::wait", "finalize_backward",
                  "_counting_comm_hook")
# Start-up, not training: imports, and the rendezvous inside init_process_group.
_STARTUP_PATTERNS = ("_find_and_load", "init_process_group", "tcpstore::waitforworkers")
_THREAD_ROOT = "Thread._bootstrap"
_PROFILE_NAME = re.compile(r"Process (\d+) Thread (\d+)")
_RAW_PROCESS = re.compile(r"^process (\d+):")
FINISH_TIMEOUT_S = 60.0
# A recorder that crashes while its worker still runs is started again, this many times at most.
MAX_RESTARTS = 3
ZOMBIE_GRACE_S = 5.0


class _Recorder:
    """The py-spy recorders of one rank's worker: one part file per start."""

    def __init__(self, rank: int, pid: int) -> None:
        self.rank = rank
        self.pid = pid
        self.proc: subprocess.Popen | None = None
        self.parts: list[str] = []
        self.logs: list[str] = []
        self.crashes: list[int] = []     # signal numbers of recorders that died by a signal
        self.exited_at: float | None = None  # when its worker was first seen exited (a zombie)


class Sampler:
    def __init__(self, path: str, fmt: str, rate: int) -> None:
        self.path = os.path.abspath(path)
        self.format = fmt
        self.rate = rate
        self.notes: list[str] = []
        self.py_spy: str | None = None
        self.root: int | None = None
        self.out_dir = ""
        self.session = ""
        self.host = socket.gethostname()
        self.recorders: dict[int, _Recorder] = {}     # worker pid -> its recorders
        self._seen: set[str] = set()
        self._parts_dir: str | None = None
        self._restart = True

    def start(self, pid: int, out_dir: str, session: str) -> None:
        self.py_spy = find_py_spy()
        if self.py_spy is None:
            self.notes.append("--sample: py-spy is not installed (pip install py-spy); no profile recorded")
            return
        self.root, self.out_dir, self.session = pid, out_dir, session
        self._parts_dir = tempfile.mkdtemp(prefix="synccheck-sample-")

    def poll(self) -> None:
        """Attach to ranks that appeared since the last poll; restart recorders that crashed."""
        if self.py_spy is None:
            return
        tree = None
        for path in rank_files(self.out_dir):
            if path in self._seen:
                continue
            meta = read_meta(path)
            if meta is None:
                continue            # its first line is not written yet: look again next time
            self._seen.add(path)
            if meta.get("session") != self.session or meta.get("host") != self.host:
                continue            # another run, or another node of this job (its own launcher samples it)
            pid = int(meta.get("pid", 0))
            if tree is None:
                tree = set(descendants(self.root))
            if pid in tree and pid not in self.recorders:
                rec = self.recorders[pid] = _Recorder(int(meta["rank"]), pid)
                self._launch(rec)
        for rec in self.recorders.values():
            proc = rec.proc
            if proc is None:
                continue
            if proc.poll() is None:
                self._stop_if_worker_exited(rec)
                continue
            rec.proc = None
            if proc.returncode < 0:
                rec.crashes.append(-proc.returncode)
                if self._restart and len(rec.crashes) <= MAX_RESTARTS and alive(rec.pid):
                    self._launch(rec)

    def _stop_if_worker_exited(self, rec: _Recorder) -> None:
        """A worker that exited while py-spy is attached stays a zombie its parent cannot reap until the
        tracer lets go; a py-spy that does not notice (seen under load) would hold the whole job. Past
        ZOMBIE_GRACE_S, it is asked to write what it has and stop (SIGINT, as on Ctrl-C); past three times
        that, it is killed."""
        if alive(rec.pid):
            rec.exited_at = None
            return
        now = time.monotonic()
        if rec.exited_at is None:
            rec.exited_at = now
            return
        try:
            if now - rec.exited_at > 3 * ZOMBIE_GRACE_S:
                rec.proc.kill()               # (a SIGINT it ignores: its part of the profile is lost)
            elif now - rec.exited_at > ZOMBIE_GRACE_S:
                rec.proc.send_signal(signal.SIGINT)
        except OSError:
            pass

    def _launch(self, rec: _Recorder) -> None:
        n = len(rec.parts)
        part = os.path.join(self._parts_dir, f"{rec.pid}.{n}.{self.format}")
        log_path = os.path.join(self._parts_dir, f"{rec.pid}.{n}.log")
        cmd = [self.py_spy, "record", "--pid", str(rec.pid), "--idle", "--native", "--rate", str(self.rate),
               "--format", self.format, "--output", part]
        try:
            with open(log_path, "w") as log:
                # Its own session: a Ctrl-C meant for the job must not stop the recorder before it writes.
                rec.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        except OSError as exc:
            self.notes.append(f"--sample: cannot run py-spy: {exc.strerror or exc}")
            self.py_spy = None
            return
        rec.parts.append(part)
        rec.logs.append(log_path)

    def finish(self) -> dict | None:
        if self._parts_dir is None:
            return None
        try:
            self.poll()             # a rank that started and ended between two polls
            deadline = time.monotonic() + FINISH_TIMEOUT_S
            for rec in self.recorders.values():
                # py-spy stops by itself once the process it follows has exited, and then writes the file.
                while rec.proc is not None:
                    left = deadline - time.monotonic()
                    self._restart = left > 0
                    _wait(rec.proc, max(0.0, left))
                    self.poll()     # a recorder that crashed before its worker exited starts again
            return self._report()
        finally:
            shutil.rmtree(self._parts_dir, ignore_errors=True)

    def _report(self) -> dict:
        for rec in self.recorders.values():
            if rec.crashes:
                sigs = ", ".join(_signal_name(s) for s in rec.crashes)
                self.notes.append(f"--sample: py-spy crashed while recording rank {rec.rank} ({sigs}); "
                                  f"{'restarted, ' if len(rec.parts) > 1 else ''}that rank's profile has gaps")
        parts = [(rec, part) for rec in self.recorders.values() for part in rec.parts
                 if os.path.exists(part) and os.path.getsize(part) > 0]
        if not parts:
            reason = self._no_profile_reason()
            self.notes.append(f"--sample: no profile written: {reason}")
            return {"path": self.path, "format": self.format, "ranks": [], "error": reason}
        try:
            if self.format == "speedscope":
                _merge_speedscope(parts, self.path)
            else:
                _merge_raw(parts, self.path)
        except OSError as exc:
            self.notes.append(f"--sample: could not write {self.path}: {exc.strerror or exc}")
            return {"path": self.path, "format": self.format, "ranks": [], "error": str(exc)}
        pid_to_rank = {rec.pid: rec.rank for rec in self.recorders.values()}
        try:
            per_pid = (_shares_speedscope(self.path) if self.format == "speedscope" else _shares_raw(self.path))
        except (OSError, ValueError, KeyError) as exc:
            self.notes.append(f"--sample: could not read {self.path}: {exc}")
            return {"path": self.path, "format": self.format, "ranks": [], "error": str(exc)}
        result = []
        for pid, (samples, comm) in sorted(per_pid.items()):
            if pid not in pid_to_rank:
                continue
            result.append({"rank": pid_to_rank[pid], "pid": pid, "samples": samples, "comm_samples": comm,
                           "comm_share": round(comm / samples, 4) if samples else None})
        result.sort(key=lambda r: r["rank"])
        missing = sorted({rec.rank for rec in self.recorders.values()} - {r["rank"] for r in result})
        if missing:
            self.notes.append(f"--sample: no samples for rank(s) {', '.join(map(str, missing))}")
        return {"path": self.path, "format": self.format, "rate": self.rate, "ranks": result, "error": None}

    def _no_profile_reason(self) -> str:
        if not self.recorders:
            return "no worker of the command initialised torch.distributed, so none was sampled"
        log = ""
        for rec in self.recorders.values():
            for path in rec.logs:
                try:
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        log += fh.read()
                except OSError:
                    pass
        if "permission" in log.lower() or "ptrace" in log.lower():
            return "ptrace refused (run as root, or set /proc/sys/kernel/yama/ptrace_scope to 0)"
        return _last_error_line(log) or "py-spy wrote no samples"


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGINT)     # py-spy writes what it has on Ctrl-C
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _merge_speedscope(parts: list, path: str) -> None:
    """One speedscope file from per-worker ones, named as `py-spy record --subprocesses` names them."""
    frames: list = []
    profiles: list = []
    for rec, part in parts:
        try:
            with open(part, encoding="utf-8") as fh:
                data = json.load(fh)
            part_frames = data["shared"]["frames"]
            part_profiles = data["profiles"]
        except (OSError, ValueError, KeyError, TypeError):
            continue                  # a recorder killed while writing: its part is lost, not the others
        offset = len(frames)
        frames.extend(part_frames)
        for profile in part_profiles:
            profile = dict(profile)
            profile["name"] = f"Process {rec.pid} {profile.get('name', '')}"
            profile["samples"] = [[i + offset for i in stack] for stack in profile.get("samples", [])]
            profiles.append(profile)
    merged = {"$schema": "https://www.speedscope.app/file-format-schema.json", "profiles": profiles,
              "shared": {"frames": frames}, "activeProfileIndex": 0, "exporter": "synccheck profile --sample",
              "name": "synccheck profile"}
    _write_atomically(path, json.dumps(merged))


def _merge_raw(parts: list, path: str) -> None:
    """One collapsed-stack file, each line prefixed by its process as `--subprocesses` writes it."""
    lines = []
    for rec, part in parts:
        try:
            with open(part, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.strip():
                        lines.append(f'process {rec.pid}:"rank {rec.rank}";{line.rstrip()}\n')
        except OSError:
            continue
    _write_atomically(path, "".join(lines))


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _last_error_line(log: str) -> str:
    lines = [l.strip() for l in log.splitlines() if l.strip() and not l.startswith("py-spy>")]
    for line in lines:
        if line.lower().startswith("error"):
            return line
    return lines[-1] if lines else ""


def _classify(names: list) -> str | None:
    """'startup', 'comm', or None (compute) for one sample's frame names (any order)."""
    lowered = [n.lower() for n in names]
    if any(p in n for n in lowered for p in _STARTUP_PATTERNS):
        return "startup"
    if any(p in n for n in lowered for p in _COMM_PATTERNS):
        return "comm"
    return None


def _shares_speedscope(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    frames = data["shared"]["frames"]
    per_pid: dict[int, list] = {}
    for profile in data["profiles"]:
        match = _PROFILE_NAME.search(profile.get("name", ""))
        if not match:
            continue
        pid, tid = int(match.group(1)), int(match.group(2))
        if pid != tid:
            continue  # only the main (training) thread of each process
        counts = per_pid.setdefault(pid, [0, 0])
        weights = profile.get("weights") or [1] * len(profile["samples"])
        for stack, _weight in zip(profile["samples"], weights):
            names = [frames[i]["name"] for i in stack]
            kind = _classify(names)
            if kind == "startup":
                continue
            counts[0] += 1
            counts[1] += kind == "comm"
    return {pid: tuple(c) for pid, c in per_pid.items()}


def _shares_raw(path: str) -> dict:
    per_pid: dict[int, list] = {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.rstrip("\n")
            match = _RAW_PROCESS.match(line)
            if not match:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            names = stack.split(";")[1:]
            if any(_THREAD_ROOT in name or name.startswith("_bootstrap (") for name in names):
                continue  # a helper thread (our flusher, a data loader thread), not the training thread
            kind = _classify(names)
            if kind == "startup":
                continue
            counts = per_pid.setdefault(int(match.group(1)), [0, 0])
            counts[0] += n
            counts[1] += n if kind == "comm" else 0
    return {pid: tuple(c) for pid, c in per_pid.items()}


def print_sample(sample: dict, console) -> None:
    from rich.text import Text

    if sample.get("error"):
        return  # the note says why
    parts = [f"rank {r['rank']} {100 * (r['comm_share'] or 0):.0f}% of {r['samples']}"
             for r in sample["ranks"]]
    console.print(Text(f"py-spy profile ({sample['format']}) written to {sample['path']}; share of training-"
                       f"thread samples in communication: {', '.join(parts) or 'no rank sampled'}"))
