"""Stage 5 of the pipeline (values), part 6: what accelerate's ``prepare`` and Fabric's ``setup`` make.

Each argument of ``accelerator.prepare(...)`` becomes what accelerate returns for it: a prepared
optimizer, a loader, a scheduler, or the model wrapped by the Accelerator's backend (DDP, FSDP, or a
DeepSpeed engine when the optimizer is DeepSpeed's ``DummyOptim`` or the script runs under DeepSpeed
only), unless every parameter of the module is frozen (accelerate leaves such a module as it was).
``fabric.setup(model, optimizer)`` makes Fabric's wrapped module and optimizer. ``FrameworkValues`` is
the part of ``values.Values`` that does this.
"""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.value_helpers import _named, called_name
from synccheck.analyzer.project.value_types import ONE_UNKNOWN, Bag, Framework, Loader, Optim, Tup, Wrapper, site_of


class FrameworkValues:
    """What ``prepare`` and ``setup`` return (a part of Values)."""

    def _prepare(self, call, attr: str, scope, module) -> frozenset:
        items = []
        # ``accelerator.prepare(model, DummyOptim(...))``: a placeholder for the optimizer a DeepSpeed
        # config makes, so this Accelerator runs DeepSpeed; its engine decides the accumulation
        # boundary and reduces the gradients there (gpt4all's train.py)
        kind = "deepspeed" if any(self._dummy_optimizer(arg, call, scope) for arg in call.args) or \
            _deepspeed_only(scope) or self._plugged_deepspeed(call.func, scope) or \
            launched_with_deepspeed(scope) else "accelerate"
        for i, arg in enumerate(self._spread_args(call, scope)):
            values = self.expr(arg, scope)
            source = _comprehension_source(arg, scope)
            if source is not None:
                # ``[accelerator.prepare(o) for o in optimizers]``: each element is what the list held
                arg = source
                values = frozenset(x for v in self.expr(source, scope) if isinstance(v, Bag) for x in v.items) or values
            site = site_of(module, call, i)
            if attr == "prepare_optimizer" or any(isinstance(v, Optim) for v in values) or \
                    _named(arg, ("optim", "opt")):
                self.sites[site] = self.sites.get(next((v.site for v in values if isinstance(v, Optim)), None),
                                                  (None, scope))
                items.append(frozenset((Optim(site, True),)))
            elif attr in ("prepare_data_loader",) or any(isinstance(v, Loader) for v in values) or \
                    _named(arg, ("loader", "dataloader", "data")):
                items.append(frozenset(v for v in values if isinstance(v, Loader)) or ONE_UNKNOWN)
            elif attr == "prepare_scheduler" or _named(arg, ("sched",)):
                items.append(ONE_UNKNOWN)
            else:
                self.sites[site] = (arg, scope)
                # accelerate wraps only a module with a trainable parameter: a frozen one (a teacher,
                # a fixed head) is returned as it was, with no gradient to all-reduce
                items.append(frozenset((Wrapper(kind, site, single=_frozen(arg, scope)),)))
        if len(items) == 1:
            return items[0]
        return frozenset((Tup(tuple(items)),))

    def _plugged_deepspeed(self, func, scope) -> bool:
        """``accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``: this Accelerator runs
        DeepSpeed, whose engine steps and zeroes at its own boundary (the prepared optimizer's
        ``step`` and ``zero_grad`` do nothing)."""
        receiver = func.value if isinstance(func, ast.Attribute) else None
        if not isinstance(receiver, ast.Name):
            return False
        for value, _ in self.bound_expressions(receiver.id, scope):
            if isinstance(value, ast.Call) and _plugs_deepspeed(value):
                return True
        # (built by a helper of another file: ``accelerator = make_accelerator(args)``)
        for v in self.expr(receiver, scope):
            if isinstance(v, Framework) and v.kind == "accelerate":
                built = call_at(self.project, v.site)
                if built is not None and _plugs_deepspeed(built):
                    return True
        return False

    def _dummy_optimizer(self, arg, prepare, scope) -> bool:
        """Is ``arg`` accelerate's ``DummyOptim(...)``, or a name bound only to one (and to what
        ``prepare`` returns)?"""
        made = [arg] if not isinstance(arg, ast.Name) else [
            v for v, _ in self.bound_expressions(arg.id, scope) if v is not prepare]
        return bool(made) and all(isinstance(v, ast.Call) and called_name(v) in ("DummyOptim", "DummyScheduler")
                                  for v in made)

    def _spread_args(self, call, scope) -> list:
        """The positional arguments, with ``*parts`` replaced by the elements of the list literal
        ``parts`` was bound to (``components = [self.model, self.optimizer]``; what is appended
        later comes after them)."""
        out = []
        for arg in call.args:
            if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
                bound = self.info(scope).assigns.get(arg.value.id, ())
                literals = [v for v, path in bound if not path and isinstance(v, (ast.List, ast.Tuple))]
                if len(bound) == 1 and literals and not any(isinstance(e, ast.Starred) for e in literals[0].elts):
                    out.extend(literals[0].elts)
                    continue
            out.append(arg)
        return out

    def _fabric_setup(self, call, attr: str, receiver, scope, module) -> frozenset:
        single = any(isinstance(v, Framework) and v.single for v in receiver)
        sharded = any(isinstance(v, Framework) and v.sharded for v in receiver)
        items = []
        for i, arg in enumerate(call.args):
            site = site_of(module, call, i)
            if attr == "setup_optimizers" or (attr == "setup" and i > 0):
                self.sites[site] = (None, scope)
                items.append(frozenset((Optim(site),)))
            else:
                self.sites[site] = (arg, scope)
                items.append(frozenset((Wrapper("fabric", site, single=single, sharded=sharded),)))
        return items[0] if len(items) == 1 else frozenset((Tup(tuple(items)),))


