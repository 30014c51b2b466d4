"""The classic collective mismatch: rank 0 waits in a barrier that only it enters, rank 1 goes on to an
all_reduce. Both block forever (gloo's default timeout is 30 minutes)."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
if rank == 0:
    dist.barrier()  # HANG-BARRIER
t = torch.ones(3)
dist.all_reduce(t)  # HANG-ALLREDUCE
dist.barrier()
dist.destroy_process_group()
os._exit(0)
