"""Issue 6: hang diagnosis (`--hang-timeout`) and sampling (`--sample`) with py-spy, on real gloo jobs."""
from __future__ import annotations

import json
import os
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
    assert "verdict: the job hung in mismatched collectives and was stopped" in run.stderr.replace("\n", " ")
    assert "no gradient-synchronization misuse found" not in run.stderr
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
    # long enough that both ranks' training is sampled even on a loaded machine: the recorders attach when
    # the ranks' record files appear, found by polling (8 steps once gave a rank no sample at all)
    steps = 60
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "every", "--spawn", "--steps", str(steps)],
                    "--sample", str(profile), "--sample-rate", "50")
    assert run.returncode == 0, run.stderr
    sample = run.report["sample"]
    assert sample["error"] is None and profile.exists()
    json.loads(profile.read_text())          # a valid speedscope file where the user asked for it
    ranks = {r["rank"]: r for r in sample["ranks"]}
    assert set(ranks) == {0, 1}
    for r in ranks.values():
        assert r["samples"] > 0 and 0 < r["comm_share"] <= 1
    assert run.rank(0)["grad_allreduces"] == steps * 3      # next to the all-reduce counts
    assert "share of training-thread samples in communication" in run.stderr.replace("\n", " ")


# Shell lines that set $pid to the value of a fake py-spy's --pid argument.
_PID_ARG = """pid=""
prev=""
for arg in "$@"; do
    [ "$prev" = "--pid" ] && pid="$arg"
    prev="$arg"
done
"""


# Dies by SIGSEGV the first time it is asked to record a given worker (as py-spy itself sometimes does),
# then records with the real py-spy.
_CRASHES_FIRST_RECORD_PY_SPY = """#!/bin/sh
""" + _PID_ARG + """if [ "$1" = record ] && mkdir "$FAKE_PY_SPY_STATE/crashed-$pid" 2>/dev/null; then
    kill -SEGV $$
fi
exec "$REAL_PY_SPY" "$@"
"""


@needs_py_spy
def test_sample_survives_a_py_spy_crash_on_every_rank(tmp_path, monkeypatch):
    from synccheck.profiler.hang import find_py_spy
    real = find_py_spy()
    state = tmp_path / "state"
    state.mkdir()
    env = _env_with_fake_py_spy(monkeypatch, _fake_py_spy(tmp_path, _CRASHES_FIRST_RECORD_PY_SPY),
                                REAL_PY_SPY=real, FAKE_PY_SPY_STATE=str(state))
    profile = tmp_path / "profile.speedscope.json"
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "every", "--steps", "30", "--sleep", "0.01"),
                    "--sample", str(profile), "--sample-rate", "50", env=env)
    assert run.returncode == 0, run.stderr
    assert len(list(state.iterdir())) == 2          # each rank's first recorder did crash
    sample = run.report["sample"]
    assert sample["error"] is None
    ranks = {r["rank"]: r for r in sample["ranks"]}
    assert set(ranks) == {0, 1} and all(r["samples"] > 0 for r in ranks.values())
    stderr = run.stderr.replace("\n", " ")
    assert "py-spy crashed while recording rank 0 (SIGSEGV); restarted" in stderr
    assert "Traceback" not in stderr


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


# What py-spy prints, as a non-root user, when the kernel refuses it ptrace (Yama, a container without
# SYS_PTRACE, another user's process); it exits 1.
_PTRACE_REFUSED_PY_SPY = """#!/bin/sh
echo "Permission Denied: Try running again with elevated permissions by going 'sudo env \\"PATH=\\$PATH\\" !!'" >&2
exit 1
"""

# Kills the first process it is asked to dump (SIGKILL, then waits until it is gone or a zombie) and fails
# the way py-spy does on a process that is no longer there; dumps any other process with the real py-spy.
_KILLS_FIRST_PY_SPY = """#!/bin/sh
""" + _PID_ARG + """if [ -n "$pid" ] && mkdir "$FAKE_PY_SPY_STATE/killed" 2>/dev/null; then
    echo "$pid" > "$FAKE_PY_SPY_STATE/killed/pid"
    kill -9 "$pid"
    i=0
    while [ $i -lt 50 ]; do
        state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
        if [ -z "$state" ] || [ "$state" = Z ]; then break; fi
        sleep 0.1
        i=$((i + 1))
    done
    echo "Error: Failed to get process executable name. Check that the process is running." >&2
    echo "" >&2
    echo "Caused by:" >&2
    echo "    0: No such file or directory (os error 2)" >&2
    exit 1
fi
exec "$REAL_PY_SPY" "$@"
"""