def _reads_the_plugin(stmt) -> bool:
    """``accelerator.state.deepspeed_plugin.deepspeed_config["train_batch_size"] = ...`` as a statement of
    the function's own body: the plugin is None without DeepSpeed, and this would raise (HuatuoGPT-II)."""
    if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
        return False
    todo = [stmt]
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.IfExp, ast.BoolOp, ast.Lambda)):
            continue        # (``plugin.config if plugin is not None else {}``: read only where it exists)
        if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.value, ast.Attribute) and \
                n.value.attr == "deepspeed_plugin":
            return True
        todo.extend(ast.iter_child_nodes(n))
    return False


def reads_the_plugin(scope) -> bool:
    """Does a statement of the function's own body read the DeepSpeed plugin (_reads_the_plugin)?"""
    return isinstance(scope, Function) and any(_reads_the_plugin(stmt) for stmt in scope.node.body)


def launched_with_deepspeed(scope) -> bool:
    """Are the accelerate launch configurations the project ships all DeepSpeed's (launch_configs.py)?"""
    from synccheck.analyzer.project.launch_configs import ships_only_deepspeed
    module = scope.module if isinstance(scope, Function) else scope
    return ships_only_deepspeed(getattr(module, "path", None))


def deepspeed_gives_the_micro_steps(scope) -> bool:
    """Does a DeepSpeed launch configuration the project ships give the number of micro-steps (not
    ``"auto"``, which leaves it to ``Accelerator(gradient_accumulation_steps=...)``)?"""
    from synccheck.analyzer.project.launch_configs import deepspeed_leaves_accumulation_to_accelerate
    module = scope.module if isinstance(scope, Function) else scope
    return not deepspeed_leaves_accumulation_to_accelerate(getattr(module, "path", None))


