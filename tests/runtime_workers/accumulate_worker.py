"""Rank worker: GradientAccumulator on DDP, FSDP1 and FSDP2 over gloo, counting the gradient collectives.

Each scenario trains on this rank's micro-batches of ``make_data`` and records which micro-steps
communicated gradients (a counting DDP comm hook, a counting FSDP2 reduce-scatter, or FSDP1's
``dist.reduce_scatter_single`` wrapped in a counter), the ``sync_gradients`` flags and the final
full parameters.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel

from _common import MICRO_STEPS, STEPS, make_data, make_model, make_optimizer, run_worker

from synccheck.runtime import GradientAccumulator


class Counter:
    calls = 0


def counting_ddp(**ddp_kwargs) -> tuple[DistributedDataParallel, Counter]:
    counter = Counter()
    model = DistributedDataParallel(make_model(), **ddp_kwargs)

    def hook(state, bucket):
        counter.calls += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    return model, counter


def counting_fsdp2() -> tuple[torch.nn.Module, Counter]:
    counter = Counter()

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            counter.calls += 1
            return super().__call__(*args, **kwargs)

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(CountingReduceScatter())
    return model, counter


def train_fsdp1(data: dict[str, torch.Tensor], rank: int) -> dict:
    counter = Counter()
    model = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"), use_orig_params=True)
    # FSDP1's post-backward reduce-scatters each flat gradient through this function.
    reduce_scatter = dist.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        counter.calls += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting_reduce_scatter
    try:
        return train(model, counter, data, rank)
    finally:
        dist.reduce_scatter_single = reduce_scatter


def train(
    model: torch.nn.Module,
    counter: Counter,
    data: dict[str, torch.Tensor],
    rank: int,
    *,
    total: int | None = MICRO_STEPS,
    use_iterate: bool = False,
    token_weighted: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> dict:
    optimizer = make_optimizer(model.parameters())
    acc = GradientAccumulator(model, steps=STEPS, total=total, scaler=scaler)
    micro_batches = list(zip(data["x"][rank], data["y"][rank], data["mask"][rank]))
    if use_iterate:
        def unsized() -> Iterator:  # no len(): the end is only found by running into it
            yield from micro_batches
        loop = acc.iterate(unsized())
    else:
        loop = micro_batches
    synced, boundaries = [], []
    for x, y, mask in loop:
        before = counter.calls
        with acc.accumulate():
            squared_error = (model(x) - y).pow(2).squeeze(1)
            if token_weighted:
                acc.backward(squared_error[mask].sum(), num_items=mask.sum())
            else:
                acc.backward(squared_error.mean())
        synced.append(counter.calls > before)
        boundaries.append(acc.sync_gradients)
        if acc.sync_gradients:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    return {"synced": synced, "boundaries": boundaries, "calls": counter.calls, "state": full_state(model)}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model):
            return {name: tensor.detach().clone() for name, tensor in model.module.state_dict().items()}
    module = model.module if isinstance(model, DistributedDataParallel) else model
    state = {}
    for name, tensor in module.state_dict().items():
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard: gather the whole parameter
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().clone()
    return state


def main(rank: int, world_size: int) -> dict:
    data = make_data(world_size)
    scenarios: dict[str, Callable[[], dict]] = {
        "ddp_total": lambda: train(*counting_ddp(), data, rank),
        "ddp_iterate": lambda: train(*counting_ddp(), data, rank, total=None, use_iterate=True),
        "ddp_token_weighted": lambda: train(*counting_ddp(), data, rank, token_weighted=True),
        "ddp_grad_scaler": lambda: train(
            *counting_ddp(), data, rank, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12)
        ),
        "ddp_static_graph": lambda: train(*counting_ddp(static_graph=True), data, rank),
        "fsdp1_total": lambda: train_fsdp1(data, rank),
        "fsdp2_total": lambda: train(*counting_fsdp2(), data, rank),
        "fsdp2_token_weighted": lambda: train(*counting_fsdp2(), data, rank, token_weighted=True),
    }
    results = {name: scenario() for name, scenario in scenarios.items()}
    dist.barrier()
    return {"data": data, "results": results}


if __name__ == "__main__":
    run_worker(main)
