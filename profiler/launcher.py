"""`synccheck profile -- CMD`: run CMD with the bootstrap injected, wait, merge the records, report.

The launcher never imports torch: it only sets the environment, forwards signals, watches the record
files (for `--hang-timeout`), and reads them back when the command is done.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from synccheck.profiler import recorder as R

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
POLL_S = 0.25


class UsageError(Exception):
    """Bad input: one line on stderr and exit code `code`, before the command starts."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ProfileOptions:
    command: list
    out_dir: str | None = None
    json_path: str | None = None
    trace_path: str | None = None
    strict: bool = False
    hang_timeout: float | None = None
    hang_grace: float = 5.0
    sample_path: str | None = None
    sample_format: str = "speedscope"
    sample_rate: int = 100
    comm_hook: bool = False


@dataclass
class RunResult:
    exit_code: int
    session: str
    out_dir: str
    started: float
    ended: float
    interrupted: str | None = None
    hang: dict | None = None
    sample: dict | None = None
    notes: list = field(default_factory=list)


def resolve_command(command: list) -> str:
    """The executable CMD names, or UsageError with the shell's exit codes (127 not found, 126 not
    executable)."""
    if not command:
        raise UsageError("no command after `--` (usage: synccheck profile [options] -- CMD ...)")
    exe = command[0]
    if os.sep in exe or (os.altsep and os.altsep in exe):
        if not os.path.exists(exe):
            raise UsageError(f"command not found: {exe}", 127)
        if os.path.isdir(exe) or not os.access(exe, os.X_OK):
            raise UsageError(f"command is not executable: {exe}", 126)
        return exe
    found = shutil.which(exe)
    if found is None:
        raise UsageError(f"command not found: {exe}", 127)
    return found


def prepare_out_dir(out_dir: str | None) -> str:
    """Create (or check) the records folder, and prove it is writable before the command starts."""
    if out_dir is None:
        return tempfile.mkdtemp(prefix="synccheck-profile-")
    out_dir = os.path.abspath(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".probe.{os.getpid()}")
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write("ok")
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"cannot write to --out {out_dir}: {exc.strerror or exc}") from None
    return out_dir


def check_output_path(path: str | None, option: str) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {option} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"cannot write {option} {path}: folder {parent} is not writable")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {option} {path}: it is a folder")
    # Permissions alone do not tell (root, /proc, a read-only mount): open it for real, before a long job
    # runs, and leave no empty file behind.
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write {option} {path}: {exc.strerror or exc}") from None
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass


def child_env(out_dir: str, session: str, comm_hook: bool = False) -> dict:
    env = dict(os.environ)
    env.pop(R.ENV_COMM_HOOK, None)
    if comm_hook:
        env[R.ENV_COMM_HOOK] = "1"
    existing = env.get("PYTHONPATH")
    # First on the path, so *our* sitecustomize is the one Python imports; it chains to the original.
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + existing if existing else "")
    env[R.ENV_OUT] = out_dir
    env[R.ENV_SESSION] = session
    return env


def exit_code_of(returncode: int) -> int:
    # A child killed by a signal: report it the way a shell does (128 + signal number).
    return 128 - returncode if returncode < 0 else returncode


def run(opts: ProfileOptions, *, on_started=None) -> RunResult:
    resolve_command(opts.command)
    out_dir = prepare_out_dir(opts.out_dir)
    check_output_path(opts.json_path, "--json")
    check_output_path(opts.trace_path, "--trace")
    check_output_path(opts.sample_path, "--sample")
    session = uuid.uuid4().hex[:12]
    env = child_env(out_dir, session, opts.comm_hook)

    command = opts.command

    started = time.time()
    try:
        # Its own process group: a terminal's Ctrl-C reaches only us, and we forward it to the whole
        # group, as the terminal would have; on a hang the group is what we stop.
        child = subprocess.Popen(command, env=env, process_group=0)
    except FileNotFoundError:
        raise UsageError(f"command not found: {command[0]}", 127) from None
    except PermissionError:
        raise UsageError(f"command is not executable: {command[0]}", 126) from None
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}", 126) from None

    sampler = None
    if opts.sample_path:
        from synccheck.profiler.sample import Sampler
        sampler = Sampler(opts.sample_path, opts.sample_format, opts.sample_rate)
        sampler.start(child.pid, out_dir, session)
    result = RunResult(exit_code=0, session=session, out_dir=out_dir, started=started, ended=started)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, forward)
        except (ValueError, OSError):
            pass
    watchdog = None
    if opts.hang_timeout:
        from synccheck.profiler.hang import HangWatch
        watchdog = HangWatch(out_dir, session, child, opts.hang_timeout, opts.hang_grace)
    if on_started is not None:
        on_started(child)
    try:
        while True:
            try:
                returncode = child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if watchdog is not None:
                watchdog.check()
            if sampler is not None:
                sampler.poll()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    result.ended = time.time()
    result.exit_code = exit_code_of(returncode)
    if watchdog is not None:
        watchdog.finish()
        result.hang = watchdog.report
        if watchdog.report is not None and result.exit_code == 0:
            result.exit_code = 1
    if received:
        result.interrupted = signal.Signals(received[0]).name
    if sampler is not None:
        result.sample = sampler.finish()
        result.notes.extend(sampler.notes)
    _write_launcher_result(out_dir, session, opts.command, result)
    return result


def _write_launcher_result(out_dir: str, session: str, command: list, result: RunResult) -> None:
    """A small file per launcher, so `synccheck report DIR` can give each node's exit code."""
    data = {"session": session, "host": socket.gethostname(), "pid": os.getpid(), "command": command,
            "exit_code": result.exit_code, "started": result.started, "ended": result.ended,
            "interrupted": result.interrupted}
    try:
        with open(os.path.join(out_dir, f"launcher.{session}.json"), "w", encoding="utf-8") as fh:
            json.dump(data, fh)
    except OSError as exc:
        print(f"synccheck: could not write the launcher record in {out_dir}: {exc.strerror}", file=sys.stderr)
