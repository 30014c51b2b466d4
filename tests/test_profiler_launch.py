"""The launcher: signals, crashes, several nodes, bad input, and the bootstrap's cost in plain Python."""
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

ACCUM = T.script("accum.py")
BOOTSTRAP = None


def _bootstrap_dir() -> str:
    import synccheck.profiler.launcher as launcher
    return launcher.BOOTSTRAP_DIR


# -- bad input (fast) --------------------------------------------------------------------------------

def _synccheck(*args, env=None, timeout=60):
    return subprocess.run(T.synccheck_cmd(*args), capture_output=True, text=True, env=env or T.base_env(),
                          timeout=timeout)


def test_command_not_found_is_127(tmp_path):
    out = tmp_path / "out"
    proc = _synccheck("profile", "--out", str(out), "--", "no-such-command-xyz", "--flag")
    assert proc.returncode == 127
    assert proc.stderr.strip() == "synccheck profile: command not found: no-such-command-xyz"
    assert "Traceback" not in proc.stderr


def test_missing_separator_is_a_usage_error():
    proc = _synccheck("profile", "python", "train.py")
    assert proc.returncode == 2
    assert "put the command after `--`" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_empty_command_and_unknown_option():
    proc = _synccheck("profile", "--")
    assert proc.returncode == 2 and "no command after `--`" in proc.stderr
    proc = _synccheck("profile", "--bogus", "--", "true")
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unwritable_out_dir_fails_before_the_command_starts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    marker = tmp_path / "started"
    proc = _synccheck("profile", "--out", str(blocker / "sub"), "--", sys.executable, "-c",
                      f"open({str(marker)!r}, 'w')")
    assert proc.returncode == 2
    assert "cannot write to --out" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_unwritable_json_path_fails_before_the_command_starts(tmp_path):
    proc = _synccheck("profile", "--json", str(tmp_path / "missing" / "r.json"), "--", "true")
    assert proc.returncode == 2 and "cannot write --json" in proc.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_output_path_that_cannot_be_created_fails_before_the_command_starts(tmp_path):
    # /proc is "writable" to root by its mode bits, yet no file can be created there: only opening tells.
    marker = tmp_path / "ran"
    for option in ("--json", "--trace"):
        proc = _synccheck("profile", option, "/proc/synccheck-report.json", "--", "touch", str(marker))
        assert proc.returncode == 2 and f"cannot write {option} /proc/synccheck-report.json" in proc.stderr
        assert "Traceback" not in proc.stderr and not marker.exists()


def test_non_python_command_passes_its_exit_code(tmp_path):
    report = tmp_path / "r.json"
    proc = _synccheck("profile", "--out", str(tmp_path / "out"), "--json", str(report), "--",
                      "sh", "-c", "echo hello; exit 4")
    assert proc.returncode == 4
    assert proc.stdout == "hello\n"          # the command's stdout is untouched; the report is on stderr
    data = json.loads(report.read_text())
    assert data["exit_code"] == 4 and data["ranks"] == [] and data["findings"] == []
    assert any("no process of the command imported torch" in n for n in data["notes"])


def test_script_that_never_initializes_torch_distributed(tmp_path):
    report = tmp_path / "r.json"
    proc = _synccheck("profile", "--out", str(tmp_path / "out"), "--json", str(report), "--",
                      sys.executable, "-c", "import torch, sys; sys.exit(3)")
    assert proc.returncode == 3
    data = json.loads(report.read_text())
    assert data["exit_code"] == 3 and data["ranks"] == []
    assert any("never initialized torch.distributed" in n for n in data["notes"])
    assert "never initialized torch.distributed" in proc.stderr.replace("\n", " ")


