"""Rank worker: LocalSGD against fully synchronous DDP on a small noisy regression task, over gloo.

Per optimizer step it records how many gradient all-reduces ran (a counting DDP comm hook), how many
``dist.all_reduce`` calls ran (parameter averaging goes through it; DDP's gradient buckets do not),
and a copy of the full state (parameters and BatchNorm buffers) to compare ranks bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from _common import run_worker

from synccheck.runtime import LocalSGD

FEATURES = 8
BATCH = 16  # rows per rank per step
STEPS = 96
EVERY = 4
NOISE = 0.2


class Counter:
    calls = 0


def make_regression_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def make_regression_data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rank, step, row, feature]; y = a fixed nonlinear function of x plus noise."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(world_size, STEPS, BATCH, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator) / FEATURES**0.5
    y = torch.tanh(2 * x @ w) + NOISE * torch.randn(world_size, STEPS, BATCH, 1, generator=generator)
    return x, y


def train(rank: int, world_size: int, *, mode: str, warmup: int = 0, steps: int = STEPS) -> dict:
    """mode: "sync" (plain DDP), "local_sgd" (DDP + LocalSGD) or "plain" (no DDP, LocalSGD)."""
    x, y = make_regression_data(world_size)
    model = make_regression_model()
    grad_allreduces = Counter()
    if mode != "plain":
        model = DistributedDataParallel(model)

        def hook(state, bucket):
            grad_allreduces.calls += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    all_reduce_calls = Counter()
    original_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        all_reduce_calls.calls += 1
        return original_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        local_sgd = LocalSGD(model, optimizer, every=EVERY, warmup=warmup) if mode != "sync" else None
        construction_all_reduces = all_reduce_calls.calls
        record: dict[str, list] = {"grad_allreduces": [], "all_reduce_calls": [], "averaged": [], "state": []}
        for step in range(steps):
            grads_before, all_reduces_before = grad_allreduces.calls, all_reduce_calls.calls
            loss = (model(x[rank, step]) - y[rank, step]).pow(2).mean()
            loss.backward()
            optimizer.step()
            averaged = local_sgd.step() if local_sgd is not None else False
            optimizer.zero_grad()
            record["grad_allreduces"].append(grad_allreduces.calls - grads_before)
            record["all_reduce_calls"].append(all_reduce_calls.calls - all_reduces_before)
            record["averaged"].append(averaged)
            module = model.module if isinstance(model, DistributedDataParallel) else model
            record["state"].append({k: v.detach().clone() for k, v in module.state_dict().items()})
    finally:
        dist.all_reduce = original_all_reduce
    # The loss on all ranks' data, with BatchNorm normalizing by that data's own statistics (the
    # running averages lag behind the parameters and would add noise to the comparison).
    module = model.module if isinstance(model, DistributedDataParallel) else model
    with torch.no_grad():
        final_loss = (module(x.reshape(-1, FEATURES)) - y.reshape(-1, 1)).pow(2).mean().item()
    record.update(final_loss=final_loss, construction_all_reduces=construction_all_reduces)
    return record


def main(rank: int, world_size: int) -> dict:
    return {
        "sync": train(rank, world_size, mode="sync"),
        "local_sgd": train(rank, world_size, mode="local_sgd"),
        "warmup": train(rank, world_size, mode="local_sgd", warmup=2, steps=12),
        "plain": train(rank, world_size, mode="plain", steps=8),
    }


if __name__ == "__main__":
    run_worker(main)
