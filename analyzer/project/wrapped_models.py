"""The wrapped models of a program (a part of Program): which values are data-parallel wrappers.

Beyond the wrappers the values make (``DDP(model)``, ``accelerator.prepare(model)``), an object's use
can say it is one (``x.no_sync()`` is DDP's, ``x.set_requires_gradient_sync(...)`` FSDP2's, the model
``accelerator.accumulate(...)`` names on a parameter is a prepared one); ``fully_shard(model)`` makes
the module itself the FSDP2 module; and an optimizer's models are the wrappers of what it owns.
"""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import Function, ModuleRef, enclosing_function
from synccheck.analyzer.project.traversal import children, walk, walk_no_defs
from synccheck.analyzer.project.values import Framework, Inner, Inst, LocalSGD, Obj, Wrapper

_UNCALLED_NO_SYNC = re.compile(r"\.no_sync\b(?!\s*\()")
_CALLED_OR_INDEXED = re.compile(r"\b([A-Za-z_]\w*)\s*[(\[]")
# the calls that wrap a model in place (its own module becomes the FSDP2 / composable-DDP module)
_IN_PLACE = ("fully_shard", "replicate")
# a training file that builds its wrapper itself needs no helper's in-place wrapping
_WRAPS_ITSELF = re.compile(r"DistributedDataParallel|FullyShardedDataParallel|\bfully_shard\b|\breplicate\(|"
                           r"\.prepare\(|\.setup\(|\.initialize\(|\bDDP\(|\bFSDP\(")


# a function that sets a model up once, before training (its broadcast of the weights is DDP's own)
_SETS_UP = re.compile(r"init|setup|set_up|build|load|create|prepare|construct", re.I)


