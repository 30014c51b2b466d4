"""Stage 5 of the pipeline (values), part 5: attributes.

What ``obj.attr`` holds: a module's or class's member, an instance attribute stored by any class of the
instance's MRO (``self.model = DDP(net)`` in a base class), by a dataclass's builders or from outside
the class (``trainer.model = ...``), a method bound to its instance, ``super().m`` resolved in the MRO,
a wrapper's ``.module`` and ``.no_sync``, and the samplers behind a loader's ``.sampler``.
``AttributeValues`` is the part of ``values.Values`` that does this.
"""
from __future__ import annotations

import ast
import weakref
from typing import Optional

from synccheck.analyzer.project.definitions import Function, is_super_call
from synccheck.analyzer.project.scopes import ITEM, scope_attribute_stores
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.value_helpers import _OUTSIDE_STORE, _class_attrs, _symbol_of, called_name
from synccheck.analyzer.project.value_types import (EMPTY, ONE_UNKNOWN, UNKNOWN, Bag, Bound, Cls, CtxFactory, Ext, Framework,
                                                    Inner, Inst, Loader, Mod, Obj, Sampler, Super, Unknown, Wrapper,
                                                    _cap, site_of)


class AttributeValues:
    """What attributes hold (a part of Values)."""

    def attribute(self, receivers: frozenset, attr: str, node, scope) -> frozenset:
        out = set()
        for v in receivers:
            if isinstance(v, (Mod, Ext, Cls)):
                sym = self.project.attribute(v.module if False else _symbol_of(v), attr)
                if isinstance(v, Cls) and isinstance(sym, Function) and sym.is_method and any(
                        called_name(d) == "classmethod" for d in sym.node.decorator_list):
                    out.add(Bound(sym, v))         # ``Pipe.load(path)``: ``cls`` is Pipe
                    continue
                out |= self.symbol(sym) if sym is not None else (
                    {Ext(f"{v.qualname}.{attr}")} if isinstance(v, Ext) else {UNKNOWN})
            elif isinstance(v, Inst):
                out |= self.instance_attribute(v, attr)
            elif isinstance(v, Super):
                out |= self.super_attribute(v, attr)
            elif isinstance(v, Wrapper):
                if attr == "module":
                    out.add(Inner(v))
                elif attr == "no_sync":
                    out.add(CtxFactory("off", site_of(self.module_of(scope), node), "no_sync"))
                    self.sites[site_of(self.module_of(scope), node)] = (_receiver_of(node), scope)
                else:
                    out |= self._subclass_method(v, attr)
            elif isinstance(v, Loader) and attr in _LOADER_SAMPLERS:
                out |= self.loader_samplers(v, attr)
            elif isinstance(v, Sampler) and attr == "sampler":
                out.add(v)      # ``loader.batch_sampler.sampler``: a batch sampler stands for what it wraps
            elif isinstance(v, Framework) and v.kind == "accelerate" and attr in ("accumulate", "no_sync"):
                # ``self.scope = self.accelerator.accumulate`` (kept to be called later, with the model):
                # the callable form of accelerate's control
                out.add(CtxFactory("managed" if attr == "accumulate" else "off", site_of(self.module_of(scope), node),
                                   attr))
                self.sites[site_of(self.module_of(scope), node)] = (_receiver_of(node), scope)
            elif isinstance(v, (Obj, Unknown)) and attr == "no_sync":
                out.add(CtxFactory("off", site_of(self.module_of(scope), node), "no_sync"))
                self.sites[site_of(self.module_of(scope), node)] = (_receiver_of(node), scope)
            else:
                out.add(UNKNOWN)
        return frozenset(out)

    def _subclass_method(self, wrapper: Wrapper, attr: str) -> frozenset:
        """``model.loss(x)`` on a project subclass of DDP that defines ``loss`` (``return self(x, ...)``):
        that method, run on the wrapper itself."""
        if wrapper.cls is None or attr.startswith("__"):
            return ONE_UNKNOWN
        method = self.project.attribute(wrapper.cls, attr)
        if isinstance(method, Function) and not method.is_property:
            return frozenset((Bound(method, wrapper),))
        return ONE_UNKNOWN

    def super_attribute(self, sup: Super, attr: str) -> frozenset:
        """``super().compute_loss`` in a mixin: the method after the mixin in the MRO of the instance's
        class (``LMTrainer(LossScaleMixin, LMBase)``: LMBase's), bound to the instance."""
        if attr.startswith("__"):
            return ONE_UNKNOWN      # (``super().__init__(...)``, in every module of a model library: not followed)
        method = self.project.method_after(sup.inst.cls, sup.after, attr)
        return ONE_UNKNOWN if method is None else self._method_value(method, sup.inst)

    def _method_value(self, method: Function, inst: Inst) -> frozenset:
        if method.is_property:
            # ``self.model`` read through ``@property def model(self)``: what it returns
            return self.returns(method) or ONE_UNKNOWN
        return frozenset((Bound(method, inst),))

    def instance_attribute(self, inst: Inst, attr: str) -> frozenset:
        return self._memoized(("iattr", inst.cls.uid, attr), lambda: self._instance_attribute(inst, attr))

    def _instance_attribute(self, inst: Inst, attr: str) -> frozenset:
        out = set()
        replaced = False
        for klass in self.project.mro(inst.cls):
            if attr in klass.methods:
                method = klass.methods[attr]
                if method.stub and not method.is_property and method.parent is None:
                    overrides = self._overrides(inst, method)
                    if overrides:
                        return overrides
                return self._method_value(method, inst)
            stores = _class_attrs(self, klass).get(attr, ())
            rewritten = _rewritten_stores(stores, attr) if len(stores) > 1 else ()
            for scope, value, path in stores:
                if replaced and isinstance(scope, Function) and scope.cls is klass and scope.node.name == "__init__":
                    continue        # a base's constructor stored it; the subclass's replaced it after
                if id(value) in rewritten:
                    continue        # ``self.optimizer = AdamW(...)``, then ``... = accelerator.prepare(self.optimizer)``
                if _returns_own_store(self.project, inst.cls, scope, value, attr):
                    continue        # ``self.model = self.initialize_model()``, which stores and returns ``self.model``
                if path == ITEM:
                    out.add(Bag(_cap(self.expr(value, scope)), True))
                    continue
                out |= self.unpack(self.expr(value, scope), path, value, scope)
            replaced = replaced or _stored_after_super_init(klass, attr)
        # a dataclass / NamedTuple field: what its builders pass (``State(model=DDP(net))``)
        out |= self.record_field(inst.cls, attr)
        # stores from outside: ``trainer.model = DDP(...)``
        for scope, receiver, value, path in self._outside_stores(attr):
            if inst in self.expr(receiver, scope):
                out |= self.unpack(self.expr(value, scope), path, value, scope)
        if not any(isinstance(v, (Wrapper, Framework)) for v in out):
            # ``model: DistributedDataParallel`` in the class body, or ``self.model: DDP = restore(...)``:
            # the value is made out of view, the annotation says what it is
            made = self._annotated_attribute(inst.cls, attr)
            if made:
                out = {v for v in out if not isinstance(v, (Obj, Unknown))} | made
        return frozenset(out) or ONE_UNKNOWN

    def _overrides(self, inst: Inst, stub) -> frozenset:
        """``self.train_one_step(...)`` in a base class that leaves the method empty (``pass``) and is
        never made by its name: what runs is the subclasses' overrides, each bound to an instance of
        its class (3d_diffuser_actor's BaseTrainTester and TrainTester, in two files). EMPTY when the
        base itself is made, or no subclass fills the hook."""
        from synccheck.analyzer.project.value_params import MAX_MADE_CLASSES
        name = stub.node.name
        if name.startswith("__") or self._made(inst.cls):
            return EMPTY
        out = set()
        for sub in self.project.subclasses(inst.cls):
            method = self.project.attribute(sub, name)
            if isinstance(method, Function) and method is not stub and not method.stub and \
                    not method.abstract and not method.is_property:
                out.add(Bound(method, Inst(sub)))
        return frozenset(out) if 0 < len(out) <= MAX_MADE_CLASSES else EMPTY

    def _annotated_attribute(self, klass, attr: str) -> frozenset:
        for k in self.project.mro(klass):
            found = _attribute_annotations(k).get(attr)
            if found is not None:
                made = frozenset(v for v in self.annotated(k.module, found, found)[0] if isinstance(v, Wrapper))
                if made:
                    return made
        return EMPTY

    def _outside_stores(self, attr: str) -> list:
        """``obj.attr = value`` outside the class's own methods, in the parsed modules."""
        stores = self._plain.setdefault(("stores",), {})
        done = self._plain.setdefault(("stores-done",), set())
        modules = self.project.modules()
        seen = self._plain.get(("stores-seen",), 0)     # modules are only added: the first ones are done
        self._plain[("stores-seen",)] = len(modules)
        for module in modules[seen:]:
            if module.path in done:
                continue
            done.add(module.path)
            if not _OUTSIDE_STORE.search(module.text):
                continue
            for scope in [module] + list(module.functions.values()):
                # the stores first (a scope that makes none adds nothing whatever its text says), then
                # the text of the function, as the scope's whole ScopeInfo used to be read for them
                found = scope_attribute_stores(scope).obj_attrs
                if not found or (isinstance(scope, Function) and
                                 not _OUTSIDE_STORE.search(module.segment(scope.node))):
                    continue
                for receiver, a, value, path in found:
                    stores.setdefault(a, []).append((scope, receiver, value, path))
        return stores.get(attr, [])

    def loader_samplers(self, loader: Loader, attr: Optional[str] = None) -> frozenset:
        """The samplers a DataLoader was given; ``attr``: only what ``loader.sampler`` (or
        ``loader.batch_sampler``) holds. A loader built with ``batch_sampler=`` has DataLoader's own
        SequentialSampler as its ``.sampler``: the DistributedSampler inside the batch sampler is not
        there, and ``loader.sampler.set_epoch`` does not reach it."""
        call, scope = self.sites.get(loader.site, (None, None))
        if call is None:
            return ONE_UNKNOWN
        given = {kw.arg: kw.value for kw in call.keywords if kw.arg in _LOADER_SAMPLERS}
        # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)
        for position, name in ((3, "sampler"), (4, "batch_sampler")):
            if len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[:position + 1]):
                given.setdefault(name, call.args[position])
        if any(kw.arg is None for kw in call.keywords) and not given:
            return ONE_UNKNOWN      # DataLoader(dataset, **loader_kwargs)
        if attr == "batch_sampler" and "batch_sampler" not in given:
            attr = "sampler"        # DataLoader's own BatchSampler over ``sampler=`` (its ``.sampler``)
        out = set()
        for name, node in given.items():
            if attr is None or name == attr:
                out |= {v for v in self.expr(node, scope) if isinstance(v, (Sampler, Unknown, Obj))}
        return frozenset(out) or EMPTY


