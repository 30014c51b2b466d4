"""`synccheck demo` end to end: the five bundled examples linted, run on 2 gloo ranks under the profiler,
and timed, at a reduced size. What each variant all-reduces follows from its loop, so the counts are exact.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from synccheck import demo

PYTHON = sys.executable
ACCUM = demo.ACCUM
# 6 steps: 4 timed after the 2 warm-up steps, and local SGD's averaging after step 4 is followed by an
# optimizer step (the profiler writes a rank's records at optimizer steps).
STEPS, WIDTH = 6, 128


def synccheck(*args: str, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "synccheck", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.json"
    temp = tmp_path_factory.mktemp("demo-tmpdir")      # the demo's temp directory, to see what it leaves
    proc = synccheck("demo", "--steps", str(STEPS), "--width", str(WIDTH), "--json", str(out),
                     env={**os.environ, "TMPDIR": str(temp)})
    rows = json.loads(out.read_text()) if out.exists() else None
    proc.leftovers = sorted(p.name for p in temp.iterdir())
    return proc, rows


@pytest.mark.multirank
def test_demo_runs_every_variant(demo_run):
    proc, rows = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert [row["variant"] for row in rows] == [name for name, _, _ in demo.VARIANTS]
    for row in rows:
        assert row["error"] is None, row
        for key in ("variant", "lint_codes", "synced_micro_steps_per_optimizer_step",
                    "allreduce_mb_per_optimizer_step", "seconds_per_optimizer_step", "speedup"):
            assert key in row
        assert row["seconds_per_optimizer_step"] > 0 and row["speedup"] > 0
        assert row["ranks_agree"] is True
    # the table, on stdout, one line per variant
    for name, _, _ in demo.VARIANTS:
        assert any(line.split()[:1] == [name] for line in proc.stdout.splitlines()), proc.stdout
    # nothing left in the temp directory: no records folder per variant, no torchrun log folder
    assert proc.leftovers == []


@pytest.mark.multirank
def test_demo_counts_and_codes(demo_run):
    _, rows = demo_run
    by = {row["variant"]: row for row in rows}
    # Gradient bytes of one synced micro-step: Linear(64, W) + Linear(W, W) + Linear(W, 1), fp32.
    bucket_mb = 4 * (64 * WIDTH + WIDTH + WIDTH * WIDTH + WIDTH + WIDTH + 1) / 1e6

    for name, code in (("baseline", "SC101"), ("no_sync_backward_only", "SC102")):
        row = by[name]
        assert row["lint_codes"] == [code]
        assert row["profile_codes"] == [code]
        assert row["synced_micro_steps_per_optimizer_step"] == ACCUM
        assert row["allreduce_mb_per_optimizer_step"] == pytest.approx(ACCUM * bucket_mb)

    # Syncing less changes the time, not the result: the four exact variants end with the same weights
    # (the same loss on a fixed held-out batch); only local SGD, which averages parameters instead of
    # gradients, may differ.
    exact = [by[name]["final_loss"] for name in ("baseline", "no_sync_backward_only", "no_sync", "accumulate",
                                                  "baseline_fixed")]
    assert all(loss == pytest.approx(exact[0], rel=1e-5) for loss in exact), exact

    # baseline_fixed: baseline.py as `synccheck lint --fix` rewrote it
    for name in ("no_sync", "accumulate", "baseline_fixed"):
        row = by[name]
        assert row["lint_codes"] == [] and row["profile_codes"] == []
        assert row["synced_micro_steps_per_optimizer_step"] == 1
        assert row["allreduce_mb_per_optimizer_step"] == pytest.approx(bucket_mb)

    row = by["local_sgd"]
    assert row["lint_codes"] == [] and row["profile_codes"] == []
    assert row["synced_micro_steps_per_optimizer_step"] == 0
    assert row["allreduce_mb_per_optimizer_step"] == 0
    assert row["param_averages"] >= 1
    assert by["baseline"]["speedup"] == 1


def test_demo_without_torch_says_how_to_install():
    # sys.modules["torch"] = None is how Python itself spells "this module cannot be imported".
    code = ("import sys; sys.modules['torch'] = None\n"
            "from synccheck.cli import main; raise SystemExit(main(['demo']))")
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "synccheck demo: needs PyTorch, which is not installed here: pip install 'synccheck[torch]'"]


@pytest.mark.parametrize("args", [["--steps", "0"], ["--ranks", "two"], ["--bogus"],
                                  ["--json", "/nonexistent-folder/demo.json"]])
def test_demo_bad_input_is_one_line(args):
    proc = synccheck("demo", *args, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("synccheck demo: ")


def test_demo_help_and_where():
    proc = synccheck("demo", "--help", timeout=60)
    assert proc.returncode == 0 and "local_sgd" in proc.stdout
    proc = synccheck("demo", "--where", timeout=60)
    assert proc.returncode == 0
    assert demo.examples_dir() is not None
    assert proc.stdout.strip() == str(demo.examples_dir())


def test_cli_import_stays_light():
    code = "import sys, synccheck.cli, synccheck.demo; print('torch' in sys.modules)"
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.multirank
def test_failing_variant_is_a_row_not_a_traceback(tmp_path):
    # A real training script that dies in its workers: the row says so, the table still prints.
    script = tmp_path / "crash.py"
    script.write_text("import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "raise RuntimeError('boom in rank %d' % dist.get_rank())\n")
    args = Namespace(ranks=2, steps=3, width=64)
    row = demo.Row(variant="baseline", script="crash.py")
    demo.run_variant(row, script, args, str(tmp_path))
    assert row.error == "exit code 1: RuntimeError: boom in rank 0" or row.error == "exit code 1: RuntimeError: boom in rank 1"
    assert row.seconds_per_optimizer_step is None

    from rich.console import Console

    console = Console(record=True, width=200)
    demo.render_table([row], args, console)
    text = console.export_text()
    assert "baseline failed: exit code 1: RuntimeError: boom in rank" in text and "Traceback" not in text
