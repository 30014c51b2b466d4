"""The fix, as a library: `synccheck.runtime.GradientAccumulator` syncs once per optimizer step.

    torchrun --standalone --nproc_per_node=2 examples/accumulate.py
    synccheck lint examples/accumulate.py      # clean
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from synccheck.runtime import GradientAccumulator

from common import Clock, finish, make_model, micro_batches, parse_args, setup

args = parse_args()
rank, world = setup()
model = DDP(make_model(args))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
batches = micro_batches(args, rank)
acc = GradientAccumulator(model, steps=args.accum, total=len(batches))
clock = Clock()
for x, y in batches:
    with acc.accumulate():                  # forward and backward both inside: sync off until the boundary
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)                  # divides by the real size of the window
    if acc.sync_gradients:
        optimizer.step()
        optimizer.zero_grad()
        clock.step()
finish(model, clock)