_LOADER_SAMPLERS = ("sampler", "batch_sampler")


def _stored_after_super_init(klass, attr: str) -> bool:
    """Does the class's ``__init__`` call ``super().__init__(...)`` and then, unconditionally, store
    ``self.<attr>``? (``self.model = DDP(self.model)`` after the base stored the plain module: every
    instance holds the wrapper, whatever the base's constructor stored.)"""
    init = klass.methods.get("__init__")
    if init is None or not init.params:
        return False
    me = init.params[0]
    called = False
    for stmt in init.node.body:
        if not called:
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            # ``super().__init__(...)`` or ``Base.__init__(self, ...)``
            called = is_super_call(call, "__init__") or isinstance(call, ast.Call) and \
                isinstance(call.func, ast.Attribute) and call.func.attr == "__init__" and \
                bool(call.args) and isinstance(call.args[0], ast.Name) and call.args[0].id == me
        elif isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == me
                for t in stmt.targets):
            return True
    return False


def _receiver_of(node):
    """The object expression of an attribute read: ``m`` in ``m.no_sync`` and in ``getattr(m, "no_sync")``."""
    return node.args[0] if isinstance(node, ast.Call) else node.value


# an annotation worth resolving says a wrapper's name (resolving every ``x: int`` of a large class
# would parse module after module)
_WRAPPER_ANNOTATION = ("DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel")


