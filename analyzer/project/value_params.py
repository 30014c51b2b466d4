"""Stage 5 of the pipeline (values), part 4: parameters and their callers.

A parameter holds what its annotation says (``model: DDP``), its default, and the arguments of every
call site in the project that may call the function (found by name in the text first, then checked
by what the callee expression holds), a few levels of callers deep. ``self`` of a method is an
instance of its class or of a subclass. ``ParameterValues`` is the part of ``values.Values`` that
does this.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import Class, Function, is_super_call, qualified_name
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.value_helpers import _argument, _calls_named, call_lines, called_name, parameter_default
from synccheck.analyzer.project.value_types import (EMPTY, MAX_CALLERS, MAX_PARAM_DEPTH, UNKNOWN, Bound, Cls, Func,
                                                    Framework, Inst, Obj, Unknown, Wrapper, site_of)


def _through_local(call, scope) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and isinstance(scope, Function)):
        return False
    name = func.value.id
    return name in scope.params or name in (scope.locals or ())


def _registries(module) -> dict:
    """function name -> (registry, key) for the module-level dicts of this module that hold it as a
    value: key None for ``REG = {"llama": parallelize_llama}``; for a dict of dicts, the inner key
    (``LOADERS["msrvtt"] = {"train": dataloader_msrvtt_train, ...}``, or one nested literal:
    ``("LOADERS", "train")``, called as ``LOADERS[args.datatype]["train"](args)``)."""
    found = module.derived.get("registries")
    if found is None:
        found = module.derived["registries"] = {}

        def note(name, entry):
            if entry not in found.get(name, ()):
                found.setdefault(name, []).append(entry)

        for stmt in module.tree.body:
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                continue
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                registry = target.id if isinstance(target, ast.Name) else None
                inner = None
                if registry is None and isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    registry, inner = target.value.id, stmt.value     # ``REG["msrvtt"] = {...}`` / ``= f``
                if registry is None:
                    continue
                if inner is not None and isinstance(inner, ast.Name):
                    note(inner.id, (registry, None))
                    continue
                literal = inner if inner is not None else stmt.value
                if not isinstance(literal, ast.Dict):
                    continue
                nested = [literal] if inner is not None else []
                for v in literal.values:
                    if isinstance(v, ast.Name) and inner is None:
                        note(v.id, (registry, None))
                    elif isinstance(v, ast.Dict) and inner is None:
                        nested.append(v)
                for d in nested:
                    for k, v in zip(d.keys, d.values):
                        if isinstance(v, ast.Name) and isinstance(k, ast.Constant) and isinstance(k.value, str):
                            note(v.id, (registry, k.value))
    return found


def _subscript_calls(module, registry: str, key=None) -> list:
    """(scope, call) for the calls ``registry[k](...)`` (or ``mod.registry[k](...)``) in a module; with a
    ``key``, ``registry[k][key](...)``."""
    out = []
    for scope in [module] + list(module.functions.values()):
        body = module.tree.body if scope is module else scope.node.body
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue            # (a function is a scope of its own)
            for c in walk_no_defs(stmt):
                if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)):
                    continue
                base = c.func.value
                if key is not None:
                    index = c.func.slice
                    if not (isinstance(base, ast.Subscript) and isinstance(index, ast.Constant) and index.value == key):
                        continue
                    base = base.value
                if (isinstance(base, ast.Name) and base.id == registry) or (
                        isinstance(base, ast.Attribute) and base.attr == registry):
                    out.append((scope, c))
    return out


# a method whose callers out of view are looked for by its name (_memo_callers), and how many files
# calling it are read at most
_ENTRY_METHOD = re.compile(r"train|epoch|fit\b|fit_|step")
MAX_DUCK_CALLERS = 6
# the most concrete subclasses whose constructions are looked for (see _parameter)
MAX_MADE_CLASSES = 12


class ParameterValues:
    """What a function's parameters hold, from its callers (a part of Values)."""

    # -- parameters ----------------------------------------------------------------------------------
    def parameter(self, fn: Function, name: str) -> frozenset:
        return self._memoized(("param", fn.uid, name), lambda: self._parameter(fn, name))

    def _runs_this_body(self, klass, fn: Function) -> bool:
        """Does an instance of ``klass`` run ``fn`` when its method of that name is called: ``fn`` is what
        the name resolves to on ``klass``, or the override reaches it through ``super()``?"""
        if klass is fn.cls or fn.node.name.startswith("__"):
            return True
        found = self.project.attribute(klass, fn.node.name)
        if found is fn or not isinstance(found, Function):
            return True
        text = found.module.segment(found.node) or ""
        return "super(" in text and f".{fn.node.name}(" in text

    def _param_depth(self) -> int:
        return sum(1 for k in self._busy if k[0] == "param")

    def _parameter(self, fn: Function, name: str) -> frozenset:
        index = fn.params.index(name)
        node = fn.node
        if fn.is_method and index == 0:
            if any(called_name(d) == "classmethod" for d in node.decorator_list):
                return frozenset(Cls(k) for k in self.project.subclasses(fn.cls))
            concrete = self._concrete(self.project.subclasses(fn.cls))
            # (a subclass that overrides this very method never runs this body, unless its override
            # calls it through super(): ``BaseTrainer.train`` is not what a ``NafsTrainer`` runs, so the
            # ``self.train_loop(...)`` it calls is never NafsTrainer's, whose parameters differ)
            running = [k for k in concrete if self._runs_this_body(k, fn)]
            concrete = running or concrete
            if 1 < len(concrete) <= MAX_MADE_CLASSES and fn.node.name not in ("__init__", "__call__"):
                # ``TrainerBase.train`` where only ``AccumTrainer(...)`` is ever built: a class nobody
                # builds (``SimpleTrainer``, whose ``run_step`` steps every time) runs no method here.
                # (A framework base with hundreds of subclasses, ``nn.Module`` in torch's own code, is
                # not a trainer hierarchy: finding where each is built would parse most of the package)
                made = [k for k in concrete if self._made(k, load=True)]
                concrete = made or concrete
            return frozenset(Inst(k) for k in concrete)
        out = set()
        annotation = self._annotation(fn, name)
        if annotation:
            out |= annotation
        default = parameter_default(node, name)
        if default is not None:
            out |= self.expr(default, fn)
        # callers of callers of ...: past a few levels a parameter is what its default says
        callers = self.callers(fn) if self._param_depth() <= MAX_PARAM_DEPTH else []
        for scope, call, shift in callers:
            arg = _argument(call, fn, name, index, shift)
            if arg is not None:
                out |= self.expr(arg, scope)
                continue
            spread = self._spread_keyword(call, name, scope)
            if spread is not None:
                out |= spread
            elif default is None or any(kw.arg is None for kw in call.keywords) or \
                    any(isinstance(a, ast.Starred) for a in call.args):
                # (``run_train(**vars(args))``: whatever the arguments hold, not only the default)
                out.add(UNKNOWN)
        if not callers:
            # ``def run(state: TrainState, ...)`` called out of view: an instance of the record class it
            # names (not of a module class: what is handed in may be that module's wrapper)
            named = self._annotated_class(fn, name)
            if named is not None and not self.record_fields(named) and any(
                    b.rpartition(".")[2] == "Module" for b in self.project.external_bases(named)):
                named = None
            if named is not None and not self.record_fields(named):
                # (an engine or trainer class, ``engine: TrainingEngine``: an instance of it, or of the
                # subclasses that fill its hooks)
                out |= self.annotated_instance(fn.module, _annotation_of(fn, name), fn.node) or {Inst(named)}
            else:
                out.add(Inst(named) if named is not None else Obj((fn.module.path, node.lineno, node.col_offset, name)))
        return frozenset(out)

    def annotated_instance(self, module, annotation, node) -> frozenset:
        """What a binding annotated with a project class holds when its value is out of view: an
        instance of that class, or of its concrete subclasses when it leaves hooks to them (an abstract
        engine whose one implementation wraps the model); a wrapper the annotation names. EMPTY when
        the annotation names neither."""
        wrapper, klass = self.annotated(module, annotation, node)
        if wrapper or klass is None:
            return wrapper
        classes = self._concrete(list(self.project.subclasses(klass)))
        return frozenset(Inst(k) for k in classes) if len(classes) <= MAX_MADE_CLASSES else EMPTY

    def _annotated_class(self, fn: Function, name: str):
        for arg in fn.node.args.posonlyargs + fn.node.args.args + fn.node.args.kwonlyargs:
            if arg.arg == name and arg.annotation is not None:
                return self.annotated(fn.module, arg.annotation, arg)[1]
        return None

    def _concrete(self, classes: list) -> list:
        """The classes an instance of which can run a method: a base that leaves a hook unfilled
        (``def loss_fn(self, batch): raise NotImplementedError``) is not one when a subclass fills
        them all (its empty ``on_before_forward`` is not what runs for the subclass that zeroes the
        gradients there). All of them when none is concrete."""
        concrete = [k for k in classes if not self.leaves_a_hook(k)]
        if not concrete and len(classes) > 1:
            # every one leaves some hook (a leaf that overrides ``compute_loss`` keeps the middle class's
            # unfilled ``loss_fn``, which it never calls): the ones the project makes
            concrete = [k for k in classes if self._made(k)]
        return concrete or classes

    def _made(self, klass, load: bool = False) -> bool:
        """Is the class called by its name somewhere in the parsed modules (``CTCTrainer(model, ...)``)?
        ``load``: the catalogued files that say its name are parsed first."""
        key = ("made", klass.uid, load)
        found = self._plain.get(key)
        if found is None:
            name = klass.node.name
            found = self._plain[key] = any(isinstance(call.func, ast.Name) and call.func.id == name or
                                           isinstance(call.func, ast.Attribute) and call.func.attr == name
                                           for _, call in self.calls(name, load=load))
        return found

    def leaves_a_hook(self, klass) -> bool:
        """Does the class leave a method to its subclasses: one that only raises NotImplementedError,
        or one it leaves empty (``pass``) that a subclass fills?"""
        key = ("leaves a hook", klass.uid)
        found = self._plain.get(key)
        if found is None:
            names = {name for k in self.project.mro(klass) for name in k.methods}
            methods = [m for m in (self.project.attribute(klass, n) for n in names) if isinstance(m, Function)]
            found = any(m.abstract for m in methods)
            if not found:
                stubs = {m.node.name: m for m in methods if m.stub and not m.node.name.startswith("__")}
                found = bool(stubs) and any(
                    any(isinstance(o := self.project.attribute(sub, name), Function) and o is not stub and
                        not o.stub for name, stub in stubs.items())
                    for sub in self.project.subclasses(klass) if sub is not klass)
            self._plain[key] = found
        return found

    def _spread_keyword(self, call, name: str, scope):
        """``f(**arguments)`` with ``arguments = {"accelerator": accelerator, ...}``: the entry of that
        name, when the dict literal has one; None when no ``**`` dict says anything about it."""
        out = None
        for kw in call.keywords:
            if kw.arg is not None:
                continue
            for v in self.expr(kw.value, scope):
                fields = getattr(v, "fields", None)
                if fields and any(k == name for k, _ in fields):
                    out = (out or frozenset()) | v.item(name)
        return out

    def _annotation(self, fn: Function, name: str) -> frozenset:
        """``model: DDP`` / ``model: DistributedDataParallel``: a wrapper whoever calls."""
        for arg in fn.node.args.posonlyargs + fn.node.args.args + fn.node.args.kwonlyargs:
            if arg.arg == name and arg.annotation is not None:
                return self.annotated(fn.module, arg.annotation, arg)[0]
        return EMPTY

    def annotated(self, module, annotation, node) -> tuple:
        """(a wrapper or an accelerator an annotation names, else EMPTY; the project class it names)."""
        sym = self.project.resolve_expr(module, annotation)
        if sym is None:
            return EMPTY, None
        names = [qualified_name(sym)]
        if isinstance(sym, Class):
            names += self.project.external_bases(sym)
        for name in names:
            kind = vocab.wrapper_kind(name)
            if kind:
                return frozenset((Wrapper(kind, site_of(module, node)),)), None
            # ``accelerator: Accelerator`` (or a project subclass of it): how it was made is
            # the caller's, so whether it accumulates is unknown
            if name in vocab.ACCELERATOR:
                return frozenset((Framework("accelerate", site_of(module, node), "unknown"),)), None
            # ``fabric: Fabric``: Fabric never accumulates by itself; how many devices is the caller's
            if name in vocab.FABRIC:
                return frozenset((Framework("fabric", site_of(module, node), "no"),)), None
        return EMPTY, sym if isinstance(sym, Class) else None

    def calls(self, name: str, load: bool = False) -> list:
        """(scope, call) for the calls in the parsed modules that call ``name`` (``train(...)`` or
        ``x.train(...)``), found by descending only into the statements whose lines say ``name``.
        With ``load``, the catalogued files that mention the name are parsed first (the callers of
        ``train_one_epoch`` are in the files that say ``train_one_epoch``)."""
        if load:
            self.project.load_matching(name)
        modules = self.project.modules()
        found = self._calls.setdefault(name, [])
        start = self._calls_checked.get(name, 0)
        if start < len(modules):
            for module in modules[start:]:
                lines = call_lines(module, name)
                if lines:
                    found.extend(_calls_named(module, name, lines))
            self._calls_checked[name] = len(modules)
        return found

    def callers(self, fn: Function) -> list:
        """(scope, call, shift) for every call site that may call ``fn``; shift: arguments the call does
        not pass for the parameters (1 for ``self`` of a method called through an instance)."""
        return list(self._memo_callers(fn))

    def _memo_callers(self, fn: Function) -> tuple:
        key = ("callers", fn.uid, self.project.version)
        if key in self._plain:
            return self._plain[key]
        self._plain[key] = ()
        names = [fn.node.name]
        if fn.cls is not None and fn.node.name == "__init__":
            # ``Sub(...)`` runs Base.__init__ when Sub does not define its own; its callers are in the
            # modules that import Sub's (``main.py`` imports engine.classifier, not engine.base)
            subs = [k for k in self.project.subclasses(fn.cls) if self.project.attribute(k, "__init__") is fn]
            names = [k.node.name for k in subs]
            for k in subs:
                if k.module is not fn.module:
                    self.project.importers(k.module, (k.node.name,))
        # the callers are in its own module and in the modules that import it
        self.project.importers(fn.module, tuple(names))
        candidates = [c for n in names for c in self.calls(n)]
        if fn.cls is not None and fn.node.name == "__call__":
            candidates = []        # called through an instance under any name: no parameter values from calls
        out = []
        if fn.cls is None:
            # a plain function is called as ``x.train(...)`` only through a module: not through a
            # parameter or a local (``model.train()`` inside ``def train(model)``), whose value may be
            # what is being worked out here
            candidates = [(scope, call) for scope, call in candidates if not _through_local(call, scope)]
        else:
            # nor is a method called by itself through a parameter other than ``self``
            # (``model.train()`` inside ``Trainer.train(self, loader, model)``: nn.Module.train)
            candidates = [(scope, call) for scope, call in candidates if not (
                scope is fn and _through_local(call, scope) and (not fn.params or call.func.value.id != fn.params[0]))]
        if fn.cls is None:
            # ``train_function = train_epoch_wild if cfg.wild else train_epoch``, then
            # ``train_function(config, model=model, ...)`` (Real3D): the calls of the local it is bound to
            candidates += self._alias_calls(fn)
        # (a training method called on an object made out of view, in a lint of single files: see _duck_call)
        ducks = fn.cls is not None and self.project.single_files and bool(_ENTRY_METHOD.search(fn.node.name))
        if len(candidates) <= MAX_CALLERS:
            for scope, call in candidates:
                for v in self.expr(call.func, scope):
                    shift = self._binds(v, fn)
                    if shift is not None:
                        out.append((scope, call, shift))
                        break
                else:
                    if ducks and self._duck_call(fn, scope, call):
                        out.append((scope, call, 1))
        if not out and ducks and self.project.load_calling(fn.node.name, MAX_DUCK_CALLERS):
            # a training method called on an object made out of view (``self.task.train_epoch(...)``,
            # the task from a registry) in a file that does not import it: the files that call a
            # method of that name, when they are few
            for scope, call in self.calls(fn.node.name):
                if self._duck_call(fn, scope, call):
                    out.append((scope, call, 1))
        if fn.cls is not None and fn.node.name == "__init__":
            # ``super().__init__(model, data_loader, optimizer)`` in a subclass's own __init__ (detectron2's
            # ``AccumTrainer(SimpleTrainer)``): the base's parameters get what the subclass hands on
            out.extend(self._super_init_calls(fn))
        if fn.cls is None:
            # ``fabric.launch(train, cfg)``: Fabric calls ``train(fabric, cfg)`` in every process
            out.extend(self._launched(fn))
        if fn.cls is None:
            # a function kept in a module's registry (``PARALLELIZE = {"llama": parallelize_llama}``) is
            # called through it: ``PARALLELIZE[cfg.model](model, mesh)``
            out.extend((scope, call, 0) for scope, call in self._registry_calls(fn)[:MAX_CALLERS])
        self._plain[key] = tuple(out)
        return self._plain[key]

    def _alias_calls(self, fn: Function) -> list:
        """(scope, call) for the calls of a local name a function is bound to, as itself or one side of a
        conditional expression, in the scope that binds it."""
        name = fn.node.name
        out = []
        for module in self.project.modules():
            words = module.derived.get("alias words")
            if words is None:
                words = module.derived["alias words"] = frozenset(
                    w for groups in _ALIASING.findall(module.text) for w in groups if w)
            if name not in words:
                continue
            for scope in [module] + list(module.functions.values()):
                for alias, bound in self.info(scope).assigns.items():
                    if alias == name or not any(not path and _names_function(value, name) for value, path in bound):
                        continue
                    out += [(s, c) for s, c in self.calls(alias) if s is scope and isinstance(c.func, ast.Name)]
        return out[:MAX_CALLERS]

    def _launched(self, fn: Function) -> list:
        out = []
        for scope, call in self.calls("launch"):
            if not (isinstance(call.func, ast.Attribute) and call.args and isinstance(call.args[0], ast.Name) and
                    call.args[0].id == fn.node.name and self.project.resolve(self.module_of(scope), fn.node.name) is fn):
                continue
            if not any(isinstance(v, Framework) and v.kind == "fabric" for v in self.expr(call.func.value, scope)):
                continue
            made = ast.Call(func=call.args[0], args=[call.func.value] + list(call.args[1:]), keywords=call.keywords)
            out.append((scope, ast.copy_location(made, call), 0))
        return out[:MAX_CALLERS]

    def _super_init_calls(self, fn: Function) -> list:
        out = []
        for k in self.project.subclasses(fn.cls):
            init = k.methods.get("__init__")
            if init is None or init is fn or self.project.method_after(k, k, "__init__") is not fn:
                continue
            for node in walk_no_defs(init.node):
                if is_super_call(node, "__init__"):
                    out.append((init, node, 1))
        return out[:MAX_CALLERS]

    def _registry_calls(self, fn: Function) -> list:
        index = self._plain.get(("registries",))
        modules = self.project.modules()
        if index is None or index[0] != len(modules):
            # function name -> the modules whose registries hold a function of that name (modules are
            # only added: the ones indexed before are not read again)
            table = dict(index[1]) if index is not None else {}
            for module in modules[index[0] if index is not None else 0:]:
                if "{" in module.text:
                    for name in _registries(module):
                        table[name] = table.get(name, ()) + (module,)
            index = self._plain[("registries",)] = (len(modules), table)
        out = []
        for module in index[1].get(fn.node.name, ()):
            if self.project.resolve(module, fn.node.name) is not fn:
                continue            # (another function of that name)
            for registry, key in _registries(module)[fn.node.name]:
                self.project.importers(module, (registry,))
                for other in self.project.modules():
                    if registry + "[" in other.text:
                        out.extend(_subscript_calls(other, registry, key))
        return out

    def _duck_call(self, fn: Function, scope, call) -> bool:
        """``self.task.train_epoch(model=self.model, ...)`` on an object made out of view (a task taken
        from a registry: LAVIS, MiniGPT-4, Video-LLaMA) whose method of that name is, in the whole
        project, only ``fn``'s family's (duck.py): a call of ``fn``."""
        if not isinstance(call.func, ast.Attribute):
            return False
        receiver = self.expr(call.func.value, scope)
        if not receiver or not all(isinstance(r, (Obj, Unknown)) for r in receiver):
            return False
        from synccheck.analyzer.project.duck import duck_method
        caller_cls = scope.cls if isinstance(scope, Function) else None
        key = ("duck", fn.node.name, caller_cls.uid if caller_cls is not None else None,
               len(call.args), tuple(k.arg or "" for k in call.keywords))
        found = self._plain.get(key, False)
        if found is False:
            found = self._plain[key] = duck_method(self.project, fn.node.name, caller_cls, call)
        return found is not None and found[0] is fn

    def _binds(self, v, fn: Function) -> Optional[int]:
        if isinstance(v, Func) and v.fn is fn:
            return 1 if fn.is_method else 0      # Class.method(obj, ...) passes self explicitly
        if isinstance(v, Bound) and v.fn is fn:
            return 1
        if isinstance(v, Cls) and fn.node.name == "__init__" and fn.cls in self.project.mro(v.cls):
            return 1
        return None if not isinstance(v, Func) else None


def _annotation_of(fn: Function, name: str):
    for arg in fn.node.args.posonlyargs + fn.node.args.args + fn.node.args.kwonlyargs:
        if arg.arg == name:
            return arg.annotation
    return None


# where a text may bind a local to a function: ``= name`` (not called), ``name if ...``, ``else name``
_ALIASING = re.compile(r"=[ \t]*([A-Za-z_]\w*)[ \t]*(?=$|#|\bif\b)|\belse[ \t]+([A-Za-z_]\w*)", re.M)


def _names_function(value, name: str) -> bool:
    """Is ``value`` the name, or a conditional expression with the name on one side?"""
    if isinstance(value, ast.Name):
        return value.id == name
    return isinstance(value, ast.IfExp) and (_names_function(value.body, name) or _names_function(value.orelse, name))
