"""Gradient accumulation that communicates once per optimizer step and divides by the real window.

A *window* is the run of micro-steps whose gradients add up before one optimizer step. Every
micro-step of a window except the last (the *boundary*) runs its forward and backward with gradient
sync off; the boundary's backward all-reduces (DDP) or reduce-scatters (FSDP) the whole accumulated
``.grad`` once. The last micro-step of the data is a boundary too, so a short final window still syncs
and steps, and :meth:`GradientAccumulator.backward` normalizes by that window's real size.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ._wrappers import SyncSwitch

T = TypeVar("T")
_LossForm = Literal["mean", "items"]


class GradientAccumulator:
    """Accumulate gradients over ``steps`` micro-steps, syncing only on the boundary micro-step.

    Use it exactly like this (forward *and* backward inside ``accumulate()``)::

        acc = GradientAccumulator(model, steps=4, total=len(loader))
        for x, y in loader:
            with acc.accumulate():
                loss = loss_fn(model(x), y)
                acc.backward(loss)
            if acc.sync_gradients:
                optimizer.step()
                optimizer.zero_grad()

    ``model`` is the object whose forward you call: a ``DistributedDataParallel`` or
    ``FullyShardedDataParallel`` wrapper, a module with ``fully_shard`` applied (FSDP2), or a plain
    module (then nothing is switched; one-process training works unchanged).

    Args:
        model: the wrapped (or plain) model.
        steps: micro-steps per optimizer step (the window size).
        total: micro-steps in the data, usually ``len(loader)``. The micro-step numbered ``total``
            is a boundary even in the middle of a window, and counting starts again after it (one
            epoch). Leave it ``None`` for an iterable of unknown length and loop over
            ``acc.iterate(data)`` instead, which finds the last item by looking one ahead.
        scaler: a ``torch.amp.GradScaler``; :meth:`backward` then runs
            ``scaler.scale(loss).backward()``. Stepping stays yours (``scaler.step``, ``scaler.update``).
        process_group: the group gradients are averaged over, used to sum item counts for
            ``backward(..., num_items=n)``. Defaults to the wrapper's own group (DDP, FSDP1) or the
            default group (FSDP2); a plain module keeps its counts local.
    """

    def __init__(
        self,
        model: nn.Module,
        steps: int,
        total: int | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
            raise ValueError(f"total must be a positive int or None, got {total!r}")
        self.steps = steps
        self.total = total
        self.scaler = scaler
        self._switch = SyncSwitch(model)
        self._group = process_group if process_group is not None else self._switch.gradient_group
        self._micro_step = 0  # index of the next micro-step in the data; back to 0 after the last one
        self._window_position = 0  # micro-steps already finished in the current window
        self._divisor = steps  # what this window's mean losses are divided by (its size if known)
        self._window_form: _LossForm | None = None
        self._window_items: float | torch.Tensor = 0.0
        self._in_micro_step = False
        self._sync_gradients = False
        self._next_is_last_of_data = False  # set by iterate() when it hands out the final item
        self._synced_once = False

    @property
    def sync_gradients(self) -> bool:
        """True when the current (or just finished) micro-step is a boundary: step the optimizer."""
        return self._sync_gradients

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Run one micro-step: its forward and backward sync only if it is a boundary."""
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.accumulate() is already active: micro-steps cannot nest")
        last_of_data = self._next_is_last_of_data or (
            self.total is not None and self._micro_step + 1 == self.total
        )
        boundary = last_of_data or self._window_position + 1 == self.steps
        if self._window_position == 0 and self.total is not None:
            self._divisor = min(self.steps, self.total - self._micro_step)
        # DDP(static_graph=True) records its graph during the first synced iteration and hits an
        # internal assert if that iteration runs under no_sync (pytorch#143580). An extra sync is
        # always correct, because DDP all-reduces the whole accumulated .grad, not only this
        # backward's share; it only costs one more all-reduce, once.
        sync = boundary or (self._switch.static_graph and not self._synced_once)
        self._sync_gradients = boundary
        self._in_micro_step = True
        try:
            with contextlib.nullcontext() if sync else self._switch.off():
                yield
        finally:
            self._in_micro_step = False
        # Reached only when the body finished: a micro-step that raised is not counted.
        self._synced_once = self._synced_once or sync
        self._window_position += 1
        self._micro_step += 1
        if boundary:
            self._finish_window()
        if last_of_data:
            self._micro_step = 0
            self._next_is_last_of_data = False

    def backward(
        self, loss: torch.Tensor, *, num_items: int | float | torch.Tensor | None = None, **kwargs: Any
    ) -> None:
        """Backward of one micro-step's loss, normalized over the window.

        ``acc.backward(loss)``: ``loss`` is a mean over the micro-batch; it is divided by the real
        number of micro-steps in the window, so the window's gradient is the mean of its micro-steps
        (DDP/FSDP then average over ranks): exactly one large batch when micro-batches are equally
        large, short last window included. When they are not (a short last batch, padding), use:

        ``acc.backward(loss_sum, num_items=n)``: ``loss_sum`` is a *sum* over ``n`` items (tokens,
        say). The window's gradient becomes the sum over all its items on all ranks divided by their
        total count, however unevenly items fall across micro-steps and ranks. The total is only
        known at the boundary, so the backward runs on the plain sum and the boundary multiplies the
        synced gradients by ``world_size / total_items`` (one all-reduce of the counts per window).
        That rescales every ``.grad`` of the model, so gradients must be zero when a window starts
        (``optimizer.zero_grad()`` after each step, as in the loop above).

        Extra keyword arguments go to ``Tensor.backward``.
        """
        if not self._in_micro_step:
            raise RuntimeError(
                "acc.backward() must run inside `with acc.accumulate():`, together with its forward"
            )
        form: _LossForm = "mean" if num_items is None else "items"
        if self._window_form not in (None, form):
            raise ValueError("one window mixes acc.backward(loss) and acc.backward(loss, num_items=...)")
        self._window_form = form
        if num_items is None:
            loss = loss / self._divisor
        else:
            count = num_items.detach() if isinstance(num_items, torch.Tensor) else float(num_items)
            self._window_items = self._window_items + count
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield ``iterable``'s items, looking one ahead so the last item's micro-step syncs.

        For data of unknown length (``total=None``); run exactly one micro-step per item.
        """
        self._next_is_last_of_data = False
        iterator = iter(iterable)
        try:
            item = next(iterator)
        except StopIteration:
            return
        for upcoming in iterator:
            yield item
            item = upcoming
        self._next_is_last_of_data = True
        yield item

    def _finish_window(self) -> None:
        """Correct the window's normalization once its real size and item count are known."""
        factor = 1.0
        if self._window_form == "mean" and self._window_position != self._divisor:
            # The window ended early (end of an iterable of unknown length): its losses were divided
            # by `steps`, not by the number of micro-steps it really had.
            factor = self._divisor / self._window_position
        elif self._window_form == "items":
            total_items = self._global_item_count()
            if total_items > 0:
                # The wrapper averaged the summed gradients over its ranks: undo that mean and
                # divide by the items of all ranks instead.
                ranks = dist.get_world_size(self._group) if self._group is not None else 1
                factor = ranks / total_items
        if factor != 1.0:
            with torch.no_grad():
                for parameter in self._switch.model.parameters():
                    if parameter.grad is not None:
                        parameter.grad.mul_(factor)
        self._window_position = 0
        self._divisor = self.steps
        self._window_form = None
        self._window_items = 0.0

    def _global_item_count(self) -> float:
        device = next(self._switch.model.parameters()).device
        items = torch.as_tensor(self._window_items, dtype=torch.float64, device=device)
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.all_reduce(items, group=self._group)
        return float(items.item())
