"""Facts (stage 7): a data-parallel wrapper built and thrown away (SC103's plainest form).

``torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])`` written as a statement of its
own, or ``manager.init_training(model, optimizer)`` whose helper returns the wrapper it built and keeps
it nowhere else: the script goes on training ``model`` itself, so no reducer ever runs, every backward
all-reduces nothing and each rank steps on its own gradients.
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple

from synccheck.analyzer.project.definitions import called_name, enclosing_function
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.traversal import walk, walk_no_defs
from synccheck.analyzer.project.values import Func, Tup, Wrapper

# the calls that may build a wrapper: its class, or a helper named for what it does
# (``init_training``, ``setup_ddp``, ``wrap_model``, ``to_distributed``)
_WRAPPING_NAME = re.compile(r"^(DistributedDataParallel|DDP|FullyShardedDataParallel|FSDP)$|"
                            r"init|setup|wrap|prepare|ddp|parallel|distribut|shard", re.I)
# the model trained after: a backward, a step, or the model handed to a training function
_TRAINING = r"\.backward\(|\.step\(|\b\w*train\w*\([^)]*\b{name}\b"

# wrappers that return a new object (FSDP2's ``fully_shard`` and ``replicate`` change the module in place)
_RETURNED = ("ddp", "fsdp")


class Discarded(NamedTuple):
    module: object
    node: ast.Call          # the call whose wrapper is thrown away
    model: str              # what it wraps, as written (``model``)
    helper: str             # the project function that built it ("" for the wrapper's own class)


def discarded_wrappers(program) -> list:
    values = program.values
    out = []
    for module in program.project.linted():
        text = module.text
        if ".backward(" not in text and "train" not in text:
            continue
        for stmt in walk(module.tree):
            if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call) or not stmt.value.args:
                continue
            call = stmt.value
            first = call.args[0]
            if not isinstance(first, ast.Name) or not _WRAPPING_NAME.search(called_name(call)):
                continue
            scope = enclosing_function(module, call) or module
            if not _trained_after(module, scope, call, first.id):
                continue
            held = values.expr(call, scope)
            # (or the first item of what it returns: ``return models, optimizers``)
            held = held | frozenset(x for v in held if isinstance(v, Tup) and v.items for x in v.items[0])
            made = [v for v in held if isinstance(v, Wrapper) and v.kind in _RETURNED]
            if not made:
                continue
            helper = _helper(values, call, scope)
            if helper is None:
                continue
            if not _used_after(scope, call, first.id) or _wrapped_later(values, scope, call, first.id):
                continue
            out.append(Discarded(module, call, first.id, helper))
    return out


def _helper(values, call, scope):
    """"" when the call is the wrapper's class itself; the name of the project function that returns
    the wrapper and keeps it nowhere (no store to an attribute, an item or a global); None otherwise."""
    func = call.func
    if called_name(call) in ("DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP"):
        return ""
    targets = [v.fn for v in values.expr(func, scope) if isinstance(v, Func)] if isinstance(func, ast.Name) else \
        [v.fn for v in values.expr(func, scope) if hasattr(v, "fn") and isinstance(v.fn, Function)]
    if len(targets) != 1:
        return None
    fn = targets[0]
    for n in walk_no_defs(fn.node):
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            return None
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            stores = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, (ast.Attribute, ast.Subscript)) for s in stores for t in walk(s)):
                return None
    return fn.node.name


def _scope_nodes(scope):
    """The nodes of a function's own body (not its nested definitions), or of a whole module."""
    return walk_no_defs(scope.node) if isinstance(scope, Function) else walk(scope.tree)


def _used_after(scope, call, name: str) -> bool:
    """Is ``name`` read after the call in the same scope (the model trained as it is)?"""
    end = (call.end_lineno or call.lineno, call.end_col_offset or 0)
    for n in _scope_nodes(scope):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and \
                (n.lineno, n.col_offset) > end:
            return True
    return False


def _wrapped_later(values, scope, call, name: str) -> bool:
    """Is ``name`` bound to a wrapper after the call (``DDP(model)`` tried, then ``model = DDP(model)``)?"""
    for n in _scope_nodes(scope):
        if isinstance(n, ast.Assign) and n.lineno > call.lineno and \
                any(isinstance(t, ast.Name) and t.id == name for t in n.targets) and \
                any(isinstance(v, Wrapper) for v in values.expr(n.value, scope)):
            return True
    return False


def _trained_after(module, scope, call, name: str) -> bool:
    """Is the model trained after the call in the same scope (a backward, an optimizer step, or
    ``train(model, ...)``)? A unit test that builds a wrapper to see it warn trains nothing."""
    end = scope.node.end_lineno if isinstance(scope, Function) else None
    lines = module.text.splitlines()[call.end_lineno or call.lineno:end]
    return re.search(_TRAINING.format(name=re.escape(name)), "\n".join(lines)) is not None
