"""Stage 6 of the pipeline (sync dataflow), part 1: the flow's state and how paths join.

``St`` is what holds along the paths joined at one point: properties (state.py) mapped to their
guards (guards.py), and the local environment of names to values. ``Frame`` is one function being
analysed, the root or a callee analysed in place. Joining OR-s the guards of equal properties and
merges the values a name holds on each side (``_merge_val``), under the branch condition when it is
exact.
"""
from __future__ import annotations

from typing import Optional

from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.guards import TRUE
from synccheck.analyzer.project.state import EnvVal

class St:
    """Props (property -> guard) and the local environment along the paths joined here."""
    __slots__ = ("props", "env")

    def __init__(self, props: dict, env: dict) -> None:
        self.props = props
        self.env = env

    def copy(self) -> "St":
        # the properties are shared: a dict of properties is never changed in place once a state
        # holds it (each change makes a new one), while the environment is
        return St(self.props, dict(self.env))


DEAD = None


class Frame:
    """One function being analysed (the root, or a callee analysed in place)."""

    def __init__(self, scope, depth: int = 0, stack: tuple = (), no_grad: int = 0) -> None:
        self.scope = scope
        self.module = scope.module if isinstance(scope, Function) else scope
        self.depth = depth
        self.stack = stack
        self.returns: list = []
        self.ret_vals: list = []
        self.ret_nodes: list = []       # the return statements of ret_vals
        self.loops: list = []
        self.no_grad = no_grad
        self.yield_handler = None
        self.control = None             # (module, call) of the with helper(...) this frame runs for
        self.exitstacks: dict = {}      # ExitStack creation site -> the with statement that owns it
        self.gate = False               # inside a branch that decides whether the optimizer steps
        self.ones: list = []            # counts known to be 1 here (the ``else`` of ``if accum > 1:``)


def _same(a: Optional[St], b: Optional[St]) -> bool:
    if a is None or b is None:
        return a is b
    return (a.props is b.props or a.props == b.props) and a.env == b.env


def _merge_props(items) -> dict:
    out: dict = {}
    for p, g in items:
        out[p] = out.get(p, 0) | g
    return out


def _scaled_or(a, b):
    if a or b:
        return True
    if a is None or b is None:
        return None
    return False


def zero_start(v: EnvVal) -> bool:
    """Is ``v`` the 0 an accumulator starts from (``total_loss = 0.0``), no loss yet?"""
    return v.scaled is None and not v.prov and bool(v.alts) and all(
        type(x).__name__ == "Const" and type(x.value) in (int, float) and x.value == 0 for _, vals in v.alts for x in vals)


def _bool_cond(v: EnvVal):
    """(where it is true, where false) of a value that is one boolean constant; else None."""
    if len(v.alts) == 1:
        vals = v.alts[0][1]
        if len(vals) == 1:
            (x,) = tuple(vals)
            if type(x).__name__ == "Const" and type(x.value) is bool:
                return (TRUE, 0) if x.value else (0, TRUE)
    return None


def _merge_val(a: EnvVal, b: EnvVal, formulas) -> EnvVal:
    if a == b:
        return a
    if formulas is not None:
        true, false = formulas
        alts = tuple((g & true, v) for g, v in a.alts if g & true) + tuple((g & false, v) for g, v in b.alts if g & false)
        cond = None
        ca, cb = a.cond or _bool_cond(a), b.cond or _bool_cond(b)
        if ca is not None and cb is not None:
            # (``done = True`` on one side, ``done = False`` on the other: ``if done:`` is that branch)
            cond = ((true & ca[0]) | (false & cb[0]), (true & ca[1]) | (false & cb[1]))
    else:
        alts = a.alts + tuple(x for x in b.alts if x not in a.alts)
        cond = a.cond if a.cond == b.cond else None
    if len(alts) > 8:
        merged = frozenset()
        for _, v in alts:
            merged |= v
        alts = ((TRUE, merged),)
    version = a.version if a.version == b.version else ("merge", _vkey(a.version), _vkey(b.version))
    if a.scaled is None and not a.prov and (b.prov or zero_start(a)):
        scaled = b.scaled       # ``total = 0.0`` before a loop that adds the losses: the losses' scaling
    elif b.scaled is None and not b.prov and (a.prov or zero_start(b)):
        scaled = a.scaled
    else:
        scaled = _scaled_or(a.scaled, b.scaled) if (a.scaled or b.scaled) else \
            (None if a.scaled is None or b.scaled is None else False)
    return EnvVal(alts, a.prov | b.prov, scaled, cond, version, a.origin if a.origin == b.origin else None)


def _vkey(v):
    return v if not isinstance(v, tuple) or len(repr(v)) < 200 else hash(v)
