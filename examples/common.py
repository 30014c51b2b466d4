"""Shared set-up for the example training scripts: arguments, process group, model, data, report.

Each example (baseline.py, no_sync.py, ...) keeps only its training loop, so the loops can be read and
compared side by side. Run one with torchrun, on CPU:

    torchrun --standalone --nproc_per_node=2 examples/no_sync.py --steps 8
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--width", type=int, default=2048, help="hidden width: one width x width layer (16 MB at 2048)")
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--every", type=int, default=4, help="local SGD: average parameters every K steps")
    return parser.parse_args()


def setup() -> tuple:
    """Join the process group torchrun describes (gloo: this runs on CPU)."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)                     # the same initial weights on every rank
    return dist.get_rank(), dist.get_world_size()


def make_model(args) -> nn.Module:
    # Wide and shallow: many bytes to all-reduce, little compute. On 2 CPU ranks that is the regime
    # of GPUs joined by PCI Express, where communication can cost as much as the training itself.
    return nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                         nn.Linear(args.width, 1))


def _true_w() -> torch.Tensor:
    return torch.randn(64, 1, generator=torch.Generator().manual_seed(7))


def micro_batches(args, rank: int) -> list:
    """Each rank's micro-batches for the whole run (a regression task; different data per rank)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    true_w = _true_w()
    out = []
    for _ in range(args.steps * args.accum):
        x = torch.randn(args.batch, 64, generator=gen)
        out.append((x, x @ true_w))
    return out


class Clock:
    """Seconds per optimizer step: the fastest run of ``window`` consecutive steps after the warm-up.

    The first ``warmup`` steps are left out (DDP rebuilds its buckets after step 1). On a shared machine
    other load only ever adds time, in bursts, so the fastest window is the steadiest estimate of what
    the loop itself costs; a window of K steps (local SGD's averaging period) holds exactly one
    averaging, so a periodic cost is counted in full.
    """

    def __init__(self, warmup: int = 2, window: int = 4) -> None:
        self.warmup, self.window, self.steps, self.times = warmup, window, 0, []

    def step(self) -> None:
        self.steps += 1
        if self.steps >= self.warmup:
            self.times.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        t, n = self.times, min(self.window, len(self.times) - 1)
        if n < 1:
            return float("nan")
        return min(t[i + n] - t[i] for i in range(len(t) - n)) / n


def eval_loss(model: nn.Module) -> float:
    """The loss on one fixed held-out batch: the same yardstick for every variant (the exact ones agree)."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), x @ _true_w()))


def finish(model: nn.Module, clock: Clock) -> None:
    """Print one JSON line from rank 0, check the replicas agree, and leave cleanly."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    checksum = torch.tensor([flat.double().sum().item()])
    sums = [torch.zeros(1, dtype=checksum.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    if dist.get_rank() == 0:
        print("EXAMPLE_RESULT " + json.dumps({
            "seconds_per_optimizer_step": clock.seconds_per_step(),
            "optimizer_steps": clock.steps,
            "final_loss": eval_loss(model),
            "ranks_agree": max(s.item() for s in sums) - min(s.item() for s in sums) < 1e-6,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo can abort during interpreter teardown; everything is printed by now
    os._exit(0)
