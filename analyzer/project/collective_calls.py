"""What a call is, to the rank checker (rank_branches.py): the collectives a module names under other
names, a sub-group's collective, FSDP's full state dict, ``accelerator.save_state`` under DeepSpeed,
a method whose name says it talks to the other ranks, the cases of a ``match`` on the rank."""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.values import parameter_default
from synccheck.analyzer.project.traversal import walk, walk_no_defs


_RUNS_DEEPSPEED = re.compile(r"DeepSpeedPlugin\(|use_deepspeed|DistributedType\.DEEPSPEED|deepspeed_config|--deepspeed")


def _runs_deepspeed(module) -> bool:
    """Does the script say it runs under DeepSpeed (``--use_deepspeed``, ``DeepSpeedPlugin(...)``,
    ``DistributedType.DEEPSPEED``, a ``deepspeed_config`` file)? (diffusers' examples name the plugin
    only to turn ZeRO-3's init off for their frozen models: not enough.)"""
    if _RUNS_DEEPSPEED.search(module.text) is not None:
        return True
    # (or the project's accelerate launch configurations are all DeepSpeed's)
    from synccheck.analyzer.project.launch_configs import ships_only_deepspeed
    return "accelerat" in module.text and ships_only_deepspeed(getattr(module, "path", None))


# a method name that says the method talks to the other ranks
_COMMUNICATING = re.compile(r"sync|reduce|gather|barrier|broadcast|between_processes|average_all|mean_all|avg_all")


def _full_state_dict_models(stmt) -> list:
    """The models a ``with`` statement puts under ``FSDP.state_dict_type(model, FULL_STATE_DICT)``."""
    if not isinstance(stmt, (ast.With, ast.AsyncWith)):
        return []
    return [m for m in map(_full_state_dict, (item.context_expr for item in stmt.items)) if m]


def _full_state_dict(node) -> Optional[str]:
    """The model of ``FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg)`` (its text), or None:
    only that model's ``state_dict()`` all-gathers (not an optimizer's or a scheduler's)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and \
            node.func.attr == "state_dict_type" and "FULL_STATE_DICT" in ast.unparse(node):
        return ast.unparse(node.args[0])
    return None


def _collective_aliases(tree) -> frozenset:
    """The names a module binds to a collective under another name: ``from torch.distributed import
    barrier as sync``, ``reduce = dist.all_reduce``."""
    out = set()
    for node in walk(tree):
        t = type(node)
        if t is ast.alias:
            if node.asname and node.name.rpartition(".")[2] in vocab.COLLECTIVES:
                out.add(node.asname)
        elif t is ast.Assign:
            value = node.value
            last = value.attr if type(value) is ast.Attribute else value.id if type(value) is ast.Name else None
            if last in vocab.COLLECTIVES:
                out.update(n.id for target in node.targets for n in walk(target) if type(n) is ast.Name)
    return frozenset(out)


def _sub_group(group, scope) -> bool:
    """Is ``group=`` a sub-group of the ranks: made by ``new_group(ranks)`` / ``new_subgroups(...)`` in
    this scope, or a group we cannot see made (a parameter, an attribute)? Not ``None``,
    ``dist.group.WORLD``, nor a ``new_group()`` of every rank (a timeout test's group)."""
    if isinstance(group, ast.Constant) or (isinstance(group, ast.Attribute) and group.attr == "WORLD"):
        return False
    made = []
    if isinstance(group, ast.Name) and isinstance(scope, Function) and group.id in scope.params:
        default = parameter_default(scope.node, group.id)
        if isinstance(default, ast.Constant) and default.value is None:
            return False    # ``def barrier(group=None)``: the whole world unless a caller says otherwise
    if isinstance(group, ast.Name) and isinstance(scope, Function):
        for node in walk_no_defs(scope.node):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == group.id for t in node.targets):
                made.append(node.value)
    for value in made:
        if isinstance(value, ast.Call):
            name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
            if name == "new_group" and not value.args and not any(kw.arg == "ranks" for kw in value.keywords):
                return False
    return True


def _case_value(case):
    """The int a ``case`` matches (``case 0:``), or None."""
    pattern = case.pattern
    if case.guard is None and isinstance(pattern, ast.MatchValue) and isinstance(pattern.value, ast.Constant) and \
            type(pattern.value.value) is int:
        return pattern.value.value
    return None


def _is_wildcard(case) -> bool:
    return case.guard is None and isinstance(case.pattern, ast.MatchAs) and case.pattern.pattern is None
