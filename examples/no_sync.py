"""Hand-written correct `no_sync()`: forward and backward of every non-boundary micro-step inside it.

    torchrun --standalone --nproc_per_node=2 examples/no_sync.py
    synccheck lint examples/no_sync.py      # clean
"""
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common import Clock, finish, make_model, micro_batches, parse_args, setup

args = parse_args()
rank, world = setup()
model = DDP(make_model(args))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
clock = Clock()
for i, (x, y) in enumerate(micro_batches(args, rank)):
    boundary = (i + 1) % args.accum == 0
    with nullcontext() if boundary else model.no_sync():
        loss = torch.nn.functional.mse_loss(model(x), y) / args.accum
        loss.backward()
    if boundary:
        optimizer.step()
        optimizer.zero_grad()
        clock.step()
finish(model, clock)
