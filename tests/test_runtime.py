"""synccheck.runtime, proven with real gloo processes: accumulation equals large-batch training.

Seed 002's experiment: two ranks x 10 micro-batches with steps=4 (windows 4, 4, 2) must end with
the weights of one process that steps once per window on the concatenated micro-batches, and only
the boundary micro-steps may communicate gradients. The multi-rank workers live in
tests/runtime_workers/; each is launched once per module (two processes, gloo on 127.0.0.1).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from synccheck.runtime import GradientAccumulator, LocalSGD

WORKERS = Path(__file__).parent / "runtime_workers"
TEARDOWN_ABORT = "terminate called without an active exception"  # torch 2.13 + gloo, at exit


def _load_common():
    spec = importlib.util.spec_from_file_location("runtime_workers_common", WORKERS / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_common()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(script: str, tmp_path: Path, world_size: int = 2, timeout: float = 180) -> list[dict]:
    """Run ``script`` as ``world_size`` gloo ranks and return each rank's saved result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(_free_port())
    logs, processes = [], []
    for rank in range(world_size):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        command = [sys.executable, str(WORKERS / script), str(rank), str(world_size), port, str(tmp_path)]
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        for process in processes:
            process.wait(timeout=timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for rank, (process, log) in enumerate(zip(processes, logs)):
        log.seek(0)
        output = log.read()
        log.close()
        result = tmp_path / f"rank{rank}.pt"
        # A result saved before the final barrier is complete; a non-zero exit is tolerated only
        # for torch 2.13's known abort during gloo teardown.
        if not result.exists() or (process.returncode != 0 and TEARDOWN_ABORT not in output):
            pytest.fail(f"{script} rank {rank} exited {process.returncode}:\n{output[-4000:]}")
        results.append(torch.load(result))
    return results


def max_abs_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert state.keys() == reference.keys()
    return max((state[name] - reference[name]).abs().max().item() for name in reference)


def boundary_indices(flags: list[bool]) -> list[int]:
    return [index for index, flag in enumerate(flags) if flag]


BOUNDARIES = [3, 7, 9]  # windows 4, 4, 2 over 10 micro-steps


# --- GradientAccumulator on DDP and FSDP2 (two gloo ranks) -----------------------------------------


@pytest.fixture(scope="module")
def accumulate_runs(tmp_path_factory) -> list[dict]:
    return run_ranks("accumulate_worker.py", tmp_path_factory.mktemp("accumulate"))


@pytest.fixture(scope="module")
def reference(accumulate_runs) -> dict[str, torch.Tensor]:
    return common.reference_training(accumulate_runs[0]["data"])


@pytest.fixture(scope="module")
def token_reference(accumulate_runs) -> dict[str, torch.Tensor]:
    return common.reference_training(accumulate_runs[0]["data"], token_weighted=True)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "scenario, gradient_collectives_per_sync",
    [
        ("ddp_total", 1),  # one DDP bucket
        ("ddp_iterate", 1),
        ("ddp_grad_scaler", 1),
        ("fsdp1_total", 1),  # one flat parameter
        ("fsdp2_total", 2),  # one reduce-scatter per fully_shard-ed Linear
    ],
)
def test_accumulation_equals_one_process_on_concatenated_batches(
    accumulate_runs, reference, scenario, gradient_collectives_per_sync
):
    for rank, run in enumerate(accumulate_runs):
        result = run["results"][scenario]
        assert boundary_indices(result["boundaries"]) == BOUNDARIES, f"rank {rank}"
        assert boundary_indices(result["synced"]) == BOUNDARIES, f"rank {rank}: synced backward passes"
        assert result["calls"] == len(BOUNDARIES) * gradient_collectives_per_sync
        assert max_abs_diff(result["state"], reference) < 1e-5, f"rank {rank}"


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["ddp_token_weighted", "fsdp2_token_weighted"])
def test_token_weighted_backward_divides_by_the_items_of_all_ranks(
    accumulate_runs, token_reference, reference, scenario
):
    for rank, run in enumerate(accumulate_runs):
        result = run["results"][scenario]
        assert boundary_indices(result["synced"]) == BOUNDARIES, f"rank {rank}"
        assert max_abs_diff(result["state"], token_reference) < 1e-5, f"rank {rank}"
    # Rows without items really were left out: the mean over all rows trains something else.
    assert max_abs_diff(token_reference, reference) > 1e-3


