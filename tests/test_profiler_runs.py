"""`synccheck profile` on real 2-rank gloo jobs: counts, verdicts and launch styles.

The training script (profiler_scripts/accum.py) runs --steps optimizer steps of --accum micro-steps on a
tiny model (one DDP bucket), with the sync misuse chosen by --mode, so every expected count follows from
the arguments.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "profiler_scripts"))
import profiler_testlib as T  # noqa: E402

pytestmark = pytest.mark.multirank

ACCUM = T.script("accum.py")
STEPS, MICRO = 4, 3


def assert_counts(run, synced_per_step: int, all_ranks=(0, 1)):
    assert run.report["world_size"] == 2
    for r in all_ranks:
        rank = run.rank(r)
        assert rank["optimizer_steps"] == STEPS
        assert rank["micro_steps"] == STEPS * MICRO
        assert rank["synced_micro_steps"] == STEPS * synced_per_step
        # The model fits in one bucket: one gradient all-reduce per synced micro-step.
        assert rank["grad_allreduces"] == STEPS * synced_per_step
        assert rank["grad_allreduce_bytes"] == STEPS * synced_per_step * (16 * 32 + 32 + 32 * 4 + 4) * 4


@pytest.fixture(scope="module")
def every_run(tmp_path_factory):
    """Sync on every micro-step, launched with `python -m torch.distributed.run` (torchrun's module form),
    with a trace, and rank 0 saving its final weights."""
    tmp = tmp_path_factory.mktemp("every")
    run = T.profile(tmp, [T.PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          ACCUM, "--mode", "every", "--save", str(tmp / "weights.pt")],
                    "--trace", str(tmp / "trace.json"))
    assert run.returncode == 0, run.stderr
    run.tmp = tmp
    return run


def test_sync_every_microstep_is_sc101(every_run):
    run = every_run
    assert_counts(run, synced_per_step=MICRO)
    assert run.codes() == ["SC101"]
    f = run.finding("SC101")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1]
    assert f["path"].endswith("accum.py")
    assert "3 of 3 micro-steps" in f["message"]
    assert "SC101" in run.stderr
    # In time order (as the report reads them) every optimizer step owns exactly its own buckets: a bucket
    # drawn before its forward would land in the previous step, and a window cut short by a crash would
    # then report the wrong MB per step.
    for events in T.read_records(run.out_dir).values():
        timed = sorted((ev for ev in events[1:] if ev[0] in ("bkt", "step")), key=lambda ev: ev[1])
        per_step, n = [], 0
        for ev in timed:
            if ev[0] == "bkt":
                n += 1
            else:
                per_step.append(n)
                n = 0
        assert per_step == [MICRO] * STEPS


def test_torchrun_agent_records_nothing(every_run):
    # Only the two workers wrote rank files; torchrun's agent (which imports torch.distributed) did not.
    names = sorted(p.name.split(".")[0] for p in every_run.out_dir.glob("rank-*.jsonl"))
    assert names == ["rank-00000", "rank-00001"]
    markers = [json.loads(p.read_text()) for p in every_run.out_dir.glob("proc.*.json")]
    assert sorted(m["role"] for m in markers) == ["agent", "worker", "worker"]


def test_chrome_trace_has_a_track_per_rank(every_run):
    data = json.loads((every_run.tmp / "trace.json").read_text())
    events = data["traceEvents"]
    for ev in events:
        assert ev["ph"] in ("M", "X", "i") and "pid" in ev and "name" in ev
        if ev["ph"] == "X":
            assert ev["dur"] > 0 and ev["ts"] >= 0
    for pid in (0, 1):
        mine = [ev for ev in events if ev["pid"] == pid and ev["ph"] != "M"]
        assert sum(1 for ev in mine if ev["name"].startswith("micro-step ")) == STEPS * MICRO
        assert sum(1 for ev in mine if ev["name"] == "all-reduce bucket") == STEPS * MICRO
        assert sum(1 for ev in mine if ev["name"].startswith("optimizer step ")) == STEPS


def test_weights_bit_identical_with_and_without_profiler(every_run, tmp_path):
    import subprocess

    import torch
    plain_path = tmp_path / "plain.pt"
    proc = subprocess.run(T.torchrun(ACCUM, "--mode", "every", "--save", str(plain_path)), env=T.base_env(),
                          capture_output=True, text=True, timeout=T.RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    plain, profiled = torch.load(plain_path), torch.load(every_run.tmp / "weights.pt")
    assert plain.keys() == profiled.keys()
    for key in plain:
        a, b = plain[key], profiled[key]
        assert a.dtype == b.dtype and a.shape == b.shape
        # Bitwise, not allclose: profiling must not change what DDP computes.
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), key


def test_comm_hook_mode_counts_the_same_times_every_bucket_and_keeps_the_weights(every_run, tmp_path):
    # --comm-hook: every bucket goes through the counting comm hook instead of being counted from DDP's
    # layout. Same counts, a measured time per bucket, and the same weights bit for bit as the default
    # run, in which DDP has no hook at all.
    import torch
    weights = tmp_path / "weights.pt"
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "every", "--save", str(weights)), "--comm-hook")
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=MICRO)
    assert run.codes() == ["SC101"]
    for r in (0, 1):
        assert run.rank(r)["allreduce_time_s"] > 0
    hooked, default = torch.load(weights), torch.load(every_run.tmp / "weights.pt")
    for key in default:
        assert torch.equal(hooked[key].view(torch.int32), default[key].view(torch.int32)), key


def test_buckets_counted_when_the_backward_never_reaches_the_first_output(tmp_path):
    # The model returns (aux, prediction) and the loss ignores aux: the end-of-backward check that hangs
    # on the first output never fires, so the optimizer step must find the finished reduction itself.
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "correct", "--aux-output"))
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=1)
    assert run.codes() == []
    # ... and records the bucket before the step it belongs to, not after it.
    for events in T.read_records(run.out_dir).values():
        buckets_per_step, n = [], 0
        for ev in events:
            if ev[0] == "bkt":
                n += 1
            elif ev[0] == "step":
                buckets_per_step.append(n)
                n = 0
        assert buckets_per_step == [1] * STEPS


def test_no_sync_around_backward_only_is_sc102_with_its_line(tmp_path):
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "backward_only"))
    assert run.returncode == 0, run.stderr
    # no_sync() after the forward changes nothing: every micro-step still all-reduces.
    assert_counts(run, synced_per_step=MICRO)
    assert run.codes() == ["SC102"]
    f = run.finding("SC102")
    assert f["line"] == T.line_of(ACCUM, "# LATE-NO-SYNC")
    assert f["path"].endswith("accum.py")
    assert f"({STEPS * (MICRO - 1)} micro-steps)" in f["message"]


def test_correct_no_sync_is_clean(tmp_path):
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "correct"))
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=1)
    assert run.report["findings"] == []
    assert run.report["divergence"]["diverged"] is False
    assert "no gradient-synchronization misuse found" in run.stderr


def test_no_sync_on_every_microstep_is_sc103_and_checksums_diverge(tmp_path):
    # torch.multiprocessing.spawn: the rank is known only at init_process_group.
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "all_nosync", "--spawn"])
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=0)
    assert run.codes() == ["SC103"]
    f = run.finding("SC103")
    assert f["severity"] == "error"
    assert f["line"] == T.line_of(ACCUM, "# OPTIMIZER-STEP")
    assert run.report["divergence"]["diverged"] is True
    assert "the ranks diverged" in f["message"]


def test_flag_cleared_after_forward_is_sc102_at_the_backward(tmp_path):
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "flag_late", "--spawn"])
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=MICRO)
    f = run.finding("SC102")
    assert f["line"] == T.line_of(ACCUM, "# FLAG-LATE-BACKWARD")
    assert "require_backward_grad_sync" in f["message"]


def test_local_sgd_parameter_averaging_is_recognised(tmp_path):
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "local_sgd", "--spawn"])
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=0)
    assert run.codes() == []          # no SC103: averaging parameters every 2 steps is the intent
    assert run.report["param_averaging"] is True
    for r in (0, 1):
        assert run.rank(r)["param_averages"] == STEPS // 2
    assert any("parameter averaging recognised" in n for n in run.report["notes"])


def test_user_comm_hook_is_wrapped_and_user_sitecustomize_runs(tmp_path):
    # A user's sitecustomize on PYTHONPATH: the bootstrap must chain to it, in every worker.
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    markers = tmp_path / "markers"
    markers.mkdir()
    (user_site / "sitecustomize.py").write_text(
        "import os\n"
        f"open(os.path.join({str(markers)!r}, str(os.getpid())), 'w').close()\n")
    counts = tmp_path / "hook"
    run = T.profile(tmp_path, [T.PYTHON, ACCUM, "--mode", "correct", "--spawn", "--hook",
                               "--hook-count", str(counts)], env=T.base_env(PYTHONPATH=str(user_site)))
    assert run.returncode == 0, run.stderr
    assert_counts(run, synced_per_step=1)
    assert run.report["findings"] == []
    ran_in = {int(p.name) for p in markers.iterdir()}
    for r in (0, 1):
        # The user's comm hook (registered after DDP construction) saw every bucket, and the profiler
        # counted the same buckets: wrapped, not replaced.
        user_calls = int(Path(f"{counts}.{r}").read_text())
        assert user_calls == STEPS == run.rank(r)["grad_allreduces"]
        assert run.rank(r)["pid"] in ran_in


def test_fsdp2_fully_shard_accumulation(tmp_path):
    script = T.script("fsdp2_accum.py")
    every = T.profile(tmp_path, T.torchrun(script, "--mode", "every", "--steps", "3", "--accum", "2"), name="every")
    assert every.returncode == 0, every.stderr
    nosync = T.profile(tmp_path, T.torchrun(script, "--mode", "nosync", "--steps", "3", "--accum", "2"),
                       name="nosync")
    assert nosync.returncode == 0, nosync.stderr
    for r in (0, 1):
        a, b = every.rank(r), nosync.rank(r)
        assert a["models"] == ["fsdp2"] and a["optimizer_steps"] == 3 and a["micro_steps"] == 6
        # Two FSDP units hold parameters (the Linear layers; the root has none of its own): two
        # reduce-scatters per synced backward.
        assert a["collectives"]["reduce_scatter_single"] == 6 * 2
        assert a["synced_micro_steps"] == 6 and a["grad_allreduce_bytes"] > 0
        assert b["synced_micro_steps"] == 3 and b["collectives"]["reduce_scatter_single"] == 3 * 2
    assert every.codes() == ["SC101"] and "FSDP" in every.finding("SC101")["message"]
    assert nosync.codes() == []


def test_rank_that_raises_after_three_steps(tmp_path):
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "correct", "--steps", "6", "--raise-after", "3",
                                         "--raise-rank", "1"))
    # torchrun reports a failed worker with exit code 1; the profiler passes it through.
    assert run.returncode == 1, run.stderr
    assert run.report["exit_code"] == 1
    assert run.rank(1)["optimizer_steps"] == 3
    records = T.read_records(run.out_dir)
    assert T.count(records[1], "step") == 3
    assert "fails on purpose" in run.stderr


# -- accelerate launch ---------------------------------------------------------------------------------

ACCELERATE_SCRIPT = T.script("accelerate_accum.py")
ACC_STEPS, ACC_MICRO = 4, 4


def _accelerate_env(tmp_path):
    # A folder of its own for accelerate's config, so a developer's `accelerate config` cannot change the run.
    return T.base_env(HF_HOME=str(tmp_path / "hf-home"))


def _roles(out_dir):
    return sorted(json.loads(p.read_text())["role"] for p in out_dir.glob("proc.*.json"))


def test_accelerate_launch_accumulate_syncs_once_per_step(tmp_path):
    run = T.profile(tmp_path, T.accelerate_launch(ACCELERATE_SCRIPT, "--mode", "accumulate"),
                    env=_accelerate_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.report["world_size"] == 2
    # The `accelerate` process runs torch.distributed.run in-process: an agent that records nothing.
    assert _roles(run.out_dir) == ["agent", "worker", "worker"]
    assert len(list(run.out_dir.glob("rank-*.jsonl"))) == 2
    per_step = T.windows(run.out_dir)
    for r in (0, 1):
        rank = run.rank(r)
        assert rank["models"] == ["ddp"]
        assert rank["optimizer_steps"] == ACC_STEPS and rank["micro_steps"] == ACC_STEPS * ACC_MICRO
        assert rank["synced_micro_steps"] == ACC_STEPS and rank["grad_allreduces"] == ACC_STEPS
        assert rank["synced_micro_steps_per_step"] == 1.0
        # accelerator.accumulate(model): every optimizer step has 4 micro-steps, exactly one of them synced.
        assert per_step[r] == [(ACC_MICRO, 1)] * ACC_STEPS
    assert run.report["findings"] == []
    assert run.report["divergence"]["diverged"] is False


def test_accelerate_launch_without_accumulate_is_sc101(tmp_path):
    # The `accelerate-launch` console script this time (an agent too).
    run = T.profile(tmp_path, T.accelerate_launch(ACCELERATE_SCRIPT, "--mode", "every",
                                                  exe=T.ACCELERATE + "-launch"),
                    env=_accelerate_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert _roles(run.out_dir) == ["agent", "worker", "worker"]
    per_step = T.windows(run.out_dir)
    for r in (0, 1):
        rank = run.rank(r)
        assert rank["optimizer_steps"] == ACC_STEPS and rank["micro_steps"] == ACC_STEPS * ACC_MICRO
        assert rank["synced_micro_steps"] == ACC_STEPS * ACC_MICRO
        assert per_step[r] == [(ACC_MICRO, ACC_MICRO)] * ACC_STEPS
    assert run.codes() == ["SC101"]
    f = run.finding("SC101")
    assert f["ranks"] == [0, 1] and f["line"] == T.line_of(ACCELERATE_SCRIPT, "# EVERY-FORWARD")
    assert f"{ACC_MICRO} of {ACC_MICRO} micro-steps" in f["message"]
    assert "accelerator.accumulate(model)" in f["message"]       # the fix in the script's own terms
    assert run.rank(0)["frameworks"] == ["accelerate"]


# -- records after the last optimizer step -------------------------------------------------------------

@pytest.mark.parametrize("end", ["barrier+destroy", "barrier", "destroy"])
def test_local_sgd_averaging_after_the_last_step_is_not_lost(tmp_path, end):
    # Two optimizer steps, one averaging all-reduce after the second, then the script ends with os._exit
    # within milliseconds: the flush at barrier / destroy_process_group must get it to disk, or the
    # verdict sees two steps on local gradients and no averaging (a false SC103).
    script = T.script("local_sgd_short.py")
    run = T.profile(tmp_path, T.torchrun(script, "--steps", "2", "--every", "2", "--end", end))
    assert run.returncode == 0, run.stderr
    assert run.codes() == [], run.stderr
    assert run.report["param_averaging"] is True
    records = T.read_records(run.out_dir)
    for r in (0, 1):
        rank = run.rank(r)
        assert rank["optimizer_steps"] == 2 and rank["micro_steps"] == 4 and rank["synced_micro_steps"] == 0
        assert rank["param_averages"] == 1
        kinds = [(ev[0], ev[3] if ev[0] == "coll" else None) for ev in records[r]]
        last_step = max(i for i, (kind, _) in enumerate(kinds) if kind == "step")
        assert ("coll", "all_reduce") in kinds[last_step:]
        if "barrier" in end:
            assert rank["collectives"].get("barrier") == 1   # flushed when the barrier returned


# -- FSDP1 ---------------------------------------------------------------------------------------------

FSDP1_SCRIPT = T.script("fsdp1_accum.py")
F_STEPS, F_MICRO = 3, 3


def _fsdp1_run(tmp_path, mode):
    run = T.profile(tmp_path, T.torchrun(FSDP1_SCRIPT, "--mode", mode, "--steps", str(F_STEPS),
                                         "--accum", str(F_MICRO)))
    assert run.returncode == 0, run.stderr
    return run, T.windows(run.out_dir)


def test_fsdp1_no_sync_accumulation_reduces_once_per_step(tmp_path):
    run, per_step = _fsdp1_run(tmp_path, "nosync")
    for r in (0, 1):
        rank = run.rank(r)
        # Nested units: only the root's forward is a micro-step.
        assert rank["models"] == ["fsdp"]
        assert rank["optimizer_steps"] == F_STEPS and rank["micro_steps"] == F_STEPS * F_MICRO
        assert rank["synced_micro_steps"] == F_STEPS
        assert per_step[r] == [(F_MICRO, 1)] * F_STEPS
        # Two FSDP units hold parameters (the Linear layers): two reduce-scatters per synced backward.
        assert rank["collectives"]["reduce_scatter_single"] == F_STEPS * 2 == rank["grad_allreduces"]
    assert run.codes() == []


def test_fsdp1_sync_every_microstep_is_sc101(tmp_path):
    run, per_step = _fsdp1_run(tmp_path, "every")
    for r in (0, 1):
        rank = run.rank(r)
        assert rank["optimizer_steps"] == F_STEPS and rank["micro_steps"] == F_STEPS * F_MICRO
        assert rank["synced_micro_steps"] == F_STEPS * F_MICRO
        assert per_step[r] == [(F_MICRO, F_MICRO)] * F_STEPS
        assert rank["collectives"]["reduce_scatter_single"] == F_STEPS * F_MICRO * 2 == rank["grad_allreduces"]
    assert run.codes() == ["SC101"]
    f = run.finding("SC101")
    assert "FSDP" in f["message"] and f"{F_MICRO} of {F_MICRO} micro-steps" in f["message"]
    assert f["path"].endswith("fsdp1_accum.py")
