"""Gradient accumulation on a tiny DDP model, with the sync misuse chosen by --mode.

Run under torchrun (`torchrun --nproc_per_node=2 accum.py --mode correct`) or on its own with
`--spawn` (torch.multiprocessing.spawn; the rank is known only at init_process_group).
Every micro-step is one DDP forward; the optimizer steps every --accum micro-steps.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from contextlib import nullcontext


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="correct",
                   choices=["every", "backward_only", "correct", "all_nosync", "boundary_nosync", "flag_late",
                            "local_sgd"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=3)
    p.add_argument("--spawn", action="store_true")
    p.add_argument("--hook", action="store_true", help="register a user comm hook that counts its calls")
    p.add_argument("--raise-after", type=int, default=0, help="rank --raise-rank raises after N steps")
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--save", default="", help="rank 0 writes the final weights here")
    p.add_argument("--hook-count", default="", help="each rank writes its user-hook call count here")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per micro-step")
    p.add_argument("--cuda", action="store_true", help="train on the GPU of LOCAL_RANK over NCCL (torchrun only)")
    p.add_argument("--aux-output", action="store_true",
                   help="the model returns (aux, prediction) and the loss ignores aux, whose grad never flows")
    return p.parse_args()


class AuxOutput(nn.Module):
    """Returns (aux, prediction): aux requires grad but no loss uses it, so no gradient ever reaches it."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return torch.ones(1, device=x.device, requires_grad=True) * 2.0, self.net(x)


def train(rank, world_size, args):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    model = model.to(device)
    if args.aux_output:
        model = AuxOutput(model)
    ddp = DDP(model)
    if args.aux_output:
        model = model.net          # --save writes the same keys either way
        forward = ddp

        def ddp_prediction(x):
            return forward(x)[1]
    else:
        ddp_prediction = ddp
    calls = [0]
    if args.hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_user_hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(dist.group.WORLD, counting_user_hook)
    averager = None
    if args.mode == "local_sgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        averager = PeriodicModelAverager(period=2, warmup_steps=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)   # every rank sees different data
    n_micro = args.steps * args.accum
    for i in range(n_micro):
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randn(8, 4, generator=gen).to(device)
        boundary = (i + 1) % args.accum == 0
        if args.mode == "every":
            loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
            loss.backward()
        elif args.mode == "backward_only":
            loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
            if not boundary:
                with ddp.no_sync():  # LATE-NO-SYNC
                    loss.backward()
            else:
                loss.backward()
        elif args.mode == "correct":
            with (ddp.no_sync() if not boundary else nullcontext()):
                loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
                loss.backward()
        elif args.mode in ("all_nosync", "local_sgd"):
            with ddp.no_sync():
                loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
                loss.backward()
        elif args.mode == "boundary_nosync":
            with (ddp.no_sync() if boundary else nullcontext()):
                loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
                loss.backward()
        elif args.mode == "flag_late":
            loss = nn.functional.mse_loss(ddp_prediction(x), y) / args.accum
            ddp.require_backward_grad_sync = boundary
            loss.backward()  # FLAG-LATE-BACKWARD
            ddp.require_backward_grad_sync = True
        if args.sleep:
            time.sleep(args.sleep)
        if boundary:
            opt.step()  # OPTIMIZER-STEP
            if averager is not None:
                # Local SGD: every rank stepped on its own gradients; average the parameters every 2 steps.
                averager.average_parameters(ddp.parameters())
            opt.zero_grad()
            step = (i + 1) // args.accum
            if args.raise_after and step == args.raise_after and rank == args.raise_rank:
                raise RuntimeError(f"rank {rank} fails on purpose after {step} optimizer steps")
    if args.hook_count:
        with open(f"{args.hook_count}.{rank}", "w") as fh:
            fh.write(str(calls[0]))
    if args.save and rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)
    dist.barrier()
    dist.destroy_process_group()


def spawn_worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train(rank, world_size, args)
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse()
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(2, free_port(), args), nprocs=2)
    else:
        dist.init_process_group("nccl" if args.cuda else "gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        os._exit(0)
