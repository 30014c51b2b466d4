"""Facts that need the project's values but not the sync dataflow, part 2: sync controls called on
something that is not the data-parallel wrapper (SC104) -- the module inside it (``model.module``, an
alias that is that module whenever there is a wrapper), the module it was built from, or an object
built around it.
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import enclosing_function
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.value_helpers import a_sequence, views_of_the_inner_module
from synccheck.analyzer.project.values import Framework, Inner, Inst, Obj, Unknown, Wrapper


class Unwrapped(NamedTuple):
    module: object
    node: object
    how: str
    wrapper_text: str
    kind: str        # "module" (wrapper.module) | "original"


_WRAPPER_TYPE = re.compile(r"DistributedDataParallel|\bDDP\b|FullyShardedDataParallel|\bFSDP\b")


def _tested_for_a_wrapper(scope, call, target_node) -> bool:
    """Is ``call`` on the side of an ``if`` that holds only where ``target_node`` is a wrapper:
    ``isinstance(x, DistributedDataParallel)``, ``hasattr(x, "no_sync")``? Whatever else ``x`` may
    be on other runs, here it is the wrapper."""
    node = getattr(scope, "node", None)
    if node is None:
        return False
    text = ast.unparse(target_node)
    for n in ast.walk(node):
        if not isinstance(n, ast.If) or not any(s.lineno <= call.lineno <= (s.end_lineno or s.lineno) for s in n.body):
            continue
        for test in ([n.test] + list(n.test.values) if isinstance(n.test, ast.BoolOp) and
                     isinstance(n.test.op, ast.And) else [n.test]):
            if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and len(test.args) == 2 and \
                    ast.unparse(test.args[0]) == text and (
                        test.func.id == "isinstance" and _WRAPPER_TYPE.search(ast.unparse(test.args[1])) or
                        test.func.id == "hasattr" and isinstance(test.args[1], ast.Constant) and
                        test.args[1].value == "no_sync"):
                return True
    return False


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
            if call.func.attr == "accumulate" and len(call.args) == 1 and a_sequence(values, scope, target_node) and \
                    not all(v.accumulates == "no" for v in receiver if isinstance(v, Framework)) and \
                    not _under_deepspeed(program, receiver, values.expr(target_node, scope)):
                # ``accelerator.accumulate([model, loss_module])``: accelerate calls no_sync() on the list
                out.append(Unwrapped(module, call, _text(module, call), ast.unparse(target_node), "list"))
                continue
        else:
            target_node = call.func.value
        if _tested_for_a_wrapper(scope, call, target_node):
            continue        # ``if isinstance(self.netG, DistributedDataParallel): with self.netG.no_sync():``
        target = values.expr(target_node, scope)
        inner = [v for v in target if isinstance(v, Inner)]
        if inner and _unwrapped_alias(values, scope, target_node):
            # ``raw_model = model.module if ddp else model``: wherever a wrapper exists, the alias is
            # the module inside it (the other side is the run with no wrapper at all)
            out.append(Unwrapped(module, call, _text(module, call), _binding(program, inner[0].wrapper), "module"))
            continue
        if program.wrappers(target):
            continue
        if inner and isinstance(target_node, ast.Attribute) and target_node.attr == "module":
            # ``model.module.no_sync()`` on a model wrapped only ``if RANK != -1:``: where there is a
            # wrapper this is the module inside it (and where there is none, ``.module`` fails)
            out.append(Unwrapped(module, call, _text(module, call), _binding(program, inner[0].wrapper), "module"))
            continue
        container = None
        if call.args:
            # (each model named: ``accumulate(unet, text_encoder)``, or a tuple of them, GenzIVQA's
            # ``accumulate((coop_model, unet))``)
            named = call.args[0].elts if isinstance(call.args[0], (ast.Tuple, ast.List)) else call.args
            container = next((c for c in (_in_a_prepared_container(program, n, scope) for n in named) if c), None)
        if container is not None:
            # ``trainable_layers = ModuleList([pipeline.unet])`` prepared, then
            # ``accelerator.accumulate(pipeline.unet)``: the module inside the prepared container is not
            # the wrapper (ddpo-pytorch before "Fix gradient sync for lora")
            out.append(Unwrapped(module, call, _text(module, call), _binding(program, container), "module"))
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
        found = _not_the_wrapper(program, module, call, target)
        if found is not None:
            out.append(found)
    # ``ctx = nullcontext if boundary else self.model.no_sync``: the method taken, called later
    for module, scope, node in _uncalled_no_sync(program):
        target = values.expr(node.value, scope)
        if program.wrappers(target) or any(isinstance(v, Unknown) for v in target) and \
                not any(isinstance(v, (Obj, Inst)) and wrapping.get(v) for v in target):
            continue
        found = _not_the_wrapper(program, module, node, target)
        if found is not None:
            out.append(found)
    return out


def _not_the_wrapper(program, module, node, target) -> Optional[Unwrapped]:
    """SC104's finding at ``node`` when ``target`` (what the control names) is the module inside a
    wrapper or the module a wrapper was built from."""
    how = _text(module, node)
    inner = [v for v in target if isinstance(v, Inner)]
    if inner:
        return Unwrapped(module, node, how, _binding(program, inner[0].wrapper), "module")
    wrapped = [w for v in target if isinstance(v, (Obj, Inst)) for w in program.wrapping().get(v, ())]
    if wrapped:
        return Unwrapped(module, node, how, _binding(program, sorted(wrapped, key=repr)[0]), "original")
    return None


def _uncalled_no_sync(program) -> list:
    """(module, scope, attribute) for each ``x.no_sync`` of a linted module that is not called where
    it is written (a callable kept for a ``with ctx():`` later)."""
    out = []
    for module in program.project.linted():
        if ".no_sync" not in module.text:
            continue
        called = {id(n.func) for n in walk(module.tree) if isinstance(n, ast.Call)}
        for node in walk(module.tree):
            if isinstance(node, ast.Attribute) and node.attr == "no_sync" and isinstance(node.ctx, ast.Load) and \
                    id(node) not in called:
                out.append((module, enclosing_function(module, node) or module, node))
    return out


def _unwrapped_alias(values, scope, target) -> bool:
    """Is the name bound, only, to the module inside a wrapper when there is one:
    ``m.module if ddp else m``, ``m if not ddp else m.module``, ``getattr(m, "module", m)``?"""
    if not isinstance(target, ast.Name):
        return False
    bindings = values.info(scope).assigns.get(target.id, ())
    if not bindings or any(path for _, path in bindings):
        return False
    if len(bindings) == 2 and views_of_the_inner_module(bindings[0][0], bindings[1][0]):
        # ``if args.distributed: d_module = discriminator.module`` / ``else: d_module = discriminator``
        return True
    for value, path in bindings:
        if isinstance(value, ast.IfExp):
            if not views_of_the_inner_module(value.body, value.orelse):
                return False
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr" and \
                len(value.args) == 3 and isinstance(value.args[1], ast.Constant) and value.args[1].value == "module":
            if ast.dump(value.args[0]) != ast.dump(value.args[2]):
                return False
        else:
            return False
    return True


def _under_deepspeed(program, receiver, named) -> bool:
    """Does the accelerator run DeepSpeed, whose engine reduces the gradients at its own boundary
    (accelerate's no_sync does nothing there)? Its models are DeepSpeed engines, or the function that
    builds it reads the DeepSpeed plugin, or every launch configuration the project ships is
    DeepSpeed's."""
    from synccheck.analyzer.project.value_frameworks import call_at, launched_with_deepspeed, reads_the_plugin

    if any(w.kind == "deepspeed" for w in program.wrappers(named)):
        return True
    for framework in receiver:
        site = framework.site if isinstance(framework, Framework) else None
        made = call_at(program.project, site)
        if made is None:
            continue
        module = program.project.module_at(site[0])
        scope = enclosing_function(module, made)
        if reads_the_plugin(scope) or launched_with_deepspeed(scope or module):
            return True
    return False


def _in_a_prepared_container(program, target, scope=None) -> Optional[Wrapper]:
    """The wrapper built around a container made of the module ``target`` names (``ModuleList([x])``,
    ``AttnProcsLayers(x.attn_processors)``), when ``target`` is an attribute chain (``pipeline.unet``),
    or a plain name with the container made in the same function (``lora_layers =
    AttnProcsLayers(unet.attn_processors)`` beside ``accelerator.accumulate(unet)``)."""
    if isinstance(target, ast.Name):
        if scope is None or not hasattr(scope, "node"):
            return None
    elif not isinstance(target, ast.Attribute):
        return None
    text = ast.unparse(target)
    for inner, wrappers in program.wrapping().items():
        for module, made in _made_at(program, inner, scope if isinstance(target, ast.Name) else None):
            if isinstance(target, ast.Name) and not (module is scope.module and
                                                     scope.node.lineno <= made.lineno <= scope.node.end_lineno):
                continue
            for arg in list(made.args) + [k.value for k in made.keywords]:
                if any(isinstance(n, ast.Attribute) and (ast.unparse(n) == text or ast.unparse(n.value) == text)
                       for n in walk(arg)):
                    return sorted(wrappers, key=repr)[0]
    return None


def _made_at(program, inner, scope) -> list:
    """(module, call) where a value that was later wrapped was made, with arguments: its own site for
    an object of an outside class; for an instance of a project class (a repository's own copy of
    diffusers' ``AttnProcsLayers``), the calls of that class in ``scope``."""
    site = getattr(inner, "site", None)
    if isinstance(inner, Obj) and site and len(site) >= 3 and isinstance(site[1], int):
        module = program.project.module_at(site[0])
        made = module.call_at(site[1], site[2]) if module is not None else None
        return [(module, made)] if made is not None and made.args else []
    if isinstance(inner, Inst) and scope is not None and hasattr(scope, "node"):
        name = inner.cls.node.name
        return [(scope.module, n) for n in walk(scope.node) if isinstance(n, ast.Call) and n.args and
                (isinstance(n.func, ast.Name) and n.func.id == name or
                 isinstance(n.func, ast.Attribute) and n.func.attr == name)]
    return []


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
            held = _stored_wrapper(program, scope, target.id)
        if held is None:
            return None
        found = held
    return found


def _stored_wrapper(program, scope, name: str):
    """The wrapper stored as an attribute or item of a fresh object after it is made (``model =
    torch.nn.Module(); model.unet = unet; model.projector = projector`` with both prepared): the
    object holds the wrappers but is none of them."""
    node = getattr(scope, "node", None)
    if node is None:
        return None
    for stmt in walk(node):
        if not isinstance(stmt, ast.Assign):
            continue
        for t in stmt.targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.value, ast.Name) and t.value.id == name:
                wrappers = program.wrappers(program.values.expr(stmt.value, scope))
                if wrappers:
                    return sorted(wrappers, key=repr)[0]
    return None


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
    module = program.project.module_at(path)
    if module is None:
        return "the wrapper"
    for node in walk(module.tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(node, "value", None) is not None:
            for sub in walk(node.value):
                if isinstance(sub, ast.Call) and sub.lineno == line and sub.col_offset == col:
                    if sub is not node.value and not isinstance(node.value, (ast.Call, ast.IfExp, ast.Await)):
                        return "the wrapper"        # made inside a registry's lambda, a list, a dict
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


def _text(module, node) -> str:
    return (module.segment(node) or ast.unparse(node)).strip()