class WrappedModels:
    """What Program knows of the data-parallel models (a part of Program)."""

    def wrappers(self, vals) -> frozenset:
        """The data-parallel models among these values (DDP inferred from ``x.no_sync()`` use too)."""
        out = set()
        inferred = None
        for v in vals:
            if isinstance(v, Wrapper):
                out.add(v)
            elif isinstance(v, Inst):
                # ``model = Net(); fully_shard(model)``: in place, on an instance of a project class
                out.update(w for w in self.wrapping().get(v, ()) if w.kind == "fsdp2")
            elif isinstance(v, Obj):
                if inferred is None:
                    inferred = self.inferred()
                kind = inferred.get(v.site)
                if kind:
                    out.add(Wrapper(kind, v.site))
                # fully_shard(model) makes model itself the FSDP2 module, even inside a helper
                out.update(w for w in self.wrapping().get(v, ()) if w.kind == "fsdp2")
        return frozenset(out)

    def inferred(self) -> dict:
        """Objects we cannot trace to a wrapper but whose use says they are one: ``x.no_sync()``,
        ``x.require_backward_grad_sync = ...`` (DDP), ``x.set_requires_gradient_sync(...)`` (FSDP2)."""
        if self._inferred is None:
            self._inferred = {}
            wrapped = self.wrapping()
            for name, kind in (("no_sync", "ddp"), ("set_requires_gradient_sync", "fsdp2")):
                for scope, call in self.values.calls(name, load=True):
                    if name == "no_sync" and call.args:
                        continue
                    if isinstance(call.func, ast.Attribute):
                        self._infer_from(self.values.expr(call.func.value, scope), kind, wrapped)
            # ``with accelerator.accumulate(self.policy):`` on a parameter: a model the caller
            # prepared (a module made here and never prepared is SC104's case, not this)
            for scope, call in self.values.calls("accumulate"):
                if call.args and isinstance(call.func, ast.Attribute) and any(
                        isinstance(v, Framework) and v.kind == "accelerate"
                        for v in self.values.expr(call.func.value, scope)):
                    model = self.values.expr(call.args[0], scope)
                    here = scope.module.segment(scope.node) if isinstance(scope, Function) else scope.text
                    if "prepare(" not in here and all(isinstance(v, Obj) and len(v.site) == 4 for v in model):
                        self._infer_from(model, "accelerate", wrapped)
            for module in self.project.modules():
                if _UNCALLED_NO_SYNC.search(module.text):
                    # ``ctx = model.no_sync if ... else nullcontext``: the method itself, called later
                    self._infer_uncalled(module, wrapped)
                if "require_backward_grad_sync" not in module.text:
                    continue
                for scope in [module] + list(module.functions.values()):
                    info = self.values.info(scope)
                    for receiver, attr, _, _ in info.obj_attrs:
                        if attr == "require_backward_grad_sync":
                            self._infer_from(self.values.expr(receiver, scope), "ddp", wrapped)
        return self._inferred

    def _infer_uncalled(self, module, wrapped: dict) -> None:
        called = {id(n.func) for n in walk(module.tree) if isinstance(n, ast.Call)}
        scopes = [(fn.node, fn) for fn in module.functions.values()] + [(module.tree, module)]
        for node, scope in scopes:
            for n in walk_no_defs(node) if scope is not module else children(node):
                if isinstance(n, ast.Attribute) and n.attr == "no_sync" and id(n) not in called:
                    self._infer_from(self.values.expr(n.value, scope), "ddp", wrapped)

    def _infer_from(self, vals, kind: str, wrapped: dict) -> None:
        if any(isinstance(v, (Wrapper, Inner, Framework)) for v in vals):
            return          # (``accelerator.no_sync``: the framework's own context, not a DDP model)
        for v in vals:
            if isinstance(v, Obj) and v not in wrapped:
                self._inferred.setdefault(v.site, kind)

    def wrapping(self) -> dict:
        """Obj -> the wrappers built around it (``ddp = DDP(model)``: model's object -> ddp)."""
        if self._wrapping is None:
            self._wrapping = {}
            names = {"DistributedDataParallel", "FullyShardedDataParallel", *_IN_PLACE, "prepare",
                     "prepare_model", "setup", "setup_module", "initialize"}
            in_place = set(_IN_PLACE)
            self._load_wrapping_helpers()
            for module in self.project.modules():
                for local, (mod, attr, _) in module.imports.items():
                    if attr in ("DistributedDataParallel", "FullyShardedDataParallel", *_IN_PLACE):
                        names.add(local)
                        if attr in in_place:
                            in_place.add(local)
            for name in sorted(names):
                # fully_shard (and composable replicate) work in place, often inside a helper of another
                # file: look there too
                for scope, call in self.values.calls(name, load=name in in_place):
                    for v in self.values.expr(call, scope):
                        for w in _wrappers_in(v):
                            for inner in self.values.wrapped_by(w):
                                # (an instance of a project class is known by its class: ``Net()``)
                                if isinstance(inner, (Obj, Inst)):
                                    self._wrapping.setdefault(inner, set()).add(w)
        return self._wrapping

    def _load_wrapping_helpers(self) -> None:
        """Parse the project modules a training file that builds no wrapper itself calls into (or indexes,
        a registry), and the modules those use: two imports deep. One may shard or replicate the model
        in place (``parallelize_llama(model, mesh)``, ``PARALLELIZE[name](model, mesh)``) from a file a
        lint of one file does not name, and the wrapping they do is seen only in the modules parsed. (A
        lint of folders has their files in its set already: ``wrapping`` parses those that shard in
        place.)"""
        if not self.project.single_files:
            return
        frontier = [m for m in self.project.modules() if (m.linted or m.context) and "backward(" in m.text
                    and not _WRAPS_ITSELF.search(m.text)]
        seen = {m.path for m in frontier}
        for depth in range(2):
            following = []
            for module in frontier:
                # a helper the module calls (or indexes, a registry); deeper, any name it uses
                called = set(_CALLED_OR_INDEXED.findall(module.text)) if depth == 0 else None
                for local in module.imports:
                    if not (local in called if called is not None else module.text.count(local) > 1):
                        continue
                    sym = self.project.resolve(module, local)
                    target = getattr(sym, "module", None)
                    if isinstance(sym, ModuleRef) or target is None or target.path in seen:
                        continue
                    seen.add(target.path)
                    following.append(target)
            frontier = following

    def models_of(self, owners) -> frozenset:
        """The wrapper keys of an optimizer's owners (a wrapper, its ``.module``, what it wraps)."""
        out = set()
        wrapping = None
        for v in owners:
            if isinstance(v, Wrapper):
                out.add(v)
            elif isinstance(v, Inner):
                out.add(v.wrapper)
            elif isinstance(v, (Obj, Inst)):
                # (an instance of a project class is known by its class: ``learner = PrefixToken(4)``)
                if wrapping is None:
                    wrapping = self.wrapping()
                out |= wrapping.get(v, set())
                out |= self.wrappers((v,))
                if isinstance(v, Inst):
                    out |= self._holding(v, wrapping)
        return frozenset(out)

    def _holding(self, inst, wrapping) -> set:
        """The wrappers built around an instance of a project class that keeps ``inst`` in an attribute
        set in its ``__init__``, prepared by accelerate (lightweight_gan's ``D_aug = AugWrapper(D)`` prepared
        beside ``D``: the discriminator's optimizer steps the parameters both wrappers hold)."""
        out = set()
        for holder, wrappers in wrapping.items():
            # (accelerate's prepared modules only: a script prepares a few; a library's tests wrap hundreds)
            if not isinstance(holder, Inst) or holder == inst or \
                    not any(getattr(w, "kind", "") == "accelerate" for w in wrappers):
                continue
            init = holder.cls.methods.get("__init__")
            if init is None:
                continue
            for attr in self.values.info(init).self_attrs:
                if inst in self.values.instance_attribute(holder, attr):
                    out |= wrappers
                    break
        return out

    def managed_models(self) -> frozenset:
        """Models under LocalSGD / a model averager: their gradient sync is off by design."""
        if self._managed is None:
            out = set()
            for name in vocab.LOCAL_SGD:
                for scope, call in self.values.calls(name, load=True):
                    for v in self.values.expr(call, scope):
                        if isinstance(v, LocalSGD):
                            out |= self.wrappers(self.values.context_models(v))
            # ``averager.average_parameters(model.parameters())`` (an averager made without the model),
            # ``model_averaging.utils.average_parameters(model.parameters(), group)``
            for scope, call in self.values.calls("average_parameters"):
                if call.args:
                    out |= self.wrappers(self._parameters_owner(call.args[0], scope))
            # by hand: ``for p in model.parameters(): dist.all_reduce(p.data)`` (every K steps: local SGD;
            # on the gradients before each step: the sync DDP would have done)
            for name in ("all_reduce", "all_reduce_coalesced", "broadcast"):
                for scope, call in self.values.calls(name):
                    if name == "broadcast" and _SETS_UP.search(getattr(getattr(scope, "node", None), "name", "")):
                        continue    # (rank 0's initial weights sent to all in ``initialize_model``: not an averaging)
                    owner = self._loop_over_parameters(scope, call)
                    if owner is not None:
                        # (``model.module.parameters()`` too: the wrapper's parameters)
                        owners = self.values.expr(owner, scope)
                        # (a model a sibling script shards in place is not the one averaged here)
                        here = self.values.module_of(scope)
                        out |= {w for w in self.wrappers(owners) | self.models_of(owners)
                                if not _in_place_elsewhere(self.project, w, here) and _same_script(self.project, w, here)}
            self._managed = frozenset(out)
        return self._managed

    def frozen_models(self) -> frozenset:
        """Wrapped models whose every parameter is frozen (DINO's teacher, wrapped in DDP only so that
        its SyncBatchNorm runs, then ``for p in teacher.parameters(): p.requires_grad = False`` and moved
        by an EMA): no gradient, so nothing to all-reduce. Not where the same file turns any gradient
        back on (``requires_grad = True``: a frozen backbone whose head trains)."""
        if self._frozen is None:
            out = set()
            for module in self.project.modules():
                text = module.text
                if "requires_grad" not in text or not _WRAPS.search(text) or _UNFREEZES.search(text):
                    continue        # (a wrapper frozen itself is frozen where it is wrapped, or beside it)
                for node in ast.walk(module.tree):
                    owner = None
                    if isinstance(node, ast.For) and _parameters_call(node.iter) and len(node.body) == 1 and \
                            _freezes(node.body[0], node.target):
                        owner = node.iter.func.value
                    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                            node.func.attr == "requires_grad_" and node.args and \
                            isinstance(node.args[0], ast.Constant) and node.args[0].value is False:
                        owner = node.func.value
                    if owner is None or _copied(owner, module.text):
                        continue
                    scope = enclosing_function(module, node) or module
                    # (the wrapper itself only: a module is known by where it was made, and the model
                    # that trains may come from the same factory as the frozen reference,
                    # ``ref_model, _ = init_model(...)`` beside ``model, _ = init_model(...)``)
                    out |= {v for v in self.values.expr(owner, scope) if isinstance(v, Wrapper)}
            self._frozen = frozenset(out)
        return self._frozen

    def _parameters_owner(self, expr, scope) -> frozenset:
        """The values whose parameters ``expr`` is (``model.parameters()``), else what ``expr`` holds."""
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and \
                expr.func.attr in ("parameters", "named_parameters"):
            return self.values.expr(expr.func.value, scope)
        return self.values.expr(expr, scope)

    def _loop_over_parameters(self, scope, call):
        """``model`` when ``call`` (a collective) is in ``for p in model.parameters():`` and is handed
        the loop's parameter (``p``, ``p.data``, ``p.grad``); None otherwise."""
        if not call.args or not isinstance(scope, Function):
            return None
        loops = self._parameter_loops.get(scope.uid)
        if loops is None:
            loops = self._parameter_loops[scope.uid] = []
            if "parameters(" in scope.module.segment(scope.node):
                for loop in walk_no_defs(scope.node):
                    it = loop.iter if isinstance(loop, ast.For) else None
                    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip":
                        # ``for p, p0 in zip(model.parameters(), outer_params):`` (DiLoCo's outer step
                        # all-reduces the pseudo-gradient ``p0.grad = p0.data - p.data``)
                        it = next((a for a in it.args if _parameters_call(a)), None)
                    if _parameters_call(it):
                        names = {n.id for n in walk(loop.target) if isinstance(n, ast.Name)}
                        loops.append(({id(n) for n in walk(loop)}, names, it.func.value))
        for inside, names, owner in loops:
            if id(call) in inside and any(isinstance(n, ast.Name) and n.id in names for n in walk(call.args[0])):
                return owner
        return None


