"""Helpers shared by the profiler tests: run `synccheck profile` on real gloo jobs and read what it wrote."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
RUN_TIMEOUT = 180


def script(name: str) -> str:
    return str(SCRIPTS / name)


def line_of(path: str, marker: str) -> int:
    """1-based line of the first line containing `marker` (tests never hard-code line numbers)."""
    for number, text in enumerate(Path(path).read_text().splitlines(), 1):
        if marker in text:
            return number
    raise AssertionError(f"{marker!r} not in {path}")


def base_env(**extra) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SYNCCHECK_PROFILE_OUT", None)
    env.pop("SYNCCHECK_PROFILE_SESSION", None)
    env.update(extra)
    return env


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    report: dict | None
    out_dir: Path

    def rank(self, r: int) -> dict:
        for entry in self.report["ranks"]:
            if entry["rank"] == r:
                return entry
        raise AssertionError(f"rank {r} missing from report: {self.report['ranks']}")

    def codes(self) -> list[str]:
        return sorted(f["code"] for f in self.report["findings"])

    def finding(self, code: str) -> dict:
        found = [f for f in self.report["findings"] if f["code"] == code]
        assert found, f"no {code} in {self.report['findings']}\n{self.stderr}"
        return found[0]


def synccheck_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "synccheck", *args]


def profile(tmp_path: Path, command: list[str], *options: str, env: dict | None = None,
            timeout: float = RUN_TIMEOUT, name: str = "run") -> Run:
    out_dir = tmp_path / f"{name}-records"
    report_path = tmp_path / f"{name}-report.json"
    cmd = synccheck_cmd("profile", "--out", str(out_dir), "--json", str(report_path), *options, "--", *command)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or base_env(), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"synccheck profile did not finish in {timeout}s\n{stderr[-4000:]}")
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return Run(proc.returncode, stdout, stderr, report, out_dir)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *args]


def accelerate_launch(*args: str, nproc: int = 2, exe: str = ACCELERATE) -> list[str]:
    """`accelerate launch` starting `nproc` local processes on this CPU-only machine.

    `--multi_gpu` is the flag that makes accelerate start several local processes (it runs
    torch.distributed.run inside the `accelerate` process); `--cpu` would choose its single-process
    launcher, or mpirun with --mpirun_hostfile. The scripts pass `Accelerator(cpu=True)`, so the workers
    use gloo. The other flags only silence accelerate's "defaults used" warning."""
    launch = [exe] if exe.endswith("accelerate-launch") else [exe, "launch"]
    return [*launch, "--multi_gpu", f"--num_processes={nproc}", f"--main_process_port={free_port()}",
            "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", *args]


def windows(out_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """rank -> (micro-steps, synced micro-steps) of every optimizer-step window, as the verdict sees them."""
    from synccheck.profiler import records, verdict
    ranks, _ = records.load_ranks(str(out_dir))
    result = {}
    for record in ranks:
        summary = verdict.summarize(record)
        result[record.rank] = [(w.micro_steps, w.synced_micro_steps) for w in summary.windows]
    return result


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not running any more.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_records(out_dir: Path) -> dict[int, list]:
    """rank -> events, straight from the record files (to check what survived a crash)."""
    ranks: dict[int, list] = {}
    for path in sorted(out_dir.glob("rank-*.jsonl")):
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass  # a line cut short by a kill
        meta = events[0][1]
        ranks[meta["rank"]] = events
    return ranks


def count(events: list, kind: str) -> int:
    return sum(1 for ev in events if ev[0] == kind)
