"""Gradient accumulation with DDP, no sync control: every micro-step all-reduces (Accelerate's "Baseline").

    torchrun --standalone --nproc_per_node=2 examples/baseline.py
    synccheck lint examples/baseline.py      # SC101
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common import Clock, finish, make_model, micro_batches, parse_args, setup

args = parse_args()
rank, world = setup()
model = DDP(make_model(args))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
clock = Clock()
for i, (x, y) in enumerate(micro_batches(args, rank)):
    loss = torch.nn.functional.mse_loss(model(x), y) / args.accum
    loss.backward()                         # all-reduces every gradient bucket, every micro-step
    if (i + 1) % args.accum == 0:
        optimizer.step()
        optimizer.zero_grad()
        clock.step()
finish(model, clock)
