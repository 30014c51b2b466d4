"""Gradient accumulation with FSDP2 (`fully_shard`) on CPU/gloo.

--mode every: every micro-step reduce-scatters its gradients (FSDP's default);
--mode nosync: `set_requires_gradient_sync(False)` on the non-boundary micro-steps (the intended use).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["every", "nosync"], default="every")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--accum", type=int, default=2)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)
for i in range(args.steps * args.accum):
    boundary = (i + 1) % args.accum == 0
    if args.mode == "nosync":
        model.set_requires_gradient_sync(boundary)
    x = torch.randn(8, 16, generator=gen)
    loss = model(x).pow(2).mean() / args.accum
    loss.backward()
    if boundary:
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
os._exit(0)