@pytest.mark.multirank
def test_static_graph_syncs_its_first_micro_step_then_only_boundaries(accumulate_runs, reference):
    for rank, run in enumerate(accumulate_runs):
        result = run["results"]["ddp_static_graph"]
        assert boundary_indices(result["synced"]) == [0, *BOUNDARIES], f"rank {rank}"
        assert max_abs_diff(result["state"], reference) < 1e-5, f"rank {rank}"


def test_reference_tells_real_window_division_from_fixed_n(accumulate_runs, reference):
    # Accelerate divides the short last window by N=4 instead of 2; the tolerance above sees that.
    fixed_n = common.reference_training(accumulate_runs[0]["data"], divide_by_steps=True)
    assert max_abs_diff(fixed_n, reference) > 1e-3


# --- GradientAccumulator in one process, no process group ------------------------------------------


def _one_process_micro_batches(data: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Micro-step i sees what both ranks saw at micro-step i, so the same reference applies."""
    x = data["x"].transpose(0, 1).reshape(common.MICRO_STEPS, -1, common.FEATURES)
    y = data["y"].transpose(0, 1).reshape(common.MICRO_STEPS, -1, 1)
    mask = data["mask"].transpose(0, 1).reshape(common.MICRO_STEPS, -1)
    return list(zip(x, y, mask))


@pytest.mark.parametrize("mode", ["total", "iterate", "token_weighted"])
def test_plain_module_in_one_process_equals_large_batch(mode):
    assert not dist.is_initialized()
    data = common.make_data(world_size=2)
    model = common.make_model()
    optimizer = common.make_optimizer(model.parameters())
    micro_batches = _one_process_micro_batches(data)
    total = None if mode == "iterate" else len(micro_batches)
    acc = GradientAccumulator(model, steps=common.STEPS, total=total)
    loop = acc.iterate(iter(micro_batches)) if mode == "iterate" else micro_batches
    boundaries = []
    for x, y, mask in loop:
        with acc.accumulate():
            squared_error = (model(x) - y).pow(2).squeeze(1)
            if mode == "token_weighted":
                acc.backward(squared_error[mask].sum(), num_items=int(mask.sum()))
            else:
                acc.backward(squared_error.mean())
        boundaries.append(acc.sync_gradients)
        if acc.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
    assert boundary_indices(boundaries) == BOUNDARIES
    reference = common.reference_training(data, token_weighted=mode == "token_weighted")
    assert max_abs_diff(model.state_dict(), reference) < 1e-5


def test_total_restarts_the_count_for_the_next_epoch():
    model = nn.Linear(3, 1)
    acc = GradientAccumulator(model, steps=4, total=6)
    flags = []
    for _epoch in range(2):
        for _ in range(6):
            with acc.accumulate():
                acc.backward(model(torch.randn(2, 3)).sum())
            flags.append(acc.sync_gradients)
            if acc.sync_gradients:
                model.zero_grad()
    assert boundary_indices(flags) == [3, 5, 9, 11]


def test_grad_scaler_scales_the_normalized_loss():
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    expected = nn.Linear(3, 1)
    ((expected(x[:4]) - y[:4]).pow(2).mean() / 2 + (expected(x[4:]) - y[4:]).pow(2).mean() / 2).backward()
    model = nn.Linear(3, 1)
    model.load_state_dict(expected.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = GradientAccumulator(model, steps=2, scaler=scaler)
    for rows in (slice(0, 4), slice(4, 8)):
        with acc.accumulate():
            acc.backward((model(x[rows]) - y[rows]).pow(2).mean())
    assert acc.sync_gradients
    torch.testing.assert_close(model.weight.grad, 1024.0 * expected.weight.grad)
    torch.testing.assert_close(model.bias.grad, 1024.0 * expected.bias.grad)


def test_misuse_raises_clear_errors():
    model = nn.Linear(3, 1)
    acc = GradientAccumulator(model, steps=2)
    with pytest.raises(RuntimeError, match="outside|inside `with acc.accumulate"):
        acc.backward(model(torch.randn(1, 3)).sum())
    with acc.accumulate():
        with pytest.raises(RuntimeError, match="cannot nest"):
            with acc.accumulate():
                pass
        acc.backward(model(torch.randn(1, 3)).sum())
    with acc.accumulate():
        with pytest.raises(ValueError, match="mixes"):
            acc.backward(model(torch.randn(1, 3)).sum(), num_items=1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="steps"):
            GradientAccumulator(model, steps=bad)
    with pytest.raises(ValueError, match="total"):
        GradientAccumulator(model, steps=2, total=0)


# --- LocalSGD (two gloo ranks) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_sgd_runs(tmp_path_factory) -> list[dict]:
    return run_ranks("local_sgd_worker.py", tmp_path_factory.mktemp("local_sgd"))


def parameter_all_reduces(record: dict) -> list[int]:
    """dist.all_reduce calls per step that were not DDP's gradient buckets (its comm hook uses it too)."""
    return [total - grads for total, grads in zip(record["all_reduce_calls"], record["grad_allreduces"])]


def ranks_identical(runs: list[dict], scenario: str) -> list[bool]:
    states = [run[scenario]["state"] for run in runs]
    return [
        all(torch.equal(states[0][step][name], states[1][step][name]) for name in states[0][step])
        for step in range(len(states[0]))
    ]


@pytest.mark.multirank
def test_local_sgd_averages_every_k_steps_without_gradient_all_reduce(local_sgd_runs):
    steps = len(local_sgd_runs[0]["local_sgd"]["state"])
    every_fourth = [int((step + 1) % 4 == 0) for step in range(steps)]
    for run in local_sgd_runs:
        record = run["local_sgd"]
        assert record["grad_allreduces"] == [0] * steps
        assert parameter_all_reduces(record) == every_fourth
        assert record["averaged"] == [bool(flag) for flag in every_fourth]
    # Bit-identical right after each averaging (parameters and BatchNorm buffers), and really
    # local in between.
    assert ranks_identical(local_sgd_runs, "local_sgd") == [bool(flag) for flag in every_fourth]


@pytest.mark.multirank
def test_local_sgd_final_loss_within_5_percent_of_synchronous(local_sgd_runs):
    synchronous = local_sgd_runs[0]["sync"]["final_loss"]
    local = local_sgd_runs[0]["local_sgd"]["final_loss"]
    assert all(run["sync"]["grad_allreduces"] == [1] * len(run["sync"]["state"]) for run in local_sgd_runs)
    assert abs(local - synchronous) / synchronous < 0.05, (local, synchronous)


@pytest.mark.multirank
def test_local_sgd_warmup_keeps_gradient_sync_first(local_sgd_runs):
    for run in local_sgd_runs:
        record = run["warmup"]
        assert record["grad_allreduces"] == [1, 1] + [0] * 10
        # Averaging after local steps 4 and 8, i.e. optimizer steps 6 and 10.
        assert boundary_indices(parameter_all_reduces(record)) == [5, 9]
    # Even synchronous DDP leaves BatchNorm's running statistics rank-local after each forward (it
    # broadcasts them before the forward), so only the averagings make the whole state identical.
    assert boundary_indices(ranks_identical(local_sgd_runs, "warmup")) == [5, 9]


@pytest.mark.multirank
def test_local_sgd_on_a_plain_module_starts_identical_and_averages(local_sgd_runs):
    for run in local_sgd_runs:
        record = run["plain"]
        assert record["construction_all_reduces"] == 1
        assert parameter_all_reduces(record) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert boundary_indices(ranks_identical(local_sgd_runs, "plain")) == [3, 7]


def test_local_sgd_in_one_process_and_bad_arguments():
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = LocalSGD(model, optimizer, every=2)
    assert [local_sgd.step() for _ in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="every"):
        LocalSGD(model, optimizer, every=0)
    with pytest.raises(ValueError, match="warmup"):
        LocalSGD(model, optimizer, every=2, warmup=-1)
    with pytest.raises(ValueError, match="warmup needs a DDP model"):
        LocalSGD(model, optimizer, every=2, warmup=3)
