"""Facts that need the project's values but not the sync dataflow.

* sync controls called on the module inside a wrapper, not the wrapper (SC104);
* ``accelerator.accumulate`` on an Accelerator never told how many steps to accumulate (SC105);
* collectives that only some ranks reach (SC301): in rank_branches.py;
* ``DistributedSampler`` objects whose ``set_epoch`` is never called (SC302).
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab

from synccheck.analyzer.project.values import Ext, Framework, Inner, Inst, Loader, Obj, Sampler, Unknown, Wrapper
from synccheck.analyzer.project.traversal import block_nodes, walk

class Unwrapped(NamedTuple):
    module: object
    node: object
    how: str
    wrapper_text: str
    kind: str        # "module" (wrapper.module) | "original"


def no_sync_on_unwrapped(program) -> list:
    values = program.values
    out = []
    wrapping = program.wrapping()
    calls = values.calls("no_sync", load=True) + values.calls("no_backward_sync", load=True) + \
        values.calls("accumulate")
    for scope, call in calls:
        module = values.module_of(scope)
        if not module.linted or not isinstance(call.func, ast.Attribute):
            continue
        receiver = values.expr(call.func.value, scope)
        if call.args:
            if not any(isinstance(v, Framework) for v in receiver):
                continue
            target_node = call.args[0]
        else:
            target_node = call.func.value
        target = values.expr(target_node, scope)
        inner = [v for v in target if isinstance(v, Inner)]
        if inner and _unwrapped_alias(values, scope, target_node):
            # ``raw_model = model.module if ddp else model``: wherever a wrapper exists, the alias is
            # the module inside it (the other side is the run with no wrapper at all)
            out.append(Unwrapped(module, call, _text(module, call), _binding(program, inner[0].wrapper), "module"))
            continue
        if program.wrappers(target):
            continue
        holder = _holds_wrapper(program, scope, target_node) if call.args else None
        if holder is not None:
            # ``model = Denoiser(prepared)``; ``accelerator.accumulate(model)``: the object named holds
            # the wrapper but is not it, so accelerate finds no no_sync on it
            out.append(Unwrapped(module, call, _text(module, call), _binding(program, holder), "outer"))
            continue
        # something we cannot see may be the wrapper, unless what we do see is a module known to
        # have been wrapped elsewhere (``training_models[0]`` holding the module before prepare())
        if any(isinstance(v, Unknown) for v in target) and \
                not any(isinstance(v, (Obj, Inst)) and wrapping.get(v) for v in target):
            continue
        if call.args and _forwards_through(scope, call, target_node):
            # the whole step uses the unprepared object (a sloppy example, not a half-wrapped loop)
            continue
        how = _text(module, call)
        inner = [v for v in target if isinstance(v, Inner)]
        if inner:
            out.append(Unwrapped(module, call, how, _binding(program, inner[0].wrapper), "module"))
            continue
        wrapped = [w for v in target if isinstance(v, (Obj, Inst)) for w in wrapping.get(v, ())]
        if wrapped:
            out.append(Unwrapped(module, call, how, _binding(program, sorted(wrapped, key=repr)[0]), "original"))
    return out


def _unwrapped_alias(values, scope, target) -> bool:
    """Is the name bound, only, to the module inside a wrapper when there is one:
    ``m.module if ddp else m``, ``m if not ddp else m.module``, ``getattr(m, "module", m)``?"""
    if not isinstance(target, ast.Name):
        return False
    bindings = values.info(scope).assigns.get(target.id, ())
    if not bindings:
        return False
    for value, path in bindings:
        if path:
            return False
        if isinstance(value, ast.IfExp):
            sides = (value.body, value.orelse)
            if not any(isinstance(a, ast.Attribute) and a.attr == "module" and ast.dump(a.value) == ast.dump(b)
                       for a, b in (sides, sides[::-1])):
                return False
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr" and \
                len(value.args) == 3 and isinstance(value.args[1], ast.Constant) and value.args[1].value == "module":
            if ast.dump(value.args[0]) != ast.dump(value.args[2]):
                return False
        else:
            return False
    return True


def _holds_wrapper(program, scope, target) -> Optional[Wrapper]:
    """The wrapper a plain object was built around (``model = Denoiser(ddp_model)``,
    ``model = make_wrapper(cfg)(ddp_model)``), when the name is bound only to such calls."""
    if not isinstance(target, ast.Name):
        return None
    values = program.values
    bindings = values.info(scope).assigns.get(target.id, ())
    found = None
    for value, path in bindings:
        if path or not isinstance(value, ast.Call) or _is_wrapping_call(value):
            return None
        held = None
        for arg in list(value.args) + [k.value for k in value.keywords]:
            wrappers = program.wrappers(values.expr(arg, scope))
            if wrappers:
                held = sorted(wrappers, key=repr)[0]
        if held is None:
            return None
        found = held
    return found


def _is_wrapping_call(call: ast.Call) -> bool:
    """A call that returns the wrapper itself (or the model moved, compiled or unwrapped): not an outer
    object."""
    from synccheck.analyzer.project.program import WRAP_CALLS

    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in WRAP_CALLS or name in vocab.SELF_RETURNING or name in ("compile", "unwrap_model")


def _forwards_through(scope, ctx_call, target) -> bool:
    """Does the ``with`` that enters ``ctx_call`` run a forward through ``target`` itself?"""
    tree = getattr(scope, "node", None) or getattr(scope, "tree", None)
    if tree is None:
        return False
    wanted = ast.dump(target)
    for node in walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(i.context_expr is ctx_call for i in node.items):
            return any(isinstance(sub, ast.Call) and ast.dump(sub.func) == wanted
                       for stmt in node.body for sub in walk(stmt))
    return False


def _binding(program, wrapper: Wrapper) -> str:
    """The name a wrapper was bound to where it was made (``ddp_model``), for messages."""
    path, line, col = wrapper.site[:3]
    module = program.project.by_path.get(path) or next((m for m in program.project.modules() if m.path == path), None)
    if module is None:
        return "the wrapper"
    for node in walk(module.tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(node, "value", None) is not None:
            for sub in walk(node.value):
                if isinstance(sub, ast.Call) and sub.lineno == line and sub.col_offset == col:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    target = targets[0]
                    index = wrapper.site[3] if len(wrapper.site) > 3 and isinstance(wrapper.site[3], int) else None
                    if isinstance(target, (ast.Tuple, ast.List)) and index is not None and index < len(target.elts):
                        target = target.elts[index]
                    elif isinstance(target, ast.Name) and index is not None and sub.args and \
                            any(isinstance(a, ast.Starred) for a in sub.args):
                        return f"{target.id}[{index}]"      # prepared = accelerator.prepare(*parts)
                    return ast.unparse(target)
    return "the wrapper"


class UnconfiguredAccumulate(NamedTuple):
    module: object
    node: object
    accelerator_text: str


def accumulate_without_steps(program) -> list:
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
        if not frameworks or any(v.accumulates != "no" or v in configured for v in frameworks):
            continue
        if any(not isinstance(v, Framework) for v in receiver):
            continue
        out.append(UnconfiguredAccumulate(module, call, _text(module, call.func.value)))
    return out


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


# ---------------------------------------------------------------------------------------------------
# SC302

class UnseededSampler(NamedTuple):
    module: object
    node: object
    name: str


# a sampler (or the dataset it samples) named for evaluation: ``val_sampler``, ``DistributedSampler(dataset_test)``
_EVALUATION = re.compile(r"(?i)(?:^|[^a-z])(?:val|valid|validation|eval|evaluation|test|dev)(?:[^a-z]|$)")


def samplers_without_set_epoch(program) -> list:
    values = program.values
    values.project.load_matching("DistributedSampler")
    values.project.load_matching("set_epoch")
    names = {"DistributedSampler"}
    for module in program.project.modules():
        for local, (mod, attr, _) in module.imports.items():
            if attr == "DistributedSampler":
                names.add(local)
    made = []
    for name in sorted(names):
        for scope, call in values.calls(name):
            module = values.module_of(scope)
            for v in values.expr(call, scope):
                if isinstance(v, Sampler) and not v.shuffle_off:
                    made.append((module, call, v, scope))
    if not made:
        return []
    seeded, unknown = set(), False
    for scope, call in values.calls("set_epoch"):
        if not isinstance(call.func, ast.Attribute):
            continue
        receiver = values.expr(call.func.value, scope)
        for v in receiver:
            if isinstance(v, Sampler):
                seeded.add(v)
            elif isinstance(v, (Unknown, Obj, Ext)):
                unknown = True
    if unknown:
        return []
    prepared = _prepared_loaders(program)
    out = []
    epoch_loop = None         # asked once: nothing below parses or reads a file
    for module, call, sampler, scope in made:
        if not module.linted or sampler in seeded or sampler in prepared:
            continue
        if epoch_loop is None:
            epoch_loop = _has_epoch_loop(program)
        if not epoch_loop:
            continue
        name = _assigned_name(module, call)
        if _EVALUATION.search(f"{name} {_text(module, call.args[0]) if call.args else ''}"):
            continue    # an evaluation pass gives the same metrics in any order
        out.append(UnseededSampler(module, call, name))
    return out


def _prepared_loaders(program) -> set:
    """Samplers whose loader goes through ``accelerator.prepare`` (which seeds its own sampler)."""
    values = program.values
    out = set()
    for scope, call in values.calls("prepare"):
        if not isinstance(call.func, ast.Attribute):
            continue
        if not any(isinstance(v, Framework) for v in values.expr(call.func.value, scope)):
            continue
        for arg in call.args:
            for v in values.expr(arg, scope):
                if isinstance(v, Loader):
                    out |= {s for s in values.loader_samplers(v) if isinstance(s, Sampler)}
    return out


_EPOCH_LOOP = re.compile(r"^[ \t]*(?:async[ \t]+)?for[ \t]+[\w, ()]*epoch\w*[\w, ()]*[ \t]+in[ \t]", re.M | re.I)


def _has_epoch_loop(program) -> bool:
    """Does the program loop over epochs? The files parsed so far, and the text of those the
    analysis has not needed to parse (which of them it needed depends on what it followed)."""
    project = program.project
    for apath in list(project.catalog):
        text = project.catalog_text(apath) if apath in project.catalog else None
        if text is not None and _EPOCH_LOOP.search(text):
            return True
    # (loops are statements: the statements of each tree are looked at, not every node)
    for module in program.project.modules():
        for node in block_nodes(module.tree):
            if isinstance(node, (ast.For, ast.While)):
                target = ast.unparse(node.target) if isinstance(node, ast.For) else ""
                if "epoch" in target.lower():
                    return True
                if any(isinstance(n, (ast.For, ast.While)) for b in node.body for n in block_nodes(b)):
                    return True
    return False


def _assigned_name(module, call) -> str:
    for node in walk(module.tree):
        if isinstance(node, ast.Assign) and node.value is call:
            return ast.unparse(node.targets[0])
    return "the sampler"


# ---------------------------------------------------------------------------------------------------
# SC301

def _text(module, node) -> str:
    return (module.segment(node) or ast.unparse(node)).strip()



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
        accumulate = _keyword_argument(call, "accumulate_grad_batches", info)
        if accumulate is None or (isinstance(accumulate, ast.Constant) and accumulate.value in (0, 1, None)):
            continue
        strategy = _keyword_argument(call, "strategy", info)
        for where, node in _static_graph_strategies(program, strategy, scope):
            out.append(LightningStaticGraph(where, node, call))
    return out


def _keyword_argument(call: ast.Call, name: str, info, depth: int = 0):
    """The expression given for keyword ``name``: spelled out, or inside a ``**cfg`` whose dict is
    built in this function (``dict(...)`` or ``{...}``, then ``cfg.update(more)``)."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Name):
            found = _dict_entry(k.value.id, name, info, depth)
            if found is not None:
                return found
    return None


def _dict_entry(var: str, key: str, info, depth: int):
    if depth > 3:
        return None
    sources = [value for value, path in info.assigns.get(var, ()) if not path]
    sources += [c.args[0] for c in info.calls if c.args and isinstance(c.func, ast.Attribute) and
                c.func.attr == "update" and isinstance(c.func.value, ast.Name) and c.func.value.id == var]
    for value in sources:
        if isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values):
                if isinstance(k, ast.Constant) and k.value == key:
                    return v
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            found = _keyword_argument(value, key, info, depth + 1)
            if found is not None:
                return found
        elif isinstance(value, ast.Name):
            found = _dict_entry(value.id, key, info, depth + 1)
            if found is not None:
                return found
    return None


def _static_graph_strategies(program, node, scope, depth: int = 0) -> list:
    """The ``DDPStrategy(..., static_graph=True)`` calls a strategy argument can be: the call itself,
    a name bound to it, or what a project function returns."""
    if node is None or depth > 3:
        return []
    values = program.values
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "DDPStrategy":
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
