"""Facts that need the project's values but not the sync dataflow.

* sync controls called on the module inside a wrapper, not the wrapper (SC104): in unwrapped.py;
* ``accelerator.accumulate`` on an Accelerator never told how many steps to accumulate (SC105);
* collectives that only some ranks reach (SC301): in rank_branches.py;
* ``DistributedSampler`` objects whose ``set_epoch`` is never called (SC302): in samplers.py.
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple

from synccheck.analyzer.project.definitions import called_name
from synccheck.analyzer.project.options import keyword_argument
from synccheck.analyzer.project.values import Ext, Framework
# SC104's facts live in unwrapped.py; their names stay importable from here
from synccheck.analyzer.project.unwrapped import (Unwrapped, _binding, _forwards_through, _holds_wrapper,  # noqa: F401
                                                  _is_wrapping_call, _text, _unwrapped_alias, no_sync_on_unwrapped)


class UnconfiguredAccumulate(NamedTuple):
    module: object
    node: object
    accelerator_text: str
    one: bool = False           # built with ``gradient_accumulation_steps=1`` written out


# a count of micro-steps the script keeps itself (``args.gradient_accumulation_steps``, ``grad_accum``)
_ACCUMULATION_COUNT = re.compile(r"\b\w*(?:grad\w*_?accum|accum\w*_steps|accumulation_steps)\w*\b")
_ACCELERATOR_BEFORE = re.compile(r"accelerat\w*\.$", re.I)
_PASSED_ONE = re.compile(r"\bgradient_accumulation_steps\s*=\s*1\b")


def accumulate_without_steps(program) -> list:
    """SC105's fact: the ``accumulate()`` calls on an accelerator never told to accumulate, less those
    told 1 in a script that counts no micro-steps of its own (one step per batch, as asked)."""
    return [found for found, counted in _never_skipping(program) if counted]


def never_skipping_accumulates(program) -> set:
    """(path, line) of every ``accumulate()`` whose accelerator syncs and steps on every micro-batch:
    no context entered after the forward can cost a sync there (SC102 is moot)."""
    return {(found.module.path, found.node.lineno) for found, _ in _never_skipping(program)}


def _never_skipping(program) -> list:
    if program.never_skipping is not None:
        return program.never_skipping
    values = program.values
    out = []
    configured = _configured_frameworks(program)
    # the files SC105 wants (they say accumulate and Accelerator) are parsed already: no search
    for scope, call in values.calls("accumulate"):
        module = values.module_of(scope)
        if not module.linted or not isinstance(call.func, ast.Attribute):
            continue
        receiver = values.expr(call.func.value, scope)
        frameworks = [v for v in receiver if isinstance(v, Framework) and v.kind == "accelerate"]
        # (one of several: ``if args.with_tracking: Accelerator(gradient_accumulation_steps=n, ...)`` /
        # ``else: Accelerator()`` leaves the default run without accumulation)
        if not frameworks or all(v.accumulates != "no" or v in configured or _built_where_one(program, v)
                                 for v in frameworks):
            continue
        if any(not isinstance(v, Framework) for v in receiver):
            continue
        unset = [v for v in frameworks if v.accumulates == "no"]
        one = bool(unset) and all(_written_one(program, v) for v in unset)
        # (``Accelerator(gradient_accumulation_steps=1)`` and nothing else in the script counts
        # micro-steps: one step per batch is what it asks for, the context is boilerplate)
        out.append((UnconfiguredAccumulate(module, call, _text(module, call.func.value), one),
                    not one or _counts_micro_steps(module)))
    program.never_skipping = out
    return out


def _written_one(program, framework) -> bool:
    """Was this Accelerator built with ``gradient_accumulation_steps=1`` written out?"""
    from synccheck.analyzer.project.value_frameworks import call_at

    built = call_at(program.project, framework.site)
    return built is not None and any(k.arg == "gradient_accumulation_steps" and isinstance(k.value, ast.Constant)
                                     and k.value.value == 1 for k in built.keywords)


def _counts_micro_steps(module) -> bool:
    """Does the script name a count of micro-steps other than the keyword it passes 1 to?"""
    text = module.text
    # (``loss / accelerator.gradient_accumulation_steps``: the accelerator's own count, that 1)
    counts = sum(1 for m in _ACCUMULATION_COUNT.finditer(text)
                 if not _ACCELERATOR_BEFORE.search(text, max(0, m.start() - 40), m.start()))
    return counts > len(_PASSED_ONE.findall(text))


def _built_where_one(program, framework) -> bool:
    """Was this Accelerator (built without steps) built where the count of micro-steps is 1: on the
    ``else`` side of ``if cfg.grad_accum_steps > 1:`` (or after that side returned), or in a script
    that sets ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, which ``Accelerator()`` reads?"""
    path, line = framework.site[0], framework.site[1]
    module = program.project.module_at(path)
    if module is None:
        return False
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in module.text:
        return True
    from synccheck.analyzer.project.branches import _count_is_one

    def inside(stmts) -> bool:
        return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in stmts)

    def search(stmts) -> bool:
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.If):
                one, in_body = _count_is_one(stmt.test)
                if one is not None:
                    if inside(stmt.body) and in_body or inside(stmt.orelse) and in_body is False:
                        return True
                    if not in_body and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)) and \
                            not stmt.orelse and inside(stmts[i + 1:]):
                        return True     # ``if n > 1: return Accelerator(gradient_accumulation_steps=n)``
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt) and inside(block) and \
                        search(block):
                    return True
        return False
    return search(module.tree.body)


def _configured_frameworks(program) -> set:
    """Accelerators given their steps after construction: ``accelerator.gradient_accumulation_steps = n``."""
    out = set()
    values = program.values
    for module in program.project.modules():
        if "gradient_accumulation_" not in module.text:
            continue
        for scope in [module] + list(module.functions.values()):
            info = values.info(scope)
            for receiver, attr, _, _ in info.obj_attrs:
                if attr in ("gradient_accumulation_steps", "gradient_accumulation_plugin"):
                    out |= {v for v in values.expr(receiver, scope) if isinstance(v, Framework)}
    return out


class LightningStaticGraph(NamedTuple):
    module: object
    node: object          # the DDPStrategy(static_graph=True) call
    trainer: object       # the Trainer(...) call


_LIGHTNING = ("lightning", "pytorch_lightning")


def lightning_static_graph_accumulation(program) -> list:
    """``Trainer(strategy=DDPStrategy(static_graph=True), accumulate_grad_batches=n)``: Lightning runs
    the micro-steps before each boundary under ``no_sync``, the very first one included (SC106)."""
    values = program.values
    out = []
    for scope, call in values.calls("Trainer"):
        module = values.module_of(scope)
        if not module.linted:
            continue
        callee = values.expr(call.func, scope)
        if not any(isinstance(v, Ext) and v.qualname.split(".")[0] in _LIGHTNING for v in callee):
            continue
        info = values.info(scope)
        accumulate = keyword_argument(call, "accumulate_grad_batches", info)
        if accumulate is None or (isinstance(accumulate, ast.Constant) and accumulate.value in (0, 1, None)):
            continue
        strategy = keyword_argument(call, "strategy", info)
        for where, node in _static_graph_strategies(program, strategy, scope):
            out.append(LightningStaticGraph(where, node, call))
    return out


def accelerate_static_graph_accumulation(program) -> list:
    """``Accelerator(gradient_accumulation_steps=n, kwargs_handlers=[DistributedDataParallelKwargs(
    static_graph=True)])`` with ``accelerator.accumulate(model)``: accelerate runs the micro-steps off
    the boundary under ``no_sync``, the very first one included (SC106; accelerate#3679)."""
    values = program.values
    out = []
    for scope, call in values.calls("Accelerator"):
        module = values.module_of(scope)
        if not module.linted or ".accumulate(" not in module.text:
            continue
        callee = values.expr(call.func, scope)
        if not any(isinstance(v, Ext) and v.qualname.startswith("accelerate") for v in callee):
            continue
        info = values.info(scope)
        accumulate = keyword_argument(call, "gradient_accumulation_steps", info)
        if accumulate is None or (isinstance(accumulate, ast.Constant) and accumulate.value in (0, 1, None)):
            continue
        for node in _handlers(keyword_argument(call, "kwargs_handlers", info), info):
            if called_name(node) == "DistributedDataParallelKwargs" and any(
                    k.arg == "static_graph" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords):
                # reported where the micro-steps go under no_sync: the ``accumulate(...)`` of this file
                entered = sorted((c for s, c in values.calls("accumulate") if values.module_of(s) is module),
                                 key=lambda c: (c.lineno, c.col_offset))
                out.append(LightningStaticGraph(module, entered[0] if entered else node, call))
                break
    return out


def _handlers(node, info, depth: int = 0) -> list:
    """The calls a ``kwargs_handlers=`` list holds, through names bound once in the function."""
    if node is None or depth > 3:
        return []
    if isinstance(node, (ast.List, ast.Tuple)):
        return [c for e in node.elts for c in _handlers(e, info, depth + 1)]
    if isinstance(node, ast.Call):
        return [node]
    if isinstance(node, ast.Name):
        return [c for value, path in info.assigns.get(node.id, ()) if not path
                for c in _handlers(value, info, depth + 1)]
    return []


def _static_graph_strategies(program, node, scope, depth: int = 0) -> list:
    """The ``DDPStrategy(..., static_graph=True)`` calls a strategy argument can be: the call itself,
    a name bound to it, or what a project function returns."""
    if node is None or depth > 3:
        return []
    values = program.values
    if isinstance(node, ast.Call):
        func = node.func
        if called_name(node) == "DDPStrategy":
            if any(k.arg == "static_graph" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in node.keywords):
                return [(values.module_of(scope), node)]
            return []
        out = []
        for v in values.expr(func, scope):
            fn = getattr(v, "fn", None)
            if fn is not None:
                for ret in values.info(fn).returns:
                    out.extend(_static_graph_strategies(program, ret, fn, depth + 1))
        return out
    if isinstance(node, ast.IfExp):
        return _static_graph_strategies(program, node.body, scope, depth) + \
            _static_graph_strategies(program, node.orelse, scope, depth)
    if isinstance(node, ast.Name):
        out = []
        for value, path in values.info(scope).assigns.get(node.id, ()):
            if not path:
                out.extend(_static_graph_strategies(program, value, scope, depth + 1))
        return out
    return []
