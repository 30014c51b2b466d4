"""The abstract state of the sync analysis: what is true of gradient synchronization at one point.

A state maps *properties* to the set of condition assignments (a guard, see guards.py) under which
they hold. A property is everything that decides what the next forward, backward or optimizer step
does to gradients:

* ``controls``: the sync controls in effect (``with model.no_sync():``, ``accelerator.accumulate``,
  a context entered on an ``ExitStack``), innermost last;
* ``flags``: ``require_backward_grad_sync`` / ``set_requires_gradient_sync`` values written so far;
* ``forwards``: per model, whether its last forward (not yet differentiated) decided to sync: DDP
  decides at forward time;
* ``tokens``: per model, the last backward since the optimizer last stepped, and whether its
  gradients were all-reduced. A token is *resolved* by the next step (a boundary micro-step), the
  next backward of the same model (it accumulated, and its all-reduce, if any, was wasted) or a
  ``zero_grad`` (its gradients were thrown away);
* ``first``: the loops in their first iteration (DDP's ``static_graph`` needs the first to sync).

Properties are merged only when equal, so paths are told apart exactly as far as synchronization
differs along them, and no further: the number of properties at a point is small and does not grow
with the number of branches (property simulation, after Das, Lerner and Seigle, PLDI 2002).
"""
from __future__ import annotations

import ast
from typing import NamedTuple, Optional

from synccheck.analyzer.parse import dotted as _dotted

PLAIN = "<plain>"      # the model key of a backward through no data-parallel wrapper


# the env's entry for the wrappers frozen for a phase (``ddp_g.requires_grad_(False)``): event_calls
# writes it, micro_step's forward reads it, inlining hands it to a helper
FROZEN = "#frozen"


class Control(NamedTuple):
    models: frozenset         # wrapper keys it names; empty: it may name any
    effect: str               # off | managed | unknown
    site: tuple               # where it was entered (a ``with``, ``enter_context``)
    owner: int                # the ``with`` statement whose exit removes it
    how: str
    counter: tuple = ()       # accelerate's accumulate(): the site of the accelerator it counts micro-steps of


class Forward(NamedTuple):
    model: object
    decided: str              # on | off | managed | unknown
    by: Optional[tuple]       # the control or flag that decided it
    site: tuple               # the forward call
    flag_after: Optional[tuple] = None    # a flag written after this forward, before its backward


class Token(NamedTuple):
    model: object
    site: tuple               # the backward call
    synced: str               # on | off | managed | unknown | manual
    by: Optional[tuple]       # the control or flag that turned sync off
    forward_outside: bool     # forward inside no_sync, backward outside it
    misses_forward: bool      # a control covers the backward but not its forward (SC102)
    loops: tuple = ()         # the loops around the backward (the innermost is its micro-step loop)
    shared: bool = False      # the backward ran through several models (a GAN's generator loss)
    frozen: Optional[int] = None   # the guard of the micro-step it came from, once a loop went round


class Prop(NamedTuple):
    controls: tuple = ()
    flags: tuple = ()         # ((model, value, site), ...) sorted by model
    forwards: tuple = ()
    tokens: tuple = ()
    first: frozenset = frozenset()


class EnvVal(NamedTuple):
    """What the analysis knows of a local name (or an expression) along the paths joined here."""
    alts: tuple               # ((guard, frozenset of values), ...): values under conditions
    prov: frozenset = frozenset()     # the wrappers whose forward produced this tensor
    scaled: Optional[bool] = None     # divided / multiplied on the way (None: cannot tell)
    cond: Optional[tuple] = None      # (true, false) guards when it is a condition
    version: object = 0               # which definition of the name reaches here
    origin: object = None             # the value it is a copy of (events.origin_of), for counters

    @property
    def values(self) -> frozenset:
        out = frozenset()
        for _, v in self.alts:
            out |= v
        return out


def with_flag(prop: Prop, model, value: str, site) -> Prop:
    flags = tuple(sorted([f for f in prop.flags if f[0] != model] + [(model, value, site)], key=lambda f: repr(f[0])))
    forwards = tuple(f._replace(flag_after=site) if f.model == model else f for f in prop.forwards)
    return prop._replace(flags=flags, forwards=forwards)


def flag_of(prop: Prop, model):
    for m, value, site in prop.flags:
        if m == model:
            return value, site
    return None


def sync_state(prop: Prop, model, managed_models=frozenset()) -> tuple:
    """(on | off | managed | unknown, the control or flag that decided it) for a model now."""
    if model in managed_models:
        return "managed", None
    mine = [c for c in prop.controls if not c.models or model in c.models]
    for effect in ("managed", "unknown", "off"):
        for control in reversed(mine):
            if control.effect == effect:
                return effect, control.site
    flag = flag_of(prop, model)
    if flag is not None:
        return flag
    return "on", None


def origin_of(node, st):
    """What a counter or modulus expression is a copy of, so that one count read under several
    names is one condition: ``accum = self.accum`` and ``self.accum``, a loop's ``batch_idx`` and
    the callee's ``batch_idx = loss_dict["batch_idx"]`` read from ``{"batch_idx": batch_idx}``, a
    parameter and the argument passed in. ("name", text, version) for a name or attribute chain,
    ("dict", ((key, origin), ...)) for a dict literal, ("shift", origin, n) for a count moved on by n
    (``step += 1``), None when it is none of these."""
    t = type(node)
    if t is ast.Name or t is ast.Attribute:
        text = node.id if t is ast.Name else _dotted(node)
        if text is None:
            return None
        known = st.env.get(text)
        if known is None:
            return ("name", text, 0)
        return known.origin if known.origin is not None else ("name", text, known.version)
    if t is ast.Subscript and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        within = origin_of(node.value, st)
        if within is not None and within[0] == "dict":
            return next((o for k, o in within[1] if k == node.slice.value), None)
        return None
    if t is ast.BinOp and isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(node.right, ast.Constant) and \
            type(node.right.value) is int:
        # ``step + 1`` (``step += 1``): the count it was, moved on
        base = origin_of(node.left, st)
        delta = node.right.value if isinstance(node.op, ast.Add) else -node.right.value
        if base is None or base[0] not in ("name", "shift"):
            return None
        return ("shift", base[1], base[2] + delta) if base[0] == "shift" else ("shift", base, delta)
    if t is ast.Dict and len(node.keys) <= 64:
        fields = []
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                o = origin_of(v, st)
                if o is not None:
                    fields.append((k.value, o))
        return ("dict", tuple(fields)) if fields else None
    return None
