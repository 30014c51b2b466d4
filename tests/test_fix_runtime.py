"""Proof at run time: scripts fixed by `synccheck lint --fix --unsafe-fixes` run on 2 gloo ranks under
`synccheck profile`, sync once per optimizer step, and end with the weights of the hand-written
`no_sync` version (to 1e-6)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "profiler_scripts"))
import profiler_testlib as T  # noqa: E402

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FIXABLE = ROOT / "tests" / "fixtures" / "fixable"
SCRIPTS = ["counter_gate.py", "inner_loop.py", "off_by_one.py", "undivided_zero_grad.py", "conditional_wrap.py"]


def lint(*args, cwd):
    proc = subprocess.run(T.synccheck_cmd("lint", "--no-cache", *args), capture_output=True, text=True, cwd=cwd)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


def run_profiled(tmp: Path, script: str, *args: str, weights_in_env: bool = False):
    import torch

    weights = tmp / f"{Path(script).stem}.weights.pt"
    where = () if weights_in_env else (str(weights),)
    run = T.profile(tmp, [T.TORCHRUN, "--standalone", "--nproc_per_node=2", str(tmp / script), *where, *args],
                    name=Path(script).stem, env=T.base_env(FIX_TEST_WEIGHTS=str(weights)))
    assert run.returncode == 0, run.stderr[-3000:]
    return run, torch.load(weights)


def assert_one_sync_per_step(run, steps: int):
    assert run.report["findings"] == [], run.report["findings"]
    for rank in (0, 1):
        r = run.rank(rank)
        assert r["optimizer_steps"] == steps
        assert r["synced_micro_steps"] == steps, r


def assert_same_weights(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def fixed_fixtures(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fixable")
    for f in FIXABLE.glob("*.py"):
        shutil.copy(f, tmp / f.name)
    before = lint("--format", "concise", ".", cwd=tmp)
    assert before.returncode == 1
    fixed = lint("--fix", "--unsafe-fixes", ".", cwd=tmp)
    assert fixed.returncode == 0 and "All checks passed!" in fixed.stdout, fixed.stdout
    return tmp


@pytest.fixture(scope="module")
def reference(fixed_fixtures):
    return run_profiled(fixed_fixtures, "reference_no_sync.py")[1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_fixed_fixture_syncs_once_per_step_and_matches_no_sync(script, fixed_fixtures, reference):
    assert (fixed_fixtures / script).read_text() != (FIXABLE / script).read_text()
    run, weights = run_profiled(fixed_fixtures, script)
    assert_one_sync_per_step(run, steps=3)
    assert_same_weights(weights, reference)


def test_fixed_conditional_wrap_runs_unwrapped_in_one_process(fixed_fixtures):
    # one process: the model stays a plain module, which has no no_sync(); the fix must not call it
    text = (fixed_fixtures / "conditional_wrap.py").read_text()
    assert 'or not hasattr(model, "no_sync") else model.no_sync()' in text
    out = fixed_fixtures / "one_process.weights.pt"
    proc = subprocess.run([T.TORCHRUN, "--standalone", "--nproc_per_node=1", str(fixed_fixtures / "conditional_wrap.py"),
                           str(out)], capture_output=True, text=True, cwd=fixed_fixtures, env=T.base_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists()


# The bundled examples: their common.py gains one line, in the test's copy only, that saves rank 0's
# final weights to the path in $FIX_TEST_WEIGHTS.
SAVE = ("    if dist.get_rank() == 0:\n"
        "        torch.save([p.detach().clone() for p in model.parameters()], os.environ[\"FIX_TEST_WEIGHTS\"])\n")


@pytest.fixture(scope="module")
def fixed_examples(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("examples")
    for name in ("baseline.py", "no_sync_backward_only.py", "no_sync.py"):
        shutil.copy(EXAMPLES / name, tmp / name)
    common = (EXAMPLES / "common.py").read_text()
    anchor = "    dist.barrier()\n    dist.destroy_process_group()"
    assert anchor in common
    (tmp / "common.py").write_text(common.replace(anchor, SAVE + anchor))
    proc = lint("--fix", "--unsafe-fixes", "baseline.py", "no_sync_backward_only.py", cwd=tmp)
    assert proc.returncode == 0 and "Fixed 2 problems." in proc.stdout, proc.stdout
    return tmp


EXAMPLE_ARGS = ("--steps", "4", "--width", "64")


@pytest.mark.parametrize("script", ["baseline.py", "no_sync_backward_only.py"])
def test_fixed_example_matches_hand_written_no_sync(script, fixed_examples):
    _, expected = run_profiled(fixed_examples, "no_sync.py", *EXAMPLE_ARGS, weights_in_env=True)
    run, weights = run_profiled(fixed_examples, script, *EXAMPLE_ARGS, weights_in_env=True)
    assert_one_sync_per_step(run, steps=4)
    assert_same_weights(weights, expected)