def _attribute_annotations(klass) -> dict:
    """attr -> the annotation of ``attr: T`` in the class body or ``self.attr: T = ...`` in a method, for
    the annotations that name a wrapper; read once per class."""
    table = _ANNOTATIONS.get(klass)
    if table is None:
        table = {}
        text = klass.module.segment(klass.node) or ""
        if any(w in text for w in _WRAPPER_ANNOTATION):
            for stmt in klass.node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    table.setdefault(stmt.target.id, stmt.annotation)
            for method in klass.methods.values():
                self_name = method.params[0] if method.params else None
                for node in ast.walk(method.node):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) and \
                            isinstance(node.target.value, ast.Name) and node.target.value.id == self_name:
                        table.setdefault(node.target.attr, node.annotation)
            table = {a: n for a, n in table.items() if any(w in ast.unparse(n) for w in _WRAPPER_ANNOTATION)}
        _ANNOTATIONS[klass] = table
    return table


_ANNOTATIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _rewritten_stores(stores, attr: str) -> set:
    """The ids of the values stored in ``self.attr`` that a later statement of the same method's own
    body replaces with something made from them (``self.model, self.optimizer =
    self.accelerator.prepare(self.model, self.optimizer)`` after ``self.optimizer = AdamW(...)``):
    every call of the method ends with the later value."""
    out = set()
    by_scope: dict = {}
    for scope, value, path in stores:
        if isinstance(scope, Function):
            by_scope.setdefault(id(scope), (scope, []))[1].append(value)
    for scope, values in by_scope.values():
        if len(values) < 2:
            continue
        body_values = {id(stmt.value) for stmt in scope.node.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                       and stmt.value is not None}
        self_name = scope.params[0] if scope.params else None
        last = None
        for value in values:
            # (only a framework's ``prepare`` / ``setup``, which hands back new objects: a
            # ``convert_sync_batchnorm(self.model)`` or ``DDP(self.model)`` is read through the stores
            # before it, which say what it wraps)
            if not _prepares(value):
                continue
            if id(value) in body_values and any(
                    isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and
                    n.value.id == self_name for n in ast.walk(value)):
                last = value if last is None or value.lineno > last.lineno else last
        if last is not None:
            out |= {id(v) for v in values if v.lineno < last.lineno}
    return out


def _prepares(value) -> bool:
    """Is the stored value a framework's ``prepare`` / ``setup`` call?"""
    return isinstance(value, ast.Call) and called_name(value) in (
        "prepare", "prepare_model", "prepare_optimizer", "setup", "setup_module", "setup_optimizers")


def _returns_own_store(project, klass, scope, value, attr: str) -> bool:
    """``self.model = self.initialize_model()`` where the method stores ``self.model`` itself and
    returns it: what it returns is that store (found on its own); read through the method, the
    ``self`` of a base class's method stands for every subclass, a sibling's wrapper included."""
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute) or \
            not isinstance(value.func.value, ast.Name) or not isinstance(scope, Function) or \
            not scope.params or value.func.value.id != scope.params[0]:
        return False
    method = project.attribute(klass, value.func.attr)
    if not isinstance(method, Function) or not method.params:
        return False
    returns = [n for n in walk_no_defs(method.node) if isinstance(n, ast.Return)]
    return bool(returns) and all(isinstance(r.value, ast.Attribute) and r.value.attr == attr and
                                 isinstance(r.value.value, ast.Name) and r.value.value.id == method.params[0]
                                 for r in returns)
