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


class UnwrappedInLoop(NamedTuple):
    module: object
    node: ast.Assign        # ``model = accelerator.unwrap_model(model)`` inside the training loop
    model: str


def unwrapped_in_the_loop(program) -> list:
    """``model = accelerator.unwrap_model(model)`` (or ``model = model.module``) inside the loop that
    trains ``model``, to save a checkpoint (rbiswasfc's Kaggle solutions): every later turn runs the
    forward on the module inside the wrapper, so no backward all-reduces again and the replicas
    diverge. Not when the loop leaves right after, nor when the name is wrapped again in the loop."""
    values = program.values
    out, seen = [], set()
    for module in program.project.linted():
        text = module.text
        if "unwrap_model(" not in text and ".module\n" not in text and ".module)" not in text:
            continue
        for loop in walk(module.tree):
            if not isinstance(loop, (ast.For, ast.AsyncFor, ast.While)):
                continue
            body = [n for s in loop.body for n in walk_no_defs(s)]
            if not any(isinstance(n, ast.Attribute) and n.attr == "backward" for n in body):
                continue
            for n in body:
                name = _unwrapping(n)
                if name is None or id(n) in seen or _leaves_after(loop, n):
                    continue        # (an inner loop's rebinding is in the outer loop's body too: said once)
                if not any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == name
                           for c in body):
                    continue        # (no forward through the name in the loop)
                if sum(isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in a.targets)
                       for a in body) > 1:
                    continue        # (bound again in the loop: wrapped again, or restored)
                scope = enclosing_function(module, n) or module
                if any(isinstance(v, Wrapper) and v.kind in ("ddp", "fsdp", "accelerate")
                       for v in values.expr(ast.Name(id=name, ctx=ast.Load(), lineno=loop.lineno,
                                                     col_offset=loop.col_offset), scope)):
                    out.append(UnwrappedInLoop(module, n, name))
                    seen.add(id(n))
    return out


def _unwrapping(node):
    """The name ``node`` rebinds to the module inside its wrapper: ``x = accelerator.unwrap_model(x)``,
    ``x = x.module``; None otherwise."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return None
    name, value = node.targets[0].id, node.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "unwrap_model" and \
            len(value.args) == 1 and isinstance(value.args[0], ast.Name) and value.args[0].id == name:
        return name
    if isinstance(value, ast.Attribute) and value.attr == "module" and isinstance(value.value, ast.Name) and \
            value.value.id == name:
        return name
    return None


def _leaves_after(loop, node) -> bool:
    """Does the block holding ``node`` (inside ``loop``) leave the loop after it (``break``, ``return``)?"""
    for block_owner in walk(loop):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(block_owner, field, None)
            if isinstance(block, list) and node in block:
                after = block[block.index(node) + 1:]
                # (a ``break`` further down under a test of its own, early stopping, leaves only sometimes)
                return any(isinstance(x, (ast.Break, ast.Return)) for x in after)
    return False
