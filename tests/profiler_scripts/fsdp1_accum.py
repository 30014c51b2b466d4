"""Gradient accumulation with FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`) on CPU/gloo.

--mode every:  every micro-step's backward reduce-scatters its gradients (no sync control);
--mode nosync: the forward and backward of every non-boundary micro-step inside `model.no_sync()` (the
               intended use: FSDP1 then keeps unsharded gradients and reduce-scatters on the boundary).
"""
import argparse
import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["every", "nosync"], default="every")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--accum", type=int, default=3)
args = p.parse_args()

warnings.filterwarnings("ignore", category=FutureWarning)   # FSDP1's deprecation notice, once per rank
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
cpu = torch.device("cpu")
# Nested FSDP units (each Linear, then the root, which holds no parameters of its own): the inner units'
# forwards run inside the root's, and only the root's is a micro-step.
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
net[0], net[2] = FSDP(net[0], device_id=cpu), FSDP(net[2], device_id=cpu)
model = FSDP(net, device_id=cpu)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)   # every rank sees different data
for i in range(args.steps * args.accum):
    boundary = (i + 1) % args.accum == 0
    x = torch.randn(8, 16, generator=gen)
    with (model.no_sync() if args.mode == "nosync" and not boundary else nullcontext()):
        loss = model(x).pow(2).mean() / args.accum
        loss.backward()
    if boundary:
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
os._exit(0)