# Frames of the launcher itself: a traceback through them is synccheck's own (torchrun and the workers print
# tracebacks of their own when they are interrupted or lose a peer, which are the command's output).
_LAUNCHER_FRAMES = ("synccheck/cli", "profiler/cli.py", "profiler/launcher.py", "profiler/hang.py",
                    "profiler/render.py", "profiler/records.py", "synccheck/__main__")


def _fake_py_spy(tmp_path: Path, text: str) -> Path:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    exe = bin_dir / "py-spy"
    exe.write_text(text)
    exe.chmod(0o755)
    return bin_dir


def _env_with_fake_py_spy(monkeypatch, bin_dir: Path, **extra) -> dict:
    from synccheck.profiler.hang import find_py_spy
    env = T.base_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **extra)
    # find_py_spy looks on PATH before next to the interpreter: check the launcher will pick the fake.
    monkeypatch.setenv("PATH", env["PATH"])
    assert find_py_spy() == str(bin_dir / "py-spy")
    return env


def _assert_no_launcher_traceback(stderr: str) -> None:
    for block in stderr.split("Traceback (most recent call last):")[1:]:
        frames = block.split("\n\n", 1)[0]
        assert not any(marker in frames for marker in _LAUNCHER_FRAMES), frames


def _worker_pids(out_dir: Path) -> dict[int, int]:
    return {rank: int(events[0][1]["pid"]) for rank, events in T.read_records(out_dir).items()}


@pytest.mark.timeout(120)
def test_ptrace_refused_says_so_in_one_line_and_keeps_profiling(tmp_path, monkeypatch):
    import signal
    import subprocess
    import threading
    env = _env_with_fake_py_spy(monkeypatch, _fake_py_spy(tmp_path, _PTRACE_REFUSED_PY_SPY))
    out_dir, report_path = tmp_path / "records", tmp_path / "report.json"
    # --shutdown-timeout: on SIGINT torchrun waits that long for the workers (stuck in gloo, they do not
    # return to Python to see it) before SIGKILL; its default of 30 s is only time lost here.
    cmd = T.synccheck_cmd("profile", "--out", str(out_dir), "--json", str(report_path), "--hang-timeout", "5",
                          "--", *T.torchrun("--shutdown-timeout", "3", HANG))
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    stdout_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stdout_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    watchdog = threading.Timer(90, T.kill_group, (proc.pid,))   # never leave a hung job behind
    watchdog.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "ptrace refused" in line:
                break
        else:
            raise AssertionError("the launcher never said ptrace was refused\n" + "".join(lines)[-4000:])
        noticed = time.time() - started
        # Profiling goes on: the launcher is still running the (hung) job a moment later.
        time.sleep(1.0)
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGINT)        # a Ctrl-C: the launcher forwards it to the command
        rest = proc.stderr.read()
        returncode = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            T.kill_group(proc.pid)
            proc.wait()
    elapsed = time.time() - started
    stderr = "".join(lines) + rest
    ptrace_lines = [l for l in stderr.splitlines() if "ptrace refused" in l]
    assert len(ptrace_lines) == 1, ptrace_lines          # one line, said once, not every poll
    assert ptrace_lines[0].startswith("synccheck: no rank made progress for 5s, but py-spy may not attach")
    assert "records say: rank 0 in barrier" in ptrace_lines[0]
    _assert_no_launcher_traceback(stderr)
    report = json.loads(report_path.read_text())
    # The command's exit code is reported (torchrun's, after the forwarded SIGINT), not one of ours.
    assert returncode != 0 and report["exit_code"] == returncode
    launcher = json.loads(next(out_dir.glob("launcher.*.json")).read_text())
    assert launcher["exit_code"] == returncode and launcher["interrupted"] == "SIGINT"
    assert report["interrupted"] == "SIGINT" and report["hang"] is None
    assert "the command was interrupted (SIGINT forwarded)" in stderr.replace("\n", " ")
    # The records taken before the hang are still reported.
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[0]["optimizer_steps"] == 2 and ranks[1]["optimizer_steps"] == 2
    # Nothing of the job is left running.
    pids = _worker_pids(out_dir)
    assert set(pids) == {0, 1}
    for pid in pids.values():
        assert not T.alive(pid), pid
    print(f"ptrace refused: noticed after {noticed:.1f}s, done after {elapsed:.1f}s")


