"""The K-batch table: gradient accumulation against local SGD, held-out accuracy and wall time, 2 gloo ranks.

    python benchmarks/bench_local_sgd.py --quick      # 3 seeds: a few minutes on 2 CPU cores
    python benchmarks/bench_local_sgd.py              # 5 seeds
    python benchmarks/bench_local_sgd.py --help       # sizes, budgets, learning-rate rule

Leonid Boytsov's K-batch synchronous SGD proposal ("Benchmarking HuggingFace Accelerator: Synchronous
SGD Does Not Scale with PCI Express 3.0", http://searchivarius.org/blog/benchmarking-huggingface-accelerator-synchronous-sgd-does-not-scale-pci-express-30)
compares, for a fixed number of training samples, fully synchronous SGD with N gradient-accumulation
steps against syncing only every K batches (N, K = 1, 2, 4, 8, 16). This script runs the same grid
on a small task that needs no download:

- **task**: 8-class classification of 10-dimensional points; every class is a mixture of 16 Gaussian
  clusters (noise 0.4) whose centres are drawn once from a fixed generator, so the classes interleave
  and a linear model gets about 30 %; a 10-128-128-8 ReLU MLP gets above 95 % when trained long enough.
  Training samples are a prefix of one fixed pool (like the proposal's 4K and 40K subsets of SQuAD);
  accuracy is measured on 4,096 fixed held-out samples.
- **budget**: ``--epochs`` passes over ``--samples`` training samples, sharded over the ranks every
  epoch as ``DistributedSampler`` does, ``--batch`` samples per rank per micro-batch.
- ``accumulate``: ``DistributedDataParallel`` + ``synccheck.runtime.GradientAccumulator(steps=N)``:
  one all-reduce and one optimizer step per N micro-batches, so an effective batch of
  ranks x batch x N and N times fewer updates for the same samples. The learning rate follows the
  effective batch (``--lr-rule``, default linear: ``lr x N``, Goyal et al. 2017, the usual rule for
  SGD with momentum); N = 1 is full synchronous SGD, every batch all-reduced.
- ``local_sgd``: ``DistributedDataParallel`` + ``synccheck.runtime.LocalSGD(every=K)`` at its defaults
  (no synchronous warm-up): every rank steps on its own batch, parameters averaged every K steps.
  The learning rate stays ``--lr``.

SGD with momentum 0.9, constant learning rate. Every (scheme, K, seed) is a fresh model seeded by the
seed (initialization and shuffling; the task and held-out set never change). Runs are interleaved:
each seed is one round over all K and both schemes, in an order that rotates from round to round, so
load from other jobs on a shared machine falls on both schemes alike. ``seconds`` is rank 0's wall
time for the whole budget (between barriers; model set-up and evaluation excluded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from synccheck.runtime import GradientAccumulator, LocalSGD

SCHEMES = ["accumulate", "local_sgd"]
SCHEME_TITLES = {
    "accumulate": "full sync, N accumulation steps (GradientAccumulator)",
    "local_sgd": "sync every K batches (LocalSGD)",
}
FEATURES, CLASSES, CLUSTERS_PER_CLASS, NOISE = 10, 8, 16, 0.4
HIDDEN = 128
HELD_OUT = 4096
LR_RULES = {"linear": lambda n: float(n), "sqrt": math.sqrt, "none": lambda n: 1.0}


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 5 (about 5 minutes on 2 shared cores)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--samples", type=int_list, default=[4096, 16384],
                        help="training-set sizes, one table row each (default 4096,16384)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training set: the budget (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per micro-batch (default 16)")
    parser.add_argument("--ks", type=int_list, default=[1, 2, 4, 8, 16], help="values of N and K (default 1,2,4,8,16)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 5, 3 with --quick)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of full sync every batch (N = 1) and of local SGD (default 0.05)")
    parser.add_argument("--lr-rule", choices=sorted(LR_RULES), default="linear",
                        help="accumulation's learning rate: lr x N (linear, the default), lr x sqrt(N), or lr (none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows and every run here")
    args = parser.parse_args(argv)
    if args.seeds is None:
        args.seeds = 3 if args.quick else 5
    if args.ranks < 1 or args.seeds < 1 or args.epochs < 1 or args.batch < 1:
        parser.error("--ranks, --seeds, --epochs and --batch must be positive")
    for samples in args.samples:
        batches = samples // (args.ranks * args.batch)
        if batches < 1:
            parser.error(f"--samples {samples} gives no full batch of {args.batch} per rank on {args.ranks} ranks")
    return args


# --- the task --------------------------------------------------------------------------------------


def make_data(train: int) -> dict[str, torch.Tensor]:
    """The first ``train`` samples of the fixed training pool, and the fixed held-out set."""
    centres = torch.randn(CLASSES * CLUSTERS_PER_CLASS, FEATURES, generator=torch.Generator().manual_seed(1000))
    generator = torch.Generator().manual_seed(2000)

    def draw(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        cluster = torch.randint(0, len(centres), (count,), generator=generator)
        return centres[cluster] + NOISE * torch.randn(count, FEATURES, generator=generator), cluster % CLASSES

    x_test, y_test = draw(HELD_OUT)  # drawn first, so it does not depend on the training size
    x_train, y_train = draw(train)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def rank_batches(data: dict[str, torch.Tensor], seed: int, epoch: int, rank: int, ranks: int,
                 batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches for one epoch: a seeded shuffle, every ranks-th sample, full batches only."""
    order = torch.randperm(len(data["y_train"]), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    mine = order[rank::ranks]
    count = len(order) // ranks // batch  # the same on every rank, so the ranks agree on the boundaries
    return [(data["x_train"][mine[i * batch:(i + 1) * batch]], data["y_train"][mine[i * batch:(i + 1) * batch]])
            for i in range(count)]


# --- one run -------------------------------------------------------------------------------------


def train(scheme: str, k: int, seed: int, data: dict[str, torch.Tensor], args: argparse.Namespace,
          rank: int, ranks: int) -> dict:
    """Train one fresh model for the whole budget; return rank 0's wall time, accuracy and loss."""
    model = DistributedDataParallel(make_model(seed))
    lr = args.lr * (LR_RULES[args.lr_rule](k) if scheme == "accumulate" else 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    epochs = [rank_batches(data, seed, epoch, rank, ranks, args.batch) for epoch in range(args.epochs)]
    updates = 0
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    if scheme == "accumulate":
        accumulator = GradientAccumulator(model, steps=k, total=len(epochs[0]))
        for batches in epochs:
            for x, y in batches:
                with accumulator.accumulate():
                    accumulator.backward(loss_fn(model(x), y))
                if accumulator.sync_gradients:
                    optimizer.step()
                    optimizer.zero_grad()
                    updates += 1
    else:
        local_sgd = LocalSGD(model, optimizer, every=k)
        for batches in epochs:
            for x, y in batches:
                loss_fn(model(x), y).backward()
                optimizer.step()
                local_sgd.step()
                optimizer.zero_grad()
                updates += 1
        if local_sgd.optimizer_steps % k:
            local_sgd.average()  # a budget that is not a multiple of K: evaluate the averaged model
        local_sgd.close()
    cpu = time.process_time() - cpu_start
    dist.barrier()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        net = model.module.eval()
        logits = net(data["x_test"])
        accuracy = (logits.argmax(1) == data["y_test"]).float().mean().item()
        test_loss = loss_fn(logits, data["y_test"]).item()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(ranks)]
        dist.all_gather(everyone, flat)
    return {"scheme": scheme, "k": k, "seed": seed, "seconds": seconds, "cpu_seconds": cpu,
            "accuracy": accuracy,
            "test_loss": test_loss if math.isfinite(test_loss) else None, "updates": updates, "lr": lr,
            "ranks_identical": all(torch.equal(other, everyone[0]) for other in everyone)}


def schedule(args: argparse.Namespace) -> list[tuple[int, str, int, int]]:
    """(samples, scheme, k, seed) in run order: one round per seed, order rotating between rounds."""
    runs = []
    for round_index in range(args.seeds):
        shift = round_index % len(args.ks)
        ks = args.ks[shift:] + args.ks[:shift]
        for position, k in enumerate(ks):
            for samples in args.samples:
                schemes = SCHEMES if (round_index + position) % 2 == 0 else SCHEMES[::-1]
                runs += [(samples, scheme, k, round_index) for scheme in schemes]
    return runs


def worker(rank: int, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    pool = make_data(max(args.samples))
    datasets = {samples: {**pool, "x_train": pool["x_train"][:samples], "y_train": pool["y_train"][:samples]}
                for samples in args.samples}
    # Untimed warm-up: gloo's first collectives and DDP's first iterations cost extra once.
    warm = argparse.Namespace(**{**vars(args), "epochs": 1})
    small = {**pool, "x_train": pool["x_train"][:args.ranks * args.batch * 8],
             "y_train": pool["y_train"][:args.ranks * args.batch * 8]}
    for scheme in SCHEMES:
        train(scheme, 2, 0, small, warm, rank, args.ranks)
    runs = []
    for samples, scheme, k, seed in schedule(args):
        result = train(scheme, k, seed, datasets[samples], args, rank, args.ranks)
        runs.append({"samples": samples, **result})
    if rank == 0:
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps(runs))
        os.replace(partial, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 + gloo sometimes aborts in interpreter teardown


def run_ranks(args: argparse.Namespace) -> list[dict]:
    """Spawn the ranks on a free port and return every run's record (rank 0's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        try:
            mp.spawn(worker, args=(args, out), nprocs=args.ranks)
        except mp.ProcessExitedException:
            if not out.exists():  # rank 0 wrote everything before the final barrier: a late abort is harmless
                raise
        return json.loads(out.read_text())


# --- the table -----------------------------------------------------------------------------------


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (samples, scheme, k): mean and standard deviation over the seeds, and both speedups."""
    cells: dict[tuple[int, str, int], list[dict]] = {}
    for run in runs:
        cells.setdefault((run["samples"], run["scheme"], run["k"]), []).append(run)
    rows = []
    for (samples, scheme, k), group in sorted(cells.items(), key=lambda item: (
            item[0][0], SCHEMES.index(item[0][1]), item[0][2])):
        group.sort(key=lambda run: run["seed"])
        rows.append({
            "samples": samples, "scheme": scheme, "k": k,
            "seconds": statistics.mean(run["seconds"] for run in group),
            "seconds_std": spread([run["seconds"] for run in group]),
            "cpu_seconds": statistics.mean(run["cpu_seconds"] for run in group),
            "accuracy": statistics.mean(run["accuracy"] for run in group),
            "accuracy_std": spread([run["accuracy"] for run in group]),
            "seeds": [run["seed"] for run in group],
            "updates": group[0]["updates"], "lr": group[0]["lr"],
        })
    by_key = {(row["samples"], row["scheme"], row["k"]): row for row in rows}
    for row in rows:
        own = by_key.get((row["samples"], row["scheme"], 1))
        full = by_key.get((row["samples"], "accumulate", 1))
        row["speedup_vs_k1"] = own["seconds"] / row["seconds"] if own else None
        row["speedup_vs_full_sync"] = full["seconds"] / row["seconds"] if full else None
        row["cpu_speedup_vs_full_sync"] = full["cpu_seconds"] / row["cpu_seconds"] if full else None
    return rows


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(rows: list[dict], args: argparse.Namespace) -> str:
    ks = sorted({row["k"] for row in rows})
    samples_list = sorted({row["samples"] for row in rows})
    by_key = {(row["samples"], row["scheme"], row["k"]): row for row in rows}
    seeds = len(rows[0]["seeds"]) if rows else 0
    lines = [
        (f"{args.ranks} ranks, gloo, {os.cpu_count()} CPUs, torch {torch.__version__}, Python "
         f"{platform.python_version()}, {args.threads} thread(s) per rank"),
        (f"task: {CLASSES} classes x {CLUSTERS_PER_CLASS} Gaussian clusters in {FEATURES}-D, MLP "
         f"{FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}; held-out accuracy on {HELD_OUT:,} samples"),
        (f"budget: {args.epochs} epochs, {args.batch} samples per rank per batch; SGD momentum 0.9, lr {args.lr:g} "
         f"(accumulation: lr rule '{args.lr_rule}'); {seeds} seed(s) per cell, runs interleaved"),
        "",
        "accuracy (mean of seeds) and speedup over full sync every batch (accumulation N = 1)",
        "",
    ]
    cell = 16
    header = f"{'':<56}{'samples':>8}  " + "".join(f"{'N/K=' + str(k) if k == ks[0] else k:>{cell}}" for k in ks)
    lines.append(header)
    for scheme in SCHEMES:
        for samples in samples_list:
            cells = []
            for k in ks:
                row = by_key.get((samples, scheme, k))
                cells.append("-" if row is None else f"{row['accuracy']:.3f} {_times(row['speedup_vs_full_sync'])}")
            lines.append(f"{SCHEME_TITLES[scheme]:<56}{samples:>8,}  " + "".join(f"{c:>{cell}}" for c in cells))
    lines += [
        "",
        "mean ± standard deviation over seeds; seconds = wall time for the whole budget, speedups from it;",
        "CPU s = rank 0's process time (user + system), which other jobs on a shared machine do not inflate",
        "",
        (f"{'samples':>8} {'scheme':<11} {'N/K':>4} {'updates':>8} {'lr':>6} {'accuracy':>15} {'seconds':>15} "
         f"{'vs K=1':>7} {'vs full sync':>13} {'CPU s':>7} {'CPU vs full':>12}"),
    ]
    for row in rows:
        lines.append(
            f"{row['samples']:>8,} {row['scheme']:<11} {row['k']:>4} {row['updates']:>8} {row['lr']:>6.3g} "
            f"{row['accuracy']:>8.3f} ± {row['accuracy_std']:.3f} {row['seconds']:>8.2f} ± {row['seconds_std']:<4.2f} "
            f"{_times(row['speedup_vs_k1']):>7} {_times(row['speedup_vs_full_sync']):>13} {row['cpu_seconds']:>7.2f} "
            f"{_times(row['cpu_speedup_vs_full_sync']):>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    runs = run_ranks(args)
    rows = summarize(runs)
    print(table(rows, args))
    print(f"\n{len(runs)} runs in {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {"args": {name: (str(value) if isinstance(value, Path) else value)
                            for name, value in vars(args).items()},
                   "torch": torch.__version__, "rows": rows, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
