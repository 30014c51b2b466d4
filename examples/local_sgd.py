"""K-batch synchronous SGD (local SGD): no gradient all-reduce at all, parameters averaged every K steps.

    torchrun --standalone --nproc_per_node=2 examples/local_sgd.py --every 4
    synccheck lint examples/local_sgd.py      # clean: LocalSGD turns sync off on purpose
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from synccheck.runtime import LocalSGD

from common import Clock, finish, make_model, micro_batches, parse_args, setup

args = parse_args()
rank, world = setup()
model = DDP(make_model(args))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
local_sgd = LocalSGD(model, optimizer, every=args.every)
clock = Clock(window=args.every)      # each timed window holds one averaging
for i, (x, y) in enumerate(micro_batches(args, rank)):
    loss = torch.nn.functional.mse_loss(model(x), y) / args.accum
    loss.backward()                         # local gradients only: LocalSGD holds DDP's sync off
    if (i + 1) % args.accum == 0:
        optimizer.step()
        local_sgd.step()                    # every K optimizer steps: one parameter all-reduce
        optimizer.zero_grad()
        clock.step()
local_sgd.average()                         # leave with one model, not world_size of them
finish(model, clock)
