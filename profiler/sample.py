"""`--sample PATH`: a py-spy profile of every worker, and each rank's share of time in communication.

py-spy attaches to the launched command (`py-spy record --pid CHILD --subprocesses`) rather than launching
it, because `py-spy record -- CMD` does not return CMD's exit code. `--idle` keeps the samples where the
training thread waits with the GIL released (a blocking all-reduce), and `--native` shows the C++ frames
that say what it waits for (`c10d::Work::wait`, `Reducer::finalize_backward`, gloo).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile

from synccheck.profiler.hang import find_py_spy
from synccheck.profiler.records import load_ranks

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


class Sampler:
    def __init__(self, path: str, fmt: str, rate: int) -> None:
        self.path = os.path.abspath(path)
        self.format = fmt
        self.rate = rate
        self.notes: list[str] = []
        self.proc = None
        self._log = None

    def start(self, pid: int) -> None:
        py_spy = find_py_spy()
        if py_spy is None:
            self.notes.append("--sample: py-spy is not installed (pip install py-spy); no profile recorded")
            return
        self._log = tempfile.TemporaryFile(mode="w+")
        cmd = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--idle", "--native",
               "--rate", str(self.rate), "--format", self.format, "--output", self.path]
        try:
            # Its own session: a Ctrl-C meant for the job must not stop the recorder before it writes.
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self.notes.append(f"--sample: cannot run py-spy: {exc.strerror or exc}")

    def finish(self, out_dir: str, session: str) -> dict | None:
        if self.proc is None:
            return None
        try:
            # py-spy stops by itself once the process it follows has exited, and then writes the file.
            self.proc.wait(timeout=FINISH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        log = ""
        if self._log is not None:
            self._log.seek(0)
            log = self._log.read()
            self._log.close()
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            reason = _last_error_line(log) or f"py-spy exited with {self.proc.returncode}"
            if "permission" in log.lower() or "ptrace" in log.lower():
                reason = "ptrace refused (run as root, or set /proc/sys/kernel/yama/ptrace_scope to 0)"
            self.notes.append(f"--sample: no profile written: {reason}")
            return {"path": self.path, "format": self.format, "ranks": [], "error": reason}
        ranks, _ = load_ranks(out_dir, session=session)
        pid_to_rank = {r.pid: r.rank for r in ranks}
        try:
            per_pid = (_shares_speedscope(self.path) if self.format == "speedscope" else _shares_raw(self.path))
        except (OSError, ValueError, KeyError) as exc:
            self.notes.append(f"--sample: could not read {self.path}: {exc}")
            return {"path": self.path, "format": self.format, "ranks": [], "error": str(exc)}
        result = []
        for pid, (samples, comm) in sorted(per_pid.items()):
            if pid not in pid_to_rank:
                continue  # the launcher agent, mp.spawn's parent: not a rank
            result.append({"rank": pid_to_rank[pid], "pid": pid, "samples": samples, "comm_samples": comm,
                           "comm_share": round(comm / samples, 4) if samples else None})
        result.sort(key=lambda r: r["rank"])
        missing = sorted(set(pid_to_rank.values()) - {r["rank"] for r in result})
        if missing:
            self.notes.append(f"--sample: no samples for rank(s) {', '.join(map(str, missing))}")
        return {"path": self.path, "format": self.format, "rate": self.rate, "ranks": result, "error": None}


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
