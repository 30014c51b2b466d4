"""`no_sync()` around the backward only: DDP decided at forward time, so it still syncs every micro-step.

    torchrun --standalone --nproc_per_node=2 examples/no_sync_backward_only.py
    synccheck lint examples/no_sync_backward_only.py      # SC102
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
    if (i + 1) % args.accum != 0:
        with model.no_sync():               # too late: the forward above already armed the all-reduce
            loss.backward()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.step()
finish(model, clock)
