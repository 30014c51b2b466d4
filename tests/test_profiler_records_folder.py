"""Where `synccheck profile` leaves its records without --out: nothing after a run that went well; the
folder of a failed, interrupted or hung run, named on stderr, at most the latest 5 of them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "profiler_scripts"))
import profiler_testlib as T  # noqa: E402

from synccheck.profiler.launcher import KEPT_RUNS, TEMP_MARKER, TEMP_PREFIX  # noqa: E402


@pytest.fixture
def tmpdir_env(tmp_path):
    """An empty temp directory of its own for the launcher, so what it leaves there can be counted."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder, T.base_env(TMPDIR=str(folder))


def profile(env, *args, timeout=120):
    return subprocess.run(T.synccheck_cmd("profile", *args), capture_output=True, text=True, env=env,
                          timeout=timeout)


def leftovers(folder: Path) -> list[Path]:
    return sorted(folder.glob(TEMP_PREFIX + "*"))


def test_a_run_that_succeeds_leaves_no_folder(tmpdir_env, tmp_path):
    folder, env = tmpdir_env
    report = tmp_path / "r.json"
    proc = profile(env, "--json", str(report), "--", "sh", "-c", "exit 0")
    assert proc.returncode == 0, proc.stderr
    assert leftovers(folder) == []
    assert json.loads(report.read_text())["out_dir"] is None
    assert TEMP_PREFIX not in proc.stderr          # no folder named that no longer exists


def test_a_failed_run_keeps_its_records_and_says_where(tmpdir_env, tmp_path):
    folder, env = tmpdir_env
    report = tmp_path / "r.json"
    proc = profile(env, "--json", str(report), "--", "sh", "-c", "exit 3")
    assert proc.returncode == 3
    (kept,) = leftovers(folder)
    last = proc.stderr.replace("\n", " ").split("synccheck profile: ")[-1]
    assert last.startswith(f"the command exited with code 3: records kept in {kept} ")
    assert "synccheck report DIR" in last and f"{KEPT_RUNS} latest" in last
    assert list(kept.glob("launcher.*.json")) and json.loads(report.read_text())["out_dir"] == str(kept)


def test_only_the_latest_kept_runs_stay(tmpdir_env):
    folder, env = tmpdir_env
    old = []
    for i in range(KEPT_RUNS + 2):                 # earlier failed runs, oldest first
        run_dir = folder / f"{TEMP_PREFIX}old{i}"
        run_dir.mkdir()
        (run_dir / TEMP_MARKER).write_text("")
        launcher = run_dir / "launcher.abc.json"
        launcher.write_text("{}")
        os.utime(launcher, (time.time() - 1000 + i, time.time() - 1000 + i))
        old.append(run_dir)
    users = folder / f"{TEMP_PREFIX}mine"          # someone's --out: no marker
    users.mkdir()
    (users / "launcher.abc.json").write_text("{}")
    running = folder / f"{TEMP_PREFIX}running"     # a run still going: no launcher file yet
    running.mkdir()
    (running / TEMP_MARKER).write_text("")
    proc = profile(env, "--", "sh", "-c", "exit 1")
    assert proc.returncode == 1
    remaining = set(leftovers(folder))
    new = remaining - set(old) - {users, running}
    assert len(new) == 1 and users in remaining and running in remaining
    assert [d for d in old if d in remaining] == old[-(KEPT_RUNS - 1):]   # the newest, with the new one: 5


def test_ctrl_c_keeps_the_records_and_says_so(tmpdir_env):
    folder, env = tmpdir_env
    # A script that ends cleanly on Ctrl-C (exit 0), as training scripts that save on interrupt do: the
    # records are kept because the run was interrupted, whatever its exit code.
    script = ("import sys, time\n"
              "try:\n    print('ready', flush=True)\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    sys.exit(0)\n")
    proc = subprocess.Popen(T.synccheck_cmd("profile", "--", T.PYTHON, "-c", script), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        T.kill_group(proc.pid)
    assert proc.returncode == 0
    (kept,) = leftovers(folder)
    assert f"the command was interrupted (SIGINT): records kept in {kept}" in stderr.replace("\n", " ")


def test_bad_input_leaves_no_folder(tmpdir_env, tmp_path):
    folder, env = tmpdir_env
    proc = profile(env, "--json", str(tmp_path / "missing" / "r.json"), "--", "true")
    assert proc.returncode == 2
    # an executable that cannot be started (no interpreter line, not a binary): the exec itself fails
    bad = tmp_path / "not-a-program"
    bad.write_bytes(b"\x00\x01\x02")
    bad.chmod(0o755)
    proc = profile(env, "--", str(bad))
    assert proc.returncode == 126 and "cannot run" in proc.stderr
    assert leftovers(folder) == []


@pytest.mark.multirank
def test_a_real_job_is_reported_then_its_records_removed(tmpdir_env, tmp_path):
    folder, env = tmpdir_env
    report = tmp_path / "r.json"
    proc = profile(env, "--json", str(report), "--", T.PYTHON, T.script("accum.py"), "--mode", "correct",
                   "--spawn", "--steps", "2", timeout=T.RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert [r["optimizer_steps"] for r in data["ranks"]] == [2, 2]     # read from the records...
    assert leftovers(folder) == []                                     # ...which are gone


def test_ctrl_c_as_the_command_starts_reaches_it(tmp_path, monkeypatch):
    """A Ctrl-C that arrives while the command is being started (the terminal's signal reaches only the
    profiler, the child has its own process group) is forwarded to the command as soon as it exists,
    not lost: the profiler's own default handler once raised in it, and the child slept on."""
    from synccheck.profiler import launcher

    real_popen = subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        child = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)      # Ctrl-C in the window between spawn and wait
        return child

    monkeypatch.setattr(launcher.subprocess, "Popen", popen_then_ctrl_c)
    script = "import sys, time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    sys.exit(0)\n"
    opts = launcher.ProfileOptions(command=[sys.executable, "-c", script], out_dir=str(tmp_path / "records"))
    started = time.time()
    result = launcher.run(opts)
    assert result.interrupted == "SIGINT"
    # the child got it: at once, while Python was starting (killed by SIGINT: 130), or in its try block (0)
    assert result.exit_code in (0, 130)
    assert time.time() - started < 20
