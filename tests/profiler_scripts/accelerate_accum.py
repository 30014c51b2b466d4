"""Gradient accumulation with Hugging Face Accelerate, run by `accelerate launch` on 2 CPU processes (gloo).

    accelerate launch --multi_gpu --num_processes 2 --main_process_port PORT accelerate_accum.py --mode accumulate

`--multi_gpu` is what makes `accelerate launch` start several local processes (through torch.distributed.run);
`--cpu` would pick its single-process launcher (or mpirun with --mpirun_hostfile). `Accelerator(cpu=True)`
then makes the workers use gloo on CPU.

--mode accumulate: `Accelerator(gradient_accumulation_steps=ACCUM)` and `with accelerator.accumulate(model)`
                   (DDP's no_sync on every micro-step but the last of each window): 1 synced micro-step per step;
--mode every:      the same loop without `accelerator.accumulate(model)`; the step is gated by hand, so every
                   micro-step's backward all-reduces (SC101).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["accumulate", "every"], default="accumulate")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--accum", type=int, default=4)
args = p.parse_args()

accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=True)
rank = accelerator.process_index
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = accelerator.prepare(model, opt)
gen = torch.Generator().manual_seed(100 + rank)   # every rank sees different data
for i in range(args.steps * args.accum):
    x = torch.randn(8, 16, generator=gen)
    y = torch.randn(8, 4, generator=gen)
    if args.mode == "accumulate":
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()          # the prepared optimizer only steps when accelerator.sync_gradients
            opt.zero_grad()
    else:
        loss = nn.functional.mse_loss(model(x), y) / args.accum  # EVERY-FORWARD
        loss.backward()         # no sync control: every micro-step all-reduces
        if (i + 1) % args.accum == 0:
            opt.step()  # EVERY-STEP
            opt.zero_grad()
accelerator.wait_for_everyone()
dist.destroy_process_group()
os._exit(0)
