"""How to switch gradient synchronization off for one model, whatever wraps it.

Each data-parallel wrapper has its own switch and reads it at a different moment:

- DDP reads ``require_backward_grad_sync`` in ``_pre_forward``/``_post_forward``: the reducer is armed
  for the next backward only when the flag is on *at forward time*. ``DistributedDataParallel.no_sync()``
  flips that flag and restores the previous value, so the forward must run inside it.
- FSDP1 (``FullyShardedDataParallel.no_sync()``, root instance only) and FSDP2
  (``FSDPModule.set_requires_gradient_sync``) read their switch in the post-backward hooks, so for them
  only the backward has to be covered. Covering forward and backward works for all three.
- A plain module (one process, or ranks that average something else themselves) has nothing to switch.

:class:`SyncSwitch` hides those differences behind one context manager, :meth:`SyncSwitch.off`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

WrapperKind = Literal["ddp", "fsdp", "fsdp2", "local"]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """Return the module under ``torch.compile``'s ``OptimizedModule`` (which keeps it as ``_orig_mod``)."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


class SyncSwitch:
    """The gradient-sync switch of one model: DDP, FSDP1, FSDP2 (``fully_shard``) or a plain module."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = unwrap_compiled(model)
        self._fsdp2_modules: list[FSDPModule] = []
        if isinstance(self.model, DistributedDataParallel):
            self.kind: WrapperKind = "ddp"
        elif isinstance(self.model, FullyShardedDataParallel):
            self.kind = "fsdp"
        else:
            # fully_shard() may be applied to the root, to some submodules, or both; every FSDPModule
            # owns its own parameter groups, so each one is switched (recurse=False avoids doing a
            # child twice when its parent is in the list too).
            self._fsdp2_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
            self.kind = "fsdp2" if self._fsdp2_modules else "local"

    @property
    def static_graph(self) -> bool:
        """True for ``DDP(static_graph=True)``, which must sync its first iteration (pytorch#143580)."""
        return self.kind == "ddp" and bool(getattr(self.model, "static_graph", False))

    @property
    def gradient_group(self) -> dist.ProcessGroup | None:
        """The group the wrapper averages gradients over, or None when gradients stay local."""
        if self.kind == "local" or not dist.is_available() or not dist.is_initialized():
            return None
        if self.kind in ("ddp", "fsdp"):
            return self.model.process_group
        # FSDP2 keeps its group inside a DeviceMesh; for pure data parallelism that mesh spans the
        # default group. (For HSDP or 2-D meshes, pass the data-parallel group explicitly.)
        return dist.group.WORLD

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Run the enclosed forward and backward without gradient communication."""
        if self.kind in ("ddp", "fsdp"):
            with self.model.no_sync():
                yield
        elif self.kind == "fsdp2":
            # FSDP2 has no context manager, and no public getter for the flag: it is on unless the
            # user turned it off, so "restore" means "on".
            for module in self._fsdp2_modules:
                module.set_requires_gradient_sync(False, recurse=False)
            try:
                yield
            finally:
                for module in self._fsdp2_modules:
                    module.set_requires_gradient_sync(True, recurse=False)
        else:
            yield
