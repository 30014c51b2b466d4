"""Seconds per optimizer step for four ways of training with gradient accumulation, 2 ranks on gloo.

    python benchmarks/bench_accumulate.py            # defaults: one to two minutes on 2 CPU cores
    python benchmarks/bench_accumulate.py --help     # sizes, micro-steps, rounds

Modes, each stepping the optimizer every ``--micro-steps`` micro-batches:

- ``sync every micro-step``: plain DDP loop, every backward all-reduces (no ``no_sync`` at all).
- ``hand-written no_sync``: the correct manual loop; forward and backward of non-boundary micro-steps
  inside ``model.no_sync()``.
- ``GradientAccumulator``: ``synccheck.runtime.GradientAccumulator``.
- ``LocalSGD``: no gradient all-reduce; parameters averaged every ``--every`` optimizer steps.

The model is a stack of wide ``Linear`` layers fed ``--rows`` rows, so communication dominates
compute, as on GPUs joined by PCIe or Ethernet (seeds 001, 004). Modes run interleaved, in a
rotating order, for ``--rounds`` rounds after one untimed round. The table shows wall-clock seconds
per optimizer step (median, min, max over the rounds) and rank 0's CPU seconds (process time: all
threads, user and system, so gloo's copies and socket calls count). On a shared machine other load
inflates wall time, never the work a rank does, so the CPU column is the steadier one there. A last
line measures what the accumulator's own bookkeeping costs per micro-step, on a module too small to
time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from synccheck.runtime import GradientAccumulator, LocalSGD

MODES = ["sync every micro-step", "hand-written no_sync", "GradientAccumulator", "LocalSGD"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="features of each Linear layer (default 2048)")
    parser.add_argument("--layers", type=int, default=2, help="Linear layers (default 2)")
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch (default 1)")
    parser.add_argument("--micro-steps", type=int, default=4, help="micro-steps per optimizer step, N (default 4)")
    parser.add_argument("--every", type=int, default=4, help="LocalSGD: optimizer steps per averaging, K (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per timed run (default 4)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of all modes (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--json", type=Path, help="also write the raw timings here")
    return parser.parse_args(argv)


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*layers)


def make_runners(args: argparse.Namespace, rank: int) -> dict[str, Callable[[], None]]:
    """One callable per mode that runs ``args.steps`` optimizer steps on its own model copy."""
    n = args.micro_steps
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.rows, args.width, generator=generator) for _ in range(n)]

    def setup() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        model = DistributedDataParallel(make_model(args))
        return model, torch.optim.SGD(model.parameters(), lr=1e-4)

    def sync_every_micro_step() -> Callable[[], None]:
        model, optimizer = setup()

        def run() -> None:
            for _ in range(args.steps):
                for x in batches:
                    (model(x).square().mean() / n).backward()
                optimizer.step()
                optimizer.zero_grad()

        return run

    def hand_written() -> Callable[[], None]:
        model, optimizer = setup()

        def run() -> None:
            for _ in range(args.steps):
                for micro_step, x in enumerate(batches):
                    boundary = micro_step == n - 1
                    with contextlib.nullcontext() if boundary else model.no_sync():
                        (model(x).square().mean() / n).backward()
                optimizer.step()
                optimizer.zero_grad()

        return run

    def accumulator() -> Callable[[], None]:
        model, optimizer = setup()
        acc = GradientAccumulator(model, steps=n)

        def run() -> None:
            for _ in range(args.steps):
                for x in batches:
                    with acc.accumulate():
                        acc.backward(model(x).square().mean())
                    if acc.sync_gradients:
                        optimizer.step()
                        optimizer.zero_grad()

        return run

    def local_sgd() -> Callable[[], None]:
        model, optimizer = setup()
        averager = LocalSGD(model, optimizer, every=args.every)

        def run() -> None:
            for _ in range(args.steps):
                for x in batches:
                    (model(x).square().mean() / n).backward()
                optimizer.step()
                averager.step()
                optimizer.zero_grad()

        return run

    return dict(zip(MODES, [sync_every_micro_step(), hand_written(), accumulator(), local_sgd()]))


def worker(rank: int, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    runners = make_runners(args, rank)
    # Wall time is what training takes; the rank's CPU time (all its threads, user and system, so
    # gloo's copies and socket calls count) is the work it did, which other load on a shared
    # machine does not inflate the way it inflates wall time.
    seconds: dict[str, dict[str, list[float]]] = {kind: {mode: [] for mode in MODES} for kind in ("wall", "cpu")}
    for round_index in range(args.rounds + 1):  # round 0 is untimed: DDP rebuilds buckets, caches warm
        shift = round_index % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            runners[mode]()
            cpu = time.process_time() - cpu_start
            dist.barrier()
            if round_index:
                seconds["wall"][mode].append((time.perf_counter() - start) / args.steps)
                seconds["cpu"][mode].append(cpu / args.steps)
    if rank == 0:
        out.write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13 + gloo sometimes aborts in interpreter teardown


def bookkeeping_overhead(micro_steps: int, chunks: int = 40, repeats: int = 250) -> float:
    """Seconds GradientAccumulator adds per micro-step over a bare loop, on a module too small to time.

    The distributed timings above move with other load on the machine; this isolates what the
    accumulator itself costs (its context manager, counters and loss division). Bare and accumulated
    chunks alternate; other load only adds time, so each side's fastest chunk is kept.
    """
    model = nn.Linear(1, 1)
    x = torch.ones(1, 1)
    acc = GradientAccumulator(model, steps=micro_steps)

    def bare() -> None:
        for _ in range(repeats):
            with contextlib.nullcontext():
                (model(x).sum() / micro_steps).backward()

    def accumulated() -> None:
        for _ in range(repeats):
            with acc.accumulate():
                acc.backward(model(x).sum())

    best = {bare: float("inf"), accumulated: float("inf")}
    for _ in range(chunks):
        for loop in best:
            start = time.perf_counter()
            loop()
            best[loop] = min(best[loop], (time.perf_counter() - start) / repeats)
    return best[accumulated] - best[bare]


def table(args: argparse.Namespace, seconds: dict[str, dict[str, list[float]]], overhead: float) -> str:
    parameters = args.layers * (args.width * args.width + args.width)
    wall, cpu = seconds["wall"], seconds["cpu"]
    columns = {  # name -> seconds per optimizer step for each mode
        "wall median": {mode: statistics.median(wall[mode]) for mode in MODES},
        "wall min": {mode: min(wall[mode]) for mode in MODES},
        "wall max": {mode: max(wall[mode]) for mode in MODES},
        "CPU median": {mode: statistics.median(cpu[mode]) for mode in MODES},
    }
    lines = [
        f"2 ranks, gloo, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s) per rank",
        f"model: {args.layers} x Linear({args.width}, {args.width}) = {parameters / 1e6:.1f} M params "
        f"({parameters * 4 / 2**20:.0f} MiB fp32), {args.rows} row(s) per micro-batch",
        f"N = {args.micro_steps} micro-steps per optimizer step, LocalSGD K = {args.every}, "
        f"{args.steps} steps per run, {args.rounds} interleaved rounds",
        "CPU = rank 0's process time (all threads, user + system)",
        "",
        f"{'seconds per optimizer step':<44}" + "".join(f"{name:>13}" for name in columns),
    ]
    for mode in MODES:
        lines.append(f"{mode:<44}" + "".join(f"{column[mode]:>13.4f}" for column in columns.values()))
    ratio_columns = ["wall median", "wall min", "CPU median"]
    lines += ["", f"{'ratio':<44}" + "".join(f"{name:>13}" for name in ratio_columns)]
    for top, bottom in [
        ("GradientAccumulator", "hand-written no_sync"),
        ("sync every micro-step", "GradientAccumulator"),
        ("GradientAccumulator", "LocalSGD"),
    ]:
        ratios = [columns[name][top] / columns[name][bottom] for name in ratio_columns]
        lines.append(f"{top + ' / ' + bottom:<44}" + "".join(f"{ratio:>13.3f}" for ratio in ratios))
    share = overhead * args.micro_steps / columns["wall min"]["hand-written no_sync"]
    lines += [
        "",
        f"GradientAccumulator bookkeeping: {overhead * 1e6:.1f} us per micro-step "
        f"= {share:.2%} of the fastest hand-written no_sync step",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds.json"
        mp.spawn(worker, args=(args, out), nprocs=2)
        seconds = json.loads(out.read_text())
    overhead = bookkeeping_overhead(args.micro_steps)
    print(table(args, seconds, overhead))
    if args.json:
        raw = {"args": {name: str(value) for name, value in vars(args).items()}, "seconds": seconds,
               "bookkeeping_s_per_micro_step": overhead}
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