def _copied(owner, text: str) -> bool:
    """Is the frozen thing made as a copy in the file that freezes it (``self.shadow =
    copy.deepcopy(module)``, an EMA)? A copy is known by what it copies, and freezing it leaves the
    original training."""
    last = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else None
    if last is None:
        return True
    made = re.compile(rf"\b{re.escape(last)}\s*=\s*(?:copy\.)?(?:deepcopy|copy)\(|"
                      rf"\b{re.escape(last)}\s*=\s*\w*(?:EMA|Ema|Averaged)\w*\(")
    return bool(made.search(text))


_WRAPS = re.compile(r"DistributedDataParallel|\bDDP\(|FullyShardedDataParallel|\bFSDP\(|\.prepare\(")
_UNFREEZES = re.compile(r"requires_grad\s*=\s*True|requires_grad_\(\s*(?:True)?\s*\)")


def _freezes(stmt, target) -> bool:
    """``p.requires_grad = False`` on the loop's parameter."""
    return isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute) and \
        stmt.targets[0].attr == "requires_grad" and isinstance(stmt.value, ast.Constant) and \
        stmt.value.value is False and isinstance(target, ast.Name) and \
        isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == target.id


def _parameters_call(node) -> bool:
    """``model.parameters()`` / ``model.named_parameters()``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr in ("parameters", "named_parameters")


def _wraps(vals) -> bool:
    return any(_wrappers_in(v) for v in vals)


def _wrappers_in(v) -> list:
    from synccheck.analyzer.project.values import Tup
    if isinstance(v, Wrapper):
        return [v]
    if isinstance(v, Tup):
        return [w for item in v.items for x in item for w in _wrappers_in(x)]
    return []


def _in_place_elsewhere(project, wrapper, module) -> bool:
    """Is ``wrapper`` an FSDP2 sharding done in place by a script ``module`` never reaches (nor it
    ``module``)? (An instance of a project class is known by its class: facts._sharded_elsewhere.)"""
    if getattr(wrapper, "kind", None) != "fsdp2" or not getattr(wrapper, "site", None) or module is None:
        return False
    sharded_in = project.module_at(wrapper.site[0])
    if sharded_in is None or sharded_in is module:
        return False
    return not (_reaches(project, module, sharded_in) or _reaches(project, sharded_in, module))


def _reaches(project, start, goal, depth: int = 4) -> bool:
    """Does ``start`` import ``goal``, directly or through project modules (``depth`` imports deep)?"""
    seen = {id(start)}
    frontier = [start]
    for _ in range(depth):
        nxt = []
        for module in frontier:
            # ``import a.b`` / ``from a import b`` (either may name the module) and ``from a import *``
            named = [(name, level) for mod, attr, level in module.imports.values()
                     for name in (mod, f"{mod}.{attr}" if mod else attr) if name]
            for name, level in named + list(module.stars):
                found = project.find_module(module, name, level)
                if found is goal:
                    return True
                if found is not None and id(found) not in seen:
                    seen.add(id(found))
                    nxt.append(found)
        frontier = nxt
    return False


def _same_script(project, wrapper, module) -> bool:
    """Is ``wrapper`` made in ``module``, or in a module it imports or that imports it? A sibling script
    that averages its own model by hand (StructuredLM's ``ddp_trainer_nosync.py``) says nothing of
    another script's model built by the same factory."""
    made_in = project.module_at(wrapper.site[0]) if getattr(wrapper, "site", None) else None
    if made_in is None or made_in is module:
        return True
    from synccheck.analyzer.project.sampler_loops import _import_related
    return _import_related(made_in, module)
