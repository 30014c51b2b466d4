"""Stage 5 of the pipeline (values), part 1: the abstract value domain, and the analysis's budgets.

Each value is a small named tuple, hashable and compared by what it is: a data-parallel ``Wrapper``
(its kind and options) and the ``Inner`` model under it, an ``Optim``izer, an Accelerator / Fabric
``Framework``, ``Scaler`` / ``NativeScaler``, ``Sampler`` / ``Loader``, sync contexts (``Ctx``,
``CtxFactory``), the functions, classes, instances and modules that carry them (``Func``, ``Bound``,
``Cls``, ``Inst``, ``Mod``, ``Ext``, ``Partial``), containers (``Tup``, ``Bag``), ``Const``ants,
``Accumulator`` / ``LocalSGD`` helpers and ``Unknown``. A value set is a frozenset of these, capped
at ``MAX_VALUES``.
"""
from __future__ import annotations

import builtins
from typing import NamedTuple

from synccheck.analyzer.project.definitions import Class, Function, Module

MAX_VALUES = 24
MAX_CALLERS = 120
MAX_DEPTH = 48            # values being computed at once (a chain of parameters, returns, attributes)
MAX_WORK = 200_000        # values computed per project: past it, what is not known is unknown
MAX_REDONE = 20_000        # past it, values seen inside a cycle are kept as they were then
MAX_KEY_REDONE = 3         # a value dropped this many times (its cycle's head changed) is kept the next time
MAX_PARAM_DEPTH = 5       # parameters followed to their callers' arguments at once
_BUILTINS = frozenset(dir(builtins))


# ---------------------------------------------------------------------------------------------------
# Values. Small named tuples: hashable, compared by what they are.

class Wrapper(NamedTuple):
    kind: str                 # ddp, fsdp, fsdp2, accelerate, fabric, deepspeed
    site: tuple               # (path, line, column[, argument index])
    static_graph: bool = False
    single: bool = False      # Fabric(devices=1): one process, nothing to synchronize
    sharded: bool = False     # Fabric(strategy="fsdp"): its sync switch is read in the backward, as FSDP's
    cls: object = None        # a project subclass (``class DetectorDDP(DDP)``): its own methods


class Obj(NamedTuple):
    """An object we know only by where it came from (``Net()``, a parameter nobody passes)."""
    site: tuple


class Inner(NamedTuple):
    """``wrapper.module``: the module inside a wrapper."""
    wrapper: Wrapper


class Optim(NamedTuple):
    site: tuple
    managed: bool = False     # accelerate / DeepSpeed: zero_grad and step do nothing off the boundary


class Framework(NamedTuple):
    kind: str                 # accelerate | fabric
    site: tuple
    accumulates: str          # "yes" | "no" | "unknown": was it given gradient_accumulation_steps?
    single: bool = False
    sharded: bool = False     # Fabric(strategy="fsdp" / FSDPStrategy(...))


class Scaler(NamedTuple):
    site: tuple


class NativeScaler(NamedTuple):
    """timm's ``NativeScaler``: ``loss_scaler(loss, optimizer)`` runs backward and step."""
    site: tuple


class Sampler(NamedTuple):
    site: tuple
    shuffle_off: bool = False


class Loader(NamedTuple):
    site: tuple


class Ctx(NamedTuple):
    """A context manager that matters to sync: ``model.no_sync()``, ``accelerator.accumulate(model)``,
    ``fabric.no_backward_sync(model, enabled=...)``, ``nullcontext()``, an ``ExitStack``."""
    effect: str               # off | managed | null | exitstack | accumulator
    site: tuple
    how: str = ""


class CtxFactory(NamedTuple):
    """``model.no_sync`` not yet called: the callable form of a sync control."""
    effect: str
    site: tuple
    how: str = ""


class Func(NamedTuple):
    fn: Function


class Bound(NamedTuple):
    fn: Function
    receiver: object          # the value the method was looked up on


class Cls(NamedTuple):
    cls: Class


class Inst(NamedTuple):
    cls: Class


class Super(NamedTuple):
    """``super()`` in a method of class ``after``, on the instance ``inst`` (its class's MRO decides)."""
    inst: Inst
    after: Class


class Partial(NamedTuple):
    site: tuple


class Mod(NamedTuple):
    module: Module


class Ext(NamedTuple):
    qualname: str


class Tup(NamedTuple):
    items: tuple              # of frozensets


class Bag(NamedTuple):
    """A list, set or dict whose elements we know but not their order: ``[unet]`` grown by
    ``append``, ``{"g": opt_g, "d": opt_d}``, ``[opts[k] for k in opts]``."""
    items: frozenset
    keyed: bool = False       # a dict: iterating it gives its keys, not these
    fields: tuple = ()        # a dict literal with string keys: ((key, values), ...)

    def item(self, key) -> frozenset:
        """``bag["key"]``: that entry's values when the dict literal named it, else any element."""
        if self.fields and isinstance(key, str):
            named = next((vals for k, vals in self.fields if k == key), None)
            # what was put in later (``d.update(...)``, ``d[k] = v``) may be under any key
            later = self.items - frozenset().union(*(vals for _, vals in self.fields))
            if named is None:
                return later or ONE_UNKNOWN
            return named | later
        return self.items


class Const(NamedTuple):
    value: object


class Accumulator(NamedTuple):
    """synccheck.runtime.GradientAccumulator: syncs exactly at the boundary."""
    site: tuple


class LocalSGD(NamedTuple):
    site: tuple


class Unknown(NamedTuple):
    pass


UNKNOWN = Unknown()
EMPTY: frozenset = frozenset()
ONE_UNKNOWN = frozenset((UNKNOWN,))


def site_of(module: Module, node, extra=None) -> tuple:
    base = (module.path, getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
    return base + (extra,) if extra is not None else base


def _cap(values) -> frozenset:
    values = frozenset(values)
    if len(values) > MAX_VALUES:
        # (what the rules ask about is kept first: a wrapper among two dozen model classes a factory
        # may build, KAIR's ``define_G``, is the value that matters)
        keep = sorted(values, key=lambda v: (2 if isinstance(v, (Obj, Unknown, Const)) else
                                             0 if isinstance(v, _KEPT_FIRST) else 1, _order(v, 3)))[:MAX_VALUES]
        return frozenset(keep)
    return values


_KEPT_FIRST = (Wrapper, Inner, Optim, Framework, Scaler, NativeScaler, Sampler, Loader, Ctx, CtxFactory, Accumulator,
               LocalSGD)


def _order(v, depth: int) -> str:
    """A value's words for a stable order, to a bounded depth (the whole repr of values nested in
    values grows without bound: Megatron's schedules held attributes of attributes 15 deep)."""
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        if depth <= 0:
            return type(v).__name__
        return type(v).__name__ + "(" + ",".join(_order(x, depth - 1) for x in v) + ")"
    if isinstance(v, (frozenset, set, tuple, list)):
        if depth <= 0:
            return f"[{len(v)}]"
        parts = sorted(_order(x, depth - 1) for x in v)
        return "[" + ",".join(parts[:8]) + (f",+{len(parts) - 8}" if len(parts) > 8 else "") + "]"
    text = repr(v)
    return text if len(text) <= 200 else text[:200]
