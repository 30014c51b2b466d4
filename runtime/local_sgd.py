"""Local SGD (K-batch synchronous SGD): no gradient all-reduce, parameters averaged every K steps.

Each rank steps its optimizer on its own gradients; every ``every`` optimizer steps the ranks average
their parameters, so communication drops from one gradient all-reduce per step to one parameter
all-reduce per K steps. An optional warm-up runs the first optimizer steps fully synchronously (DDP's
usual gradient all-reduce), as post-local SGD does (Lin et al., https://arxiv.org/abs/1808.07217).

The averaging itself is torch's: ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
(flatten everything into one buffer, one all-reduce, unflatten). The schedule is kept here rather than
in ``PeriodicModelAverager`` because that class averages only tensors whose ``.grad`` is set at the
moment of the call: call it after ``zero_grad()`` and it averages nothing, and a parameter unused on
one rank changes the flat buffer's size on that rank only, so the ranks all-reduce buffers of
different sizes. Averaging a fixed list of tensors makes every rank send the same buffer every time.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from ._wrappers import SyncSwitch


class LocalSGD:
    """Turn gradient sync off and average parameters across ranks every ``every`` optimizer steps.

    Usage (call :meth:`step` on every rank after every optimizer step, skipped or not)::

        local_sgd = LocalSGD(model, optimizer, every=4, warmup=100)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            local_sgd.step()
            optimizer.zero_grad()

    ``model`` is a ``DistributedDataParallel`` wrapper (its gradient all-reduce is switched off after
    the warm-up) or a plain module in a process group (it never had one; warm-up is then not
    possible). FSDP is refused: its parameters are sharded, so there is no local model to step.

    What is averaged: the parameters in ``optimizer.param_groups`` and the model's floating-point
    buffers (BatchNorm statistics), since DDP stops broadcasting buffers while sync is off. Optimizer
    state (momentum) stays local, as in post-local SGD.

    Args:
        model: the DDP wrapper or plain module.
        optimizer: the optimizer whose parameters are averaged.
        every: optimizer steps between averagings (K). Averaging happens after local steps K, 2K, ...
        warmup: optimizer steps at the start that keep DDP's gradient all-reduce on.
        process_group: the group to average over (default: DDP's group, else the default group).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int,
        warmup: int = 0,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
        self._switch = SyncSwitch(model)
        if self._switch.kind in ("fsdp", "fsdp2"):
            raise TypeError(
                "LocalSGD needs DDP or a plain module: FSDP shards parameters, so no rank has a model to step alone"
            )
        if self._switch.kind == "local" and warmup:
            raise ValueError("warmup needs a DDP model: a plain module has no gradient all-reduce to keep on")
        if self._switch.static_graph and not warmup:
            raise ValueError(
                "DDP(static_graph=True) must sync its first iteration (pytorch#143580): pass warmup >= 1"
            )
        self.every = every
        self.warmup = warmup
        self.optimizer = optimizer
        self._group = process_group
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = self._switch.gradient_group if self._switch.kind == "ddp" else dist.group.WORLD
        self._optimizer_steps = 0
        if self._switch.kind == "local":
            # DDP's constructor broadcasts rank 0's parameters; a plain module gets the same guarantee
            # (ranks start identical) from one averaging here.
            self.average()
        # The local phase holds the wrapper's sync switch off from the end of warm-up on; for DDP the
        # flag is read at every forward, so every later micro-step runs without gradient all-reduce.
        self._local_phase = contextlib.ExitStack()
        if warmup == 0:
            self._local_phase.enter_context(self._switch.off())

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps counted so far by :meth:`step`."""
        return self._optimizer_steps

    def step(self) -> bool:
        """Count one optimizer step; average parameters when it ends a period (then return True).

        Every rank must call it once per optimizer step, also when ``GradScaler`` skipped the step:
        under local SGD gradients are local, so ranks can skip different steps, and the averaging
        all-reduce must still happen on the same call on every rank.
        """
        self._optimizer_steps += 1
        local_steps = self._optimizer_steps - self.warmup
        if local_steps == 0:
            self._local_phase.enter_context(self._switch.off())
        if local_steps <= 0 or local_steps % self.every:
            return False
        self.average()
        return True

    def average(self) -> None:
        """Average the optimizer's parameters and the model's floating-point buffers now (one all-reduce)."""
        if self._group is None or dist.get_world_size(self._group) == 1:
            return
        average_parameters(iter(self._tensors_to_average()), self._group)

    def close(self) -> None:
        """Turn the wrapper's gradient sync back on (for training after local SGD, or evaluation)."""
        self._local_phase.close()

    def _tensors_to_average(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [b for b in self._switch.model.buffers() if torch.is_floating_point(b)]
        return tensors
