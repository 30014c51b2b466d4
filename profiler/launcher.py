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
# Without --out the records go to a new folder in the temp directory ($TMPDIR, else /tmp). It is removed
# once a run that went well is reported; a failed, interrupted or hung run's folder is kept for
# `synccheck report DIR`, and only the newest KEPT_RUNS of those stay. The marker file tells a folder
# this launcher made (and may remove) from one a user named with --out.
TEMP_PREFIX = "synccheck-profile-"
TEMP_MARKER = ".synccheck-temporary"
KEPT_RUNS = 5


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
    temporary: bool = False          # out_dir is ours (no --out): removed or kept by finish_records


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
        out_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        with open(os.path.join(out_dir, TEMP_MARKER), "w", encoding="utf-8"):
            pass
        return out_dir
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
    check_output_path(opts.json_path, "--json")
    check_output_path(opts.trace_path, "--trace")
    check_output_path(opts.sample_path, "--sample")
    out_dir = prepare_out_dir(opts.out_dir)
    session = uuid.uuid4().hex[:12]
    env = child_env(out_dir, session, opts.comm_hook)
    if opts.hang_timeout:
        env[R.ENV_PROGRESS] = str(max(R.FLUSH_INTERVAL_S, opts.hang_timeout / 4))

    command = opts.command

    started = time.time()
    received: list[int] = []
    spawned: list = []

    def forward(signum, _frame):
        # A terminal's Ctrl-C reaches only us: forward it to the child's whole group, as the terminal
        # would have. One that comes before the child exists is sent as soon as it does.
        received.append(signum)
        if spawned:
            _signal_group(spawned[0], signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, forward)
        except (ValueError, OSError):
            pass
    try:
        try:
            # Its own process group: on a hang the group is what we stop.
            child = subprocess.Popen(command, env=env, process_group=0)
        except OSError as exc:
            if opts.out_dir is None:
                shutil.rmtree(out_dir, ignore_errors=True)     # nothing ran: nothing to keep
            if isinstance(exc, FileNotFoundError):
                raise UsageError(f"command not found: {command[0]}", 127) from None
            if isinstance(exc, PermissionError):
                raise UsageError(f"command is not executable: {command[0]}", 126) from None
            raise UsageError(f"cannot run {command[0]}: {exc.strerror or exc}", 126) from None
        spawned.append(child)
        for signum in list(received):
            _signal_group(child, signum)

        sampler = None
        if opts.sample_path:
            from synccheck.profiler.sample import Sampler
            sampler = Sampler(opts.sample_path, opts.sample_format, opts.sample_rate)
            sampler.start(child.pid, out_dir, session)
        result = RunResult(exit_code=0, session=session, out_dir=out_dir, started=started, ended=started,
                           temporary=opts.out_dir is None)
        watchdog = None
        if opts.hang_timeout:
            from synccheck.profiler.hang import HangWatch
            watchdog = HangWatch(out_dir, session, child, opts.hang_timeout, opts.hang_grace)
        if on_started is not None:
            on_started(child)
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


def _signal_group(child, signum: int) -> None:
    """Send ``signum`` to the child's process group, which may be gone already."""
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def records_worth_keeping(result: RunResult) -> bool:
    """Whether a run's records outlive its report: always with --out; without it, only when the command
    failed, was interrupted or hung, where `synccheck report DIR` on them is the way to look again."""
    return not result.temporary or bool(result.exit_code or result.interrupted or result.hang)


def finish_records(result: RunResult) -> None:
    """After the report: remove a temporary records folder that is not worth keeping; when one is kept,
    remove the older kept ones beyond the newest KEPT_RUNS."""
    if not result.temporary:
        return
    if not records_worth_keeping(result):
        shutil.rmtree(result.out_dir, ignore_errors=True)
        return
    for old in kept_runs()[KEPT_RUNS:]:
        shutil.rmtree(old, ignore_errors=True)


def kept_runs() -> list[str]:
    """The finished temporary records folders of this user in the temp directory, newest first. A
    folder without the marker (someone's --out) or without a launcher file (a run still going) is
    never listed, so never removed."""
    import glob

    found = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), TEMP_PREFIX + "*")):
        try:
            st = os.lstat(folder)
            if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.geteuid():
                continue
            if not os.path.exists(os.path.join(folder, TEMP_MARKER)):
                continue
            ends = [os.path.getmtime(p) for p in glob.glob(os.path.join(folder, "launcher.*.json"))]
        except OSError:
            continue
        if ends:
            found.append((max(ends), folder))
    return [folder for _, folder in sorted(found, reverse=True)]


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
