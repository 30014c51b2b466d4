"""A short local-SGD run whose only parameter averaging comes after its last optimizer step.

`synccheck.runtime.LocalSGD(every=--every)` switches DDP's gradient all-reduce off and averages the
parameters after optimizer steps K, 2K, ...; with --steps == --every the one averaging all-reduce happens
after the last optimizer step, right before the script ends. --end chooses how it ends (always with
os._exit, which skips atexit and interpreter teardown): `barrier+destroy` (the usual ending),
`barrier` (no destroy_process_group) or `destroy` (no barrier).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from synccheck.runtime import LocalSGD

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=2)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--end", choices=["barrier+destroy", "barrier", "destroy"], default="barrier+destroy")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
local_sgd = LocalSGD(model, opt, every=args.every)
gen = torch.Generator().manual_seed(100 + rank)   # every rank sees different data
for step in range(args.steps):
    for _ in range(args.accum):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        (nn.functional.mse_loss(model(x), y) / args.accum).backward()
    opt.step()
    local_sgd.step()        # averages the parameters after steps K, 2K, ...
    opt.zero_grad()
if "barrier" in args.end:
    dist.barrier()
if "destroy" in args.end:
    dist.destroy_process_group()
os._exit(0)
