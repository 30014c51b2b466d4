"""`--hang-timeout`: notice that no rank makes progress, show where each rank is blocked, stop the job.

A sync bug that does not waste time hangs instead: rank 0 waits in `barrier` while rank 1 waits in
`all_reduce`, and neither returns (gloo's default timeout is 30 minutes). Progress is read from the rank
record files (a micro-step, a collective or an optimizer step flushed by any rank); when there has been
none for the timeout, every worker (the pids in the records, checked against the launcher's process tree)
is dumped with `py-spy dump`, the stacks are shown side by side, and the job is stopped.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from synccheck.profiler.frames import is_library
from synccheck.profiler.records import RankTail

DUMP_TIMEOUT_S = 20.0

# Frames inside torch.distributed's collectives: the innermost one names what a rank is blocked in.
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_WAIT_NAMES = ("wait", "_wait", "wait_stream", "synchronize")


def find_py_spy() -> str | None:
    """py-spy on PATH, or installed next to this interpreter (a virtual environment not activated)."""
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return candidate if os.access(candidate, os.X_OK) else None


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc (Linux); empty where /proc is not available."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may contain spaces and parentheses: fields start after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 2 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def _classify_dump_error(text: str) -> str:
    lowered = text.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered or "ptrace" in lowered:
        return "ptrace"
    if "no such process" in lowered or "failed to find" in lowered or "process" in lowered and "exited" in lowered:
        return "exited"
    return "error"


def dump_stack(py_spy: str, pid: int) -> dict:
    """`py-spy dump --json` of one process: {'threads': [...]} or {'error': kind, 'message': line}."""
    try:
        proc = subprocess.run([py_spy, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True,
                              timeout=DUMP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": "timeout", "message": f"py-spy dump of pid {pid} took over {DUMP_TIMEOUT_S:.0f}s"}
    except OSError as exc:
        return {"error": "error", "message": f"cannot run py-spy: {exc.strerror or exc}"}
    if proc.returncode != 0:
        # py-spy's first line says what failed; "Caused by:" details and a Rust backtrace (RUST_BACKTRACE) follow.
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        text = lines[0] if lines else f"py-spy exited with {proc.returncode}"
        kind = _classify_dump_error(proc.stderr + proc.stdout)
        # A worker that died while being dumped may still be a zombie (not reaped yet): /proc/PID exists.
        if kind == "exited" or (kind != "ptrace" and not alive(pid)):
            return {"error": "exited", "message": f"exited while being dumped (py-spy: {text})"}
        return {"error": kind, "message": text}
    try:
        threads = json.loads(proc.stdout)
    except ValueError:
        return {"error": "error", "message": "py-spy printed something that is not JSON"}
    return {"threads": threads}


def main_thread(threads: list) -> dict | None:
    for thread in threads:
        if thread.get("thread_name") == "MainThread":
            return thread
    # py-spy could not read names: the main thread's OS id is the process id.
    for thread in threads:
        if thread.get("os_thread_id") == thread.get("pid"):
            return thread
    return threads[0] if threads else None


def analyse_stack(frames: list) -> dict:
    """Innermost first (py-spy's order): the collective the rank is blocked in, and the user's line."""
    collective = None
    for frame in frames:
        filename = frame.get("filename") or ""
        name = (frame.get("name") or "").rsplit(".", 1)[-1]
        if filename.endswith(_C10D_FILE) and not name.startswith("_"):
            collective = name
            break
        if name in _WAIT_NAMES and collective is None and "torch" in filename:
            collective = name
    if collective is None:
        for frame in frames:
            if (frame.get("name") or "").endswith("backward") and "torch" in (frame.get("filename") or ""):
                collective = "backward (DDP gradient all-reduce)"
                break
    user = next((f for f in frames if f.get("filename") and not is_library(f["filename"])), None)
    return {"collective": collective,
            "path": user.get("filename") if user else None,
            "line": user.get("line") if user else None}


class HangWatch:
    def __init__(self, out_dir: str, session: str, child, timeout: float, grace: float) -> None:
        self.tail = RankTail(out_dir, session)
        self.child = child
        self.timeout = timeout
        self.grace = grace
        self.report: dict | None = None
        self.disabled = False

    def check(self) -> None:
        if self.disabled or self.report is not None:
            return
        now = time.time()
        self.tail.poll(now)
        if self.tail.first_activity is None:
            return  # the clock starts at the first micro-step, collective or step of any rank
        stalled = now - max([self.tail.first_activity, *self.tail.last_progress.values()])
        if stalled >= self.timeout:
            self._on_hang(stalled)

    def finish(self) -> None:
        pass

    def _say(self, message: str) -> None:
        print(f"synccheck: {message}", file=sys.stderr, flush=True)

    def _on_hang(self, stalled: float) -> None:
        py_spy = find_py_spy()
        from_records = self._from_records()
        if py_spy is None:
            self._say(f"no rank made progress for {stalled:.0f}s, but py-spy is not installed (pip install "
                      f"py-spy), so the stacks cannot be dumped; {from_records or 'still profiling'}")
            self.disabled = True
            return
        tree = set(descendants(self.child.pid)) | {self.child.pid}
        ranks = []
        for rank, meta in sorted(self.tail.ranks.items()):
            pid = int(meta.get("pid", 0))
            entry = {"rank": rank, "pid": pid, "host": meta.get("host")}
            if pid not in tree:
                # Another node's rank, or a rank that already exited: nothing to dump here.
                entry.update(error="not-here", message="not a running process of this launcher")
                ranks.append(entry)
                continue
            result = dump_stack(py_spy, pid)
            if "threads" in result:
                thread = main_thread(result["threads"])
                frames = thread.get("frames", []) if thread else []
                entry.update(analyse_stack(frames))
                entry["stack"] = [{"name": f.get("name"), "path": f.get("filename"), "line": f.get("line")}
                                  for f in frames]
            else:
                entry.update(result)
            ranks.append(entry)
        local = [r for r in ranks if r.get("error") != "not-here"]
        if local and all(r.get("error") == "ptrace" for r in local):
            self._say(f"no rank made progress for {stalled:.0f}s, but py-spy may not attach (ptrace refused: "
                      "run as root, or set /proc/sys/kernel/yama/ptrace_scope to 0); "
                      f"{from_records or 'still profiling'}")
            self.disabled = True
            return
        self._fill_from_records(ranks)
        summary = ", ".join(_describe(r) for r in ranks)
        blocked_in = {r.get("collective") for r in ranks if r.get("collective")}
        mismatch = len(blocked_in) > 1 or any(r.get("collective") is None for r in ranks)
        self.report = {"timeout_s": self.timeout, "stalled_s": round(stalled, 1), "ranks": ranks,
                       "summary": summary, "mismatch": mismatch, "stopped": False}
        self._say(f"no rank made progress for {stalled:.0f}s: {summary}; stopping the job")
        self.report["stopped"] = self._stop(tree)

    def _from_records(self) -> str:
        parts = []
        for rank in sorted(self.tail.ranks):
            blocked = [ev for ev in self.tail.last_events.get(rank, []) if ev[0] == "blk"]
            if blocked:
                ev = blocked[-1]
                parts.append(f"rank {rank} in {ev[2]} at {_short(ev[3])}:{ev[4]}")
        return ("records say: " + ", ".join(parts)) if parts else ""

    def _fill_from_records(self, ranks: list) -> None:
        """Where py-spy could not tell, the flusher's 'blocked in' record may."""
        for entry in ranks:
            if entry.get("collective"):
                continue
            blocked = [ev for ev in self.tail.last_events.get(entry["rank"], []) if ev[0] == "blk"]
            if blocked:
                ev = blocked[-1]
                entry.setdefault("collective", ev[2])
                entry["collective"] = entry["collective"] or ev[2]
                entry["path"], entry["line"] = entry.get("path") or ev[3], entry.get("line") or ev[4]

    def _stop(self, tree: set) -> bool:
        """SIGTERM to the job's process group and every process of its tree, SIGKILL after the grace."""
        pgid = self.child.pid
        _signal_all(pgid, tree, signal.SIGTERM)
        deadline = time.time() + self.grace
        while time.time() < deadline:
            if self.child.poll() is not None and not _any_alive(tree - {self.child.pid}):
                return True
            time.sleep(0.1)
        _signal_all(pgid, tree | set(descendants(self.child.pid)), signal.SIGKILL)
        return True


def _signal_all(pgid: int, pids: set, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    """Whether `pid` runs (an unreaped zombie does not), from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _any_alive(pids: set) -> bool:
    return any(alive(pid) for pid in pids)


def _short(path: str | None) -> str:
    if not path:
        return "?"
    marker = os.sep + "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]   # torch/distributed/distributed_c10d.py, as py-spy shows it
    try:
        rel = os.path.relpath(path)
        return path if rel.startswith("..") else rel
    except ValueError:
        return path


def _describe(entry: dict) -> str:
    rank = entry["rank"]
    if entry.get("error") == "exited":
        # Where the records last saw it, if they did; the dump itself has nothing to show.
        last = (f", last recorded in {entry['collective']} at {_short(entry.get('path'))}:{entry.get('line')}"
                if entry.get("collective") else "")
        return f"rank {rank} exited while being dumped (pid {entry.get('pid')}){last}"
    if entry.get("error") and not entry.get("collective"):
        return f"rank {rank}: {entry.get('message', entry['error'])}"
    where = f" at {_short(entry.get('path'))}:{entry.get('line')}" if entry.get("path") else ""
    what = entry.get("collective") or "not in a collective"
    return f"rank {rank} in {what}{where}"


def trim_stack(stack: list, keep_library: int = 1) -> list:
    """The frames worth reading, innermost first: the collective, the user's frames, and up to
    `keep_library` library frames around them; other runs of library frames become a count."""
    out: list = []
    skipped = 0
    library_run = 0
    for frame in stack:
        path = frame.get("path") or ""
        if path.endswith(_C10D_FILE):
            kind = "collective"
        elif path and not is_library(path):
            kind = "user"
        else:
            kind = "library"
        if kind == "library" and (library_run >= keep_library or not out):
            skipped += 1
            library_run += 1
            continue
        if skipped:
            out.append(("skipped", skipped))
            skipped = 0
        library_run = library_run + 1 if kind == "library" else 0
        out.append((kind, frame))
    if skipped:
        out.append(("skipped", skipped))
    return out


def print_hang(report: dict, console) -> None:
    from rich.columns import Columns
    from rich.panel import Panel
    from rich.text import Text

    panels = []
    for entry in report["ranks"]:
        body = Text()
        if entry.get("stack"):
            for kind, frame in trim_stack(entry["stack"]):
                if kind == "skipped":
                    body.append(f"  ... {frame} library frames\n", style="dim")
                    continue
                style = {"collective": "bold red", "user": "bold", "library": "dim"}[kind]
                body.append(f"{frame.get('name') or '?'} ({_short(frame.get('path'))}:{frame.get('line')})\n",
                            style=style)
        else:
            body.append(entry.get("message") or "no stack", style="yellow")
        title = f"rank {entry['rank']} (pid {entry.get('pid')})"
        panels.append(Panel(body, title=title, title_align="left", expand=True))
    console.print(Text(f"hang: no rank made progress for {report['stalled_s']}s "
                       f"(--hang-timeout {report['timeout_s']:g})", style="bold red"))
    console.print(Columns(panels, equal=True, expand=True))
    style = "bold red" if report.get("mismatch") else "bold yellow"
    console.print(Text(report["summary"], style=style))
    if report.get("mismatch"):
        console.print(Text("the ranks are blocked in different collectives: every rank must run the same "
                           "collectives in the same order (a collective under `if rank == 0:` hangs the others)",
                           style="red"))
