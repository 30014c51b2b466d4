"""Issue 6: hang diagnosis (`--hang-timeout`) and sampling (`--sample`) with py-spy, on real gloo jobs."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "profiler_scripts"))
import profiler_testlib as T  # noqa: E402

pytestmark = pytest.mark.multirank

HANG = T.script("hang.py")
ACCUM = T.script("accum.py")


def _py_spy_works() -> bool:
    from synccheck.profiler.hang import find_py_spy
    return find_py_spy() is not None


needs_py_spy = pytest.mark.skipif(not _py_spy_works(), reason="py-spy is not installed")


@needs_py_spy
def test_collective_mismatch_is_diagnosed_and_stopped(tmp_path):
    timeout, grace = 5, 3
    started = time.time()
    run = T.profile(tmp_path, T.torchrun(HANG), "--hang-timeout", str(timeout), "--hang-grace", str(grace),
                    timeout=150)
    elapsed = time.time() - started
    assert run.returncode != 0
    hang = run.report["hang"]
    assert hang is not None and hang["mismatch"] is True and hang["stopped"] is True
    by_rank = {r["rank"]: r for r in hang["ranks"]}
    assert by_rank[0]["collective"] == "barrier"
    assert by_rank[0]["line"] == T.line_of(HANG, "# HANG-BARRIER")
    assert by_rank[1]["collective"] == "all_reduce"
    assert by_rank[1]["line"] == T.line_of(HANG, "# HANG-ALLREDUCE")
    assert by_rank[0]["path"].endswith("hang.py") and by_rank[0]["stack"]
    summary = hang["summary"]
    assert "rank 0 in barrier at" in summary and "rank 1 in all_reduce at" in summary
    assert "rank 0 in barrier" in run.stderr.replace("\n", " ")
    # The job ended within start-up + the timeout + the grace period (generously bounded), and nothing
    # of it is left running.
    assert elapsed < 90
    for entry in hang["ranks"]:
        assert not T.alive(entry["pid"])
    # The records taken before the hang are still reported.
    assert run.rank(0)["optimizer_steps"] == 2 and run.rank(1)["optimizer_steps"] == 2


def test_healthy_job_is_not_disturbed_by_hang_timeout(tmp_path):
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "correct", "--sleep", "0.05"), "--hang-timeout", "20")
    assert run.returncode == 0, run.stderr
    assert run.report["hang"] is None
    assert run.rank(0)["optimizer_steps"] == 4 and run.report["findings"] == []


@needs_py_spy
def test_sample_reports_a_communication_share(tmp_path):
    profile = tmp_path / "profile.speedscope.json"
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "every", "--spawn", "--steps", "8"],
                    "--sample", str(profile), "--sample-rate", "50")
    assert run.returncode == 0, run.stderr
    sample = run.report["sample"]
    assert sample["error"] is None and profile.exists()
    json.loads(profile.read_text())          # a valid speedscope file where the user asked for it
    ranks = {r["rank"]: r for r in sample["ranks"]}
    assert set(ranks) == {0, 1}
    for r in ranks.values():
        assert r["samples"] > 0 and 0 < r["comm_share"] <= 1
    assert run.rank(0)["grad_allreduces"] == 8 * 3      # next to the all-reduce counts
    assert "share of training-thread samples in communication" in run.stderr.replace("\n", " ")


def test_sample_without_py_spy_says_so_and_keeps_profiling(tmp_path):
    # A PATH without py-spy, and an interpreter folder without it either: run the launcher through a
    # copy of the interpreter's folder layout is overkill; instead point find_py_spy at nothing.
    env = T.base_env(PATH="/usr/bin:/bin")
    code = ("import sys; import synccheck.profiler.hang as h; h.find_py_spy = lambda: None; "
            "import synccheck.profiler.sample as s; s.find_py_spy = lambda: None; "
            "from synccheck.cli import main; sys.exit(main(sys.argv[1:]))")
    import subprocess
    report = tmp_path / "r.json"
    proc = subprocess.run([T.PYTHON, "-c", code, "profile", "--json", str(report), "--sample",
                           str(tmp_path / "p.json"), "--", "sh", "-c", "exit 5"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 5
    assert "py-spy is not installed" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads(report.read_text())["exit_code"] == 5


@needs_py_spy
def test_sample_of_a_non_python_command_keeps_its_exit_code(tmp_path):
    report = tmp_path / "r.json"
    proc = __import__("subprocess").run(
        T.synccheck_cmd("profile", "--json", str(report), "--sample", str(tmp_path / "p.json"), "--",
                        "sh", "-c", "sleep 0.5; exit 6"),
        capture_output=True, text=True, env=T.base_env(), timeout=90)
    assert proc.returncode == 6
    assert "--sample: no profile written" in proc.stderr and "Traceback" not in proc.stderr
    data = json.loads(report.read_text())
    assert data["exit_code"] == 6 and data["sample"]["error"]
