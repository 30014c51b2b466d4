"""Shared by the rank workers and by tests/test_runtime.py (which loads this file by path).

The model, the data and the single-process reference live here once, so the workers train and the
test checks against exactly the same thing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

FEATURES = 6
ROWS = 4  # rows per micro-batch
MICRO_STEPS = 10  # micro-batches per rank
STEPS = 4  # micro-steps per optimizer step: windows 4, 4, 2
LR = 0.05
MOMENTUM = 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def make_optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=LR, momentum=MOMENTUM)


def make_data(world_size: int) -> dict[str, torch.Tensor]:
    """x, y: [rank, micro_step, row, ...]; mask: which rows count as items (some micro-batches have none)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(world_size, MICRO_STEPS, ROWS, FEATURES, generator=generator)
    y = torch.randn(world_size, MICRO_STEPS, ROWS, 1, generator=generator)
    mask = torch.rand(world_size, MICRO_STEPS, ROWS, generator=generator) < 0.6
    mask[0, 1] = False  # a micro-batch without items on one rank only
    return {"x": x, "y": y, "mask": mask}


def windows(total: int = MICRO_STEPS, steps: int = STEPS) -> list[list[int]]:
    return [list(range(start, min(start + steps, total))) for start in range(0, total, steps)]


def reference_training(
    data: dict[str, torch.Tensor], *, token_weighted: bool = False, divide_by_steps: bool = False
) -> dict[str, torch.Tensor]:
    """One process, one optimizer step per window on all ranks' micro-batches of that window concatenated.

    ``divide_by_steps`` reproduces Accelerate's normalization (by the fixed N, also in a short last
    window), to show the comparison can tell the two apart.
    """
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    for window in windows():
        x = data["x"][:, window].reshape(-1, FEATURES)
        y = data["y"][:, window].reshape(-1, 1)
        squared_error = (model(x) - y).pow(2).squeeze(1)
        if token_weighted:
            mask = data["mask"][:, window].reshape(-1)
            loss = squared_error[mask].sum() / mask.sum()
        else:
            loss = squared_error.mean()
        if divide_by_steps:
            loss = loss * len(window) / STEPS
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def run_worker(main: Callable[[int, int], dict]) -> None:
    """``python WORKER.py RANK WORLD_SIZE PORT OUT_DIR``: run ``main`` in a gloo group, save its result.

    The result is written (atomically) before the final barrier, and the process leaves with
    ``os._exit`` so torch 2.13's occasional gloo abort at interpreter teardown cannot lose it.
    """
    import torch.distributed as dist

    rank, world_size, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = main(rank, world_size)
    partial = out_dir / f"rank{rank}.pt.partial"
    torch.save(result, partial)
    os.replace(partial, out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