def _deepspeed_only(scope) -> bool:
    """Does the scope bind a name only where DeepSpeed runs (``if accelerator.state.deepspeed_plugin is
    not None: gradient_accumulation_steps = ...deepspeed_config["gradient_accumulation_steps"]``) and
    use it elsewhere? Without DeepSpeed the script would stop at a NameError: it runs under DeepSpeed
    only (gpt4all's train.py), whose engine reduces gradients at its own boundary."""
    if not isinstance(scope, Function) or "deepspeed_plugin" not in scope.module.segment(scope.node):
        return False
    if reads_the_plugin(scope):
        return True
    only, elsewhere, inside = set(), set(scope.params), set()
    for node in walk_no_defs(scope.node):
        if isinstance(node, ast.If) and "deepspeed_plugin" in ast.unparse(node.test) and \
                "is not None" in ast.unparse(node.test) and not node.orelse:
            for stmt in node.body:
                inside.add(id(stmt))
                if isinstance(stmt, ast.Assign):
                    only.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    if not only:
        return False
    for node in walk_no_defs(scope.node):
        if id(node) in inside:
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                elsewhere.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    used = {n.id for n in walk_no_defs(scope.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return bool((only - elsewhere - set(scope.module.globals)) & used)


def _frozen(arg, scope) -> bool:
    """Does the scope that prepares ``arg`` (a name) freeze every parameter of it first, in a statement
    of its own body (``for p in head.parameters(): p.requires_grad = False``, ``head.requires_grad_(False)``),
    with nothing after that which may give it a trainable parameter again (an unfreezing anywhere in the
    scope, a rebinding, an adapter added: any use but ``eval()`` / ``to()``)?"""
    if not isinstance(arg, ast.Name):
        return False
    name = arg.id
    body = scope.node.body if isinstance(scope, Function) else scope.tree.body
    for stmt in body:
        for node in walk_no_defs(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "requires_grad_" \
                    and not (node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False):
                return False                # (something is unfrozen)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "requires_grad"
                                                    for t in node.targets) and \
                    not (isinstance(node.value, ast.Constant) and node.value.value is False):
                return False
    frozen = False
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue                            # (a function's body runs later)
        if _freezes(stmt, name):
            frozen = True
        elif frozen and _prepares(stmt, name):
            return True                         # what runs after the prepare does not matter here
        elif frozen and not _harmless_use(stmt, name):
            return False
    return frozen


def _prepares(stmt, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
               n.func.attr in ("prepare", "prepare_model") and
               any(isinstance(a, ast.Name) and a.id == name for a in n.args) for n in walk_no_defs(stmt))


def _freezes(stmt, name: str) -> bool:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
            and stmt.value.func.attr == "requires_grad_" and isinstance(stmt.value.func.value, ast.Name) and \
            stmt.value.func.value.id == name:
        return True
    return isinstance(stmt, (ast.For, ast.AsyncFor)) and isinstance(stmt.iter, ast.Call) and \
        isinstance(stmt.iter.func, ast.Attribute) and stmt.iter.func.attr == "parameters" and \
        isinstance(stmt.iter.func.value, ast.Name) and stmt.iter.func.value.id == name and \
        isinstance(stmt.target, ast.Name) and any(
            isinstance(t, ast.Attribute) and t.attr == "requires_grad" and isinstance(t.value, ast.Name) and
            t.value.id == stmt.target.id for b in stmt.body if isinstance(b, ast.Assign) for t in b.targets)


_HARMLESS_METHODS = ("eval", "to", "cuda", "half", "float", "bfloat16", "requires_grad_")


def _harmless_use(stmt, name: str) -> bool:
    """Is every use of ``name`` in ``stmt`` a call of one of its harmless methods (``head.eval()``), or a
    rebinding by a ``prepare`` of something else? (A statement that prepares ``name`` itself ends
    _frozen's walk before this is asked.)"""
    allowed = {id(node.func.value) for node in walk_no_defs(stmt)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
               node.func.attr in _HARMLESS_METHODS and isinstance(node.func.value, ast.Name)}
    # kohya's LoRA network (``lora.create_network(..., unet)``, ``network.apply_to(text_encoder, unet)``)
    # keeps the adapter's parameters in the network object and hooks the frozen module's forward: the
    # module gains no trainable parameter
    allowed |= {id(a) for node in walk_no_defs(stmt)
                if isinstance(node, ast.Call) and _ADAPTER_HOLDER.fullmatch(called_name(node))
                for a in list(node.args) + [k.value for k in node.keywords] if isinstance(a, ast.Name)}
    prepared = isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
        isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr in ("prepare", "prepare_model")
    return all(id(n) in allowed or (prepared and isinstance(n.ctx, ast.Store))
               for n in walk_no_defs(stmt) if isinstance(n, ast.Name) and n.id == name)


_ADAPTER_HOLDER = re.compile(r"create_network(?:_from_weights)?|apply_to")


def _comprehension_source(arg, scope):
    """The iterable of the comprehension of ``scope`` whose variable is ``arg`` (a name), or None."""
    if not isinstance(arg, ast.Name) or not isinstance(scope, Function):
        return None
    for node in scope.nodes():
        if isinstance(node, ast.comprehension) and isinstance(node.target, ast.Name) and \
                node.target.id == arg.id and isinstance(node.iter, (ast.Name, ast.Attribute)):
            return node.iter
    return None


def _plugs_deepspeed(call) -> bool:
    """``Accelerator(deepspeed_plugin=...)`` with a plugin (not None)."""
    return any(kw.arg == "deepspeed_plugin" and not (isinstance(kw.value, ast.Constant) and kw.value.value is None)
               for kw in call.keywords)


def call_at(project, site):
    """The call at a value's site ``(path, line, column, ...)``, if its module is parsed."""
    module = project.module_at(site[0]) if site and len(site) >= 3 else None
    return module.call_at(site[1], site[2]) if module is not None else None