@needs_py_spy
@pytest.mark.timeout(120)
def test_worker_that_exits_while_being_dumped_is_named_and_the_others_diagnosed(tmp_path, monkeypatch):
    from synccheck.profiler.hang import find_py_spy
    real = find_py_spy()
    state = tmp_path / "fake-state"
    state.mkdir()
    env = _env_with_fake_py_spy(monkeypatch, _fake_py_spy(tmp_path, _KILLS_FIRST_PY_SPY),
                                FAKE_PY_SPY_STATE=str(state), REAL_PY_SPY=real)
    started = time.time()
    run = T.profile(tmp_path, T.torchrun(HANG), "--hang-timeout", "5", "--hang-grace", "3", env=env,
                    timeout=100)
    elapsed = time.time() - started
    killed = int((state / "killed" / "pid").read_text())
    assert run.returncode != 0 and run.report["exit_code"] == run.returncode
    _assert_no_launcher_traceback(run.stderr)
    hang = run.report["hang"]
    assert hang is not None and hang["stopped"] is True
    by_rank = {r["rank"]: r for r in hang["ranks"]}
    gone = [r for r in by_rank.values() if r["pid"] == killed]
    assert len(gone) == 1
    gone = gone[0]
    other = by_rank[1 - gone["rank"]]
    # The rank that died is named as exited, in one line (the records still say where it was).
    assert gone["error"] == "exited" and "\n" not in gone["message"]
    assert gone["message"].startswith("exited while being dumped (py-spy: Error: Failed to get process")
    said = [l for l in run.stderr.splitlines() if l.startswith("synccheck: no rank made progress")]
    assert len(said) == 1
    assert f"rank {gone['rank']} exited while being dumped (pid {killed})" in said[0]
    # The other rank is still diagnosed: its collective and line.
    expected = {0: ("barrier", "# HANG-BARRIER"), 1: ("all_reduce", "# HANG-ALLREDUCE")}[other["rank"]]
    assert other["collective"] == expected[0]
    assert other["line"] == T.line_of(HANG, expected[1])
    # Normally py-spy still finds it blocked; if it noticed its peer's death first and exited too, the
    # records say where it was.
    assert (f"rank {other['rank']} in {expected[0]} at" in said[0]
            or f"(pid {other['pid']}), last recorded in {expected[0]} at" in said[0]), said[0]
    # Nothing of the job is left running, and the records before the hang are reported.
    for entry in hang["ranks"]:
        assert not T.alive(entry["pid"]), entry
    assert run.rank(0)["optimizer_steps"] == 2 and run.rank(1)["optimizer_steps"] == 2
    print(f"worker exited while dumped: done after {elapsed:.1f}s; other rank dumped by py-spy: "
          f"{bool(other.get('stack'))}")


def test_a_recorder_whose_worker_exited_is_asked_to_stop(tmp_path, monkeypatch):
    # A worker that exits while py-spy is attached stays a zombie its parent cannot reap until the tracer
    # lets go; a recorder that does not notice would hold the job (seen once in CI under load). The
    # sampler's poll asks it to write and stop (SIGINT) once the worker has been gone a little while.
    import subprocess

    from synccheck.profiler import sample as S
    recorder = tmp_path / "py-spy"
    # a stand-in for py-spy that only stops on SIGINT, as a stuck recorder would (in Python: a shell
    # started in the background cannot trap a SIGINT it inherited ignored)
    recorder.write_text(f"#!{sys.executable}\nimport signal, sys, time\n"
                        "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
                        "while True:\n    time.sleep(0.1)\n")
    recorder.chmod(0o755)
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    worker.wait()                                  # gone: no process of that pid runs any more
    monkeypatch.setattr(S, "ZOMBIE_GRACE_S", 0.2)
    sampler = S.Sampler(str(tmp_path / "profile.json"), "speedscope", 50)
    sampler.py_spy = str(recorder)
    sampler._parts_dir = str(tmp_path)
    rec = sampler.recorders[worker.pid] = S._Recorder(0, worker.pid)
    sampler._launch(rec)
    proc = rec.proc
    try:
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            sampler.poll()
            time.sleep(0.1)
        assert proc.poll() is not None, "the recorder of an exited worker was not stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