def test_report_on_a_folder_without_records(tmp_path):
    proc = _synccheck("report", str(tmp_path))
    assert proc.returncode == 2 and "no rank records" in proc.stderr
    proc = _synccheck("report", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "no such folder" in proc.stderr


def test_importing_the_cli_does_not_import_torch():
    code = ("import sys, synccheck.profiler.cli, synccheck.profiler.launcher, synccheck.profiler.verdict, "
            "synccheck.profiler.render, synccheck.profiler.trace, synccheck.profiler.records; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


# -- the bootstrap -----------------------------------------------------------------------------------

def _bootstrapped_env(tmp_path, pythonpath=None):
    env = T.base_env()
    env["PYTHONPATH"] = _bootstrap_dir() + (os.pathsep + pythonpath if pythonpath else "")
    env["SYNCCHECK_PROFILE_OUT"] = str(tmp_path)
    env["SYNCCHECK_PROFILE_SESSION"] = "test"
    return env


def test_bootstrap_costs_a_plain_python_child_nothing(tmp_path):
    code = "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith(('synccheck', 'torch')))))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_bootstrapped_env(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Neither torch nor the hooks are imported by a Python child that never imports torch itself,
    # and it leaves no marker behind.
    assert json.loads(proc.stdout) == []
    assert list(tmp_path.iterdir()) == []


def test_bootstrap_chains_to_the_users_sitecustomize_and_hides_itself(tmp_path):
    user_site = tmp_path / "site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['FROM_USER_SITE'] = 'yes'\n")
    code = ("import os, sys, sitecustomize; print(os.environ.get('FROM_USER_SITE'), sitecustomize.__file__, "
            f"{_bootstrap_dir()!r} in [os.path.abspath(p) for p in sys.path])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_bootstrapped_env(tmp_path / "rec", str(user_site)), timeout=60)
    assert proc.returncode == 0, proc.stderr
    value, path, bootstrap_on_path = proc.stdout.split()
    assert value == "yes" and path == str(user_site / "sitecustomize.py") and bootstrap_on_path == "False"


def test_failing_user_sitecustomize_is_one_line_and_startup_goes_on(tmp_path):
    user_site = tmp_path / "site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    proc = subprocess.run([sys.executable, "-c", "print('started')"], capture_output=True, text=True,
                          env=_bootstrapped_env(tmp_path / "rec", str(user_site)), timeout=60)
    assert proc.returncode == 0 and proc.stdout == "started\n"
    assert "RuntimeError: broken site" in proc.stderr and "Traceback" not in proc.stderr


# -- real jobs ---------------------------------------------------------------------------------------

def _wait_for_steps(out_dir: Path, ranks, steps: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            records = T.read_records(out_dir)
        except (OSError, ValueError, IndexError):
            records = {}
        if all(r in records and T.count(records[r], "step") >= steps for r in ranks):
            return
        time.sleep(0.3)
    raise AssertionError(f"ranks {ranks} did not reach {steps} optimizer steps in {timeout}s")


@pytest.mark.multirank
def test_sigint_to_the_launcher_is_forwarded_and_records_survive(tmp_path):
    out_dir = tmp_path / "out"
    report = tmp_path / "r.json"
    cmd = T.synccheck_cmd("profile", "--out", str(out_dir), "--json", str(report), "--",
                          *T.torchrun(ACCUM, "--mode", "correct", "--steps", "1000", "--sleep", "0.02"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=T.base_env(),
                            start_new_session=True)
    try:
        _wait_for_steps(out_dir, (0, 1), 3)
        os.kill(proc.pid, signal.SIGINT)          # the launcher only, as a terminal's Ctrl-C would reach it
        _, stderr = proc.communicate(timeout=60)
    finally:
        T.kill_group(proc.pid)
    assert proc.returncode != 0
    data = json.loads(report.read_text())
    assert data["interrupted"] == "SIGINT" and data["exit_code"] == proc.returncode
    for r in (0, 1):
        rank = next(x for x in data["ranks"] if x["rank"] == r)
        assert 3 <= rank["optimizer_steps"] < 1000
        assert not T.alive(rank["pid"]), "a worker outlived the interrupted job"
    assert "interrupted" in stderr


@pytest.mark.multirank
def test_two_nodes_merge_with_report(tmp_path):
    shared = tmp_path / "shared"
    port = T.free_port()
    launchers = []
    for node in (0, 1):
        cmd = T.synccheck_cmd(
            "profile", "--out", str(shared), "--json", str(tmp_path / f"node{node}.json"), "--",
            T.TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=synccheck-test", ACCUM, "--mode", "correct")
        launchers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=T.base_env(), start_new_session=True))
    try:
        outputs = [p.communicate(timeout=T.RUN_TIMEOUT) for p in launchers]
    finally:
        for p in launchers:
            T.kill_group(p.pid)
    for p, (_, err) in zip(launchers, outputs):
        assert p.returncode == 0, err
    # Each launcher reports its own node's rank and says the other one is elsewhere.
    per_node = [json.loads((tmp_path / f"node{n}.json").read_text()) for n in (0, 1)]
    assert sorted(r["rank"] for d in per_node for r in d["ranks"]) == [0, 1]
    assert all(len(d["ranks"]) == 1 and any("no records from rank" in n for n in d["notes"]) for d in per_node)

    merged = tmp_path / "merged.json"
    proc = _synccheck("report", str(shared), "--json", str(merged), "--trace", str(tmp_path / "trace.json"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(merged.read_text())
    assert data["world_size"] == 2 and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["exit_code"] == 0 and data["findings"] == []
    for r in data["ranks"]:
        assert r["optimizer_steps"] == 4 and r["synced_micro_steps"] == 4 and r["grad_allreduces"] == 4
    assert data["divergence"]["diverged"] is False
    assert {p["pid"] for p in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]} == {0, 1}
