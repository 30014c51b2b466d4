"""Stage 5 of the pipeline (values), part 5: what calls make.

A call's value: constructors of wrappers, optimizers, Accelerator / Fabric, scalers, samplers and
loaders (each identified by its *site*, with what it wraps or owns recorded there), methods whose
meaning depends on the receiver (``accelerator.prepare``, ``fabric.setup``: value_frameworks.py;
``model.no_sync()``),
project functions' returns, and the relations looked up from sites later (what a wrapper wraps, which
models an optimizer owns, which models a sync context names). ``CallValues`` is the part of
``values.Values`` that does this.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import Function, GlobalRef, is_super_call, qualified_name
from synccheck.analyzer.project.options import keyword_argument, known_bool
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.value_helpers import (_accumulates, _argument, _first_arg, _kw, _parameter_sources, _sharded,
                                                      _single_device, _strings, _text, _truthy, module_or_itself)
from synccheck.analyzer.project.value_frameworks import (deepspeed_gives_the_micro_steps, launched_with_deepspeed,
                                                          reads_the_plugin)
from synccheck.analyzer.project.value_types import (EMPTY, ONE_UNKNOWN, UNKNOWN, Accumulator, Bag, Bound, Cls, Const, Ctx,
                                                    CtxFactory, Ext, Framework, Func, Inner, Inst, Loader, LocalSGD,
                                                    NativeScaler, Obj, Optim, Partial, Sampler, Scaler, Tup, Wrapper, _cap,
                                                    site_of)


class CallValues:
    """What calls make, and what a site's wrapper wraps or optimizer owns (a part of Values)."""

    # -- calls ---------------------------------------------------------------------------------------
    def call(self, call: ast.Call, scope) -> frozenset:
        module = self.module_of(scope)
        func = call.func
        receiver = None
        if isinstance(func, ast.Attribute):
            receiver = self.expr(func.value, scope)
            special = self._method(call, func.attr, receiver, scope, module)
            if special is not None:
                return special
        if isinstance(func, ast.Name) and func.id == "dict" and not call.args and call.keywords and \
                all(kw.arg is not None for kw in call.keywords) and self.project.resolve(module, "dict") is None:
            # ``state = dict(model=model, optimizer=optimizer)``: a dict literal by another name
            fields = tuple((kw.arg, _cap(self.expr(kw.value, scope))) for kw in call.keywords[:64])
            items = frozenset().union(*(v for _, v in fields))
            return frozenset((Bag(_cap(items), True, fields),))
        out = set()
        lam = func if isinstance(func, ast.Lambda) else self._lambda_bound(func, scope)
        if lam is not None and isinstance(lam.body, ast.Call):
            # ``wrap = lambda m: DDP(m, device_ids=[rank])``; ``wrap(net)``: what the body's call makes
            # (its parameters are not bound to the arguments: what is made does not hang on them)
            return self.expr(lam.body, scope)
        lams = self._registry_lambdas(func, scope)
        if lams:
            # ``STRATEGIES[name](model, rank)`` where ``STRATEGIES = {"ddp": lambda m, r: DDP(m, ...),
            # "none": lambda m, r: m}``: what each lambda's body makes, or the argument it returns
            for lam, where in lams:
                params = [a.arg for a in lam.args.args]
                body = lam.body
                if isinstance(body, ast.Name) and body.id in params:
                    i = params.index(body.id)
                    out |= self.expr(call.args[i], scope) if i < len(call.args) and not any(
                        isinstance(a, ast.Starred) for a in call.args[:i + 1]) else ONE_UNKNOWN
                elif isinstance(body, ast.Call):
                    out |= self.expr(body, where)
                else:
                    out |= ONE_UNKNOWN
            return frozenset(out)
        callees = self.expr(func, scope)
        if callees == {Ext("int")} and len(call.args) == 1 and not call.keywords:
            # ``int(config["batch_size"])``: a number we know stays known
            return frozenset(Const(int(v.value)) if isinstance(v, Const) and isinstance(v.value, (int, bool))
                             and v.value is not None else UNKNOWN for v in self.expr(call.args[0], scope))
        if callees == {Ext("getattr")} and len(call.args) >= 2:
            # ``getattr(self, "model" if encoder_only else "encoder")``
            names = _strings(call.args[1], self.info(scope))
            if names:
                receivers = self.expr(call.args[0], scope)
                for name in names:
                    out |= self.attribute(receivers, name, call, scope)
                if len(call.args) > 2 and (not out or UNKNOWN in out):
                    # ``getattr(model, "no_sync", nullcontext)``: the default where the attribute may be missing
                    out |= self.expr(call.args[2], scope)
                return frozenset(out) or ONE_UNKNOWN
        for callee in callees:
            out |= self._call_value(callee, call, scope, module)
        return frozenset(out) or ONE_UNKNOWN

    def _registry_lambdas(self, func, scope) -> list:
        """(lambda, scope) for each value of the dict literal a subscripted name is bound to, once,
        when every value is a lambda (a registry of wrappers); [] otherwise."""
        if not (isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name)):
            return []
        bound = self.bound_expressions(func.value.id, scope)
        if not bound:
            ref = self.project.resolve(self.module_of(scope), func.value.id)
            if isinstance(ref, GlobalRef):
                bound = [(v, ref.module) for v in ref.module.globals.get(ref.name, ())]
        if len(bound) != 1 or not isinstance(bound[0][0], ast.Dict) or not bound[0][0].values or \
                not all(isinstance(v, ast.Lambda) for v in bound[0][0].values):
            return []
        return [(v, bound[0][1]) for v in bound[0][0].values]

    def _lambda_bound(self, func, scope) -> Optional[ast.Lambda]:
        """The lambda a local name is bound to, once and only to it."""
        if not isinstance(func, ast.Name):
            return None
        bound = self.info(scope).assigns.get(func.id, ())
        if len(bound) == 1 and not bound[0][1] and isinstance(bound[0][0], ast.Lambda):
            return bound[0][0]
        return None

    def _method(self, call, attr: str, receiver: frozenset, scope, module) -> Optional[frozenset]:
        """Methods whose meaning depends on what they are called on."""
        site = site_of(module, call)
        kinds = {v.kind for v in receiver if isinstance(v, Framework)}
        if "accelerate" in kinds:
            if attr in ("prepare", "prepare_model", "prepare_optimizer", "prepare_data_loader", "prepare_scheduler"):
                return self._prepare(call, attr, scope, module)
            if attr in ("accumulate", "no_sync"):
                self.sites[site] = (call.args[0] if call.args else None, scope)
                return frozenset((Ctx("managed" if attr == "accumulate" else "off", site,
                                      _text(module, call)),))
            if attr == "unwrap_model" and call.args:
                return self._unwrap(self.expr(call.args[0], scope))
        if "fabric" in kinds:
            if attr in ("setup", "setup_module", "setup_optimizers"):
                return self._fabric_setup(call, attr, receiver, scope, module)
            if attr == "no_backward_sync":
                self.sites[site] = (call.args[0] if call.args else None, scope)
                return frozenset((Ctx("off", site, _text(module, call)),))
        if attr == "no_sync" and not call.args:
            self.sites[site] = (call.func.value, scope)
            return frozenset((Ctx("off", site, _text(module, call)),))
        if attr in vocab.SELF_RETURNING and any(isinstance(v, (Wrapper, Inner, Obj)) for v in receiver):
            return frozenset(v for v in receiver if isinstance(v, (Wrapper, Inner, Obj))) | ONE_UNKNOWN
        if attr == "accumulate" and any(isinstance(v, Accumulator) for v in receiver):
            return frozenset((Ctx("accumulator", site, _text(module, call)),))
        if attr == "enter_context":
            return self.expr(call.args[0], scope) if call.args else ONE_UNKNOWN
        return None

    def _call_value(self, callee, call: ast.Call, scope, module) -> frozenset:
        site = site_of(module, call)
        if isinstance(callee, Ext):
            return self._external_call(callee.qualname, call, scope, module, site)
        if isinstance(callee, (Func, Bound)):
            if callee.fn.contextmanager:
                return frozenset((Ctx("helper", site, _text(module, call)),))
            return self.call_returns(callee.fn, callee.receiver if isinstance(callee, Bound) else None, site)
        if isinstance(callee, Cls):
            passed = _forwarding_wrapper(callee.cls, call)
            if passed is not None:
                # ``DataParallelWrapper(DDP(model))`` whose forward and missing attributes are the
                # wrapped module's (joeynmt): what runs and what ``.no_sync()`` names is that module
                return self.expr(passed, scope)
            qual = qualified_name(callee.cls)
            ext = self.project.external_bases(callee.cls)
            # a project class deriving from a wrapper or an optimizer is one (its own code is read
            # where it matters: a project's NativeScaler copy is analysed, not assumed)
            for base in ext + [qual]:
                kind = vocab.wrapper_kind(base)
                if kind:
                    self.sites[site] = (call.args[0] if call.args else None, scope)
                    return frozenset((Wrapper(kind, site, cls=callee.cls),))
                if vocab.is_optimizer_class(base) and base.startswith("torch.optim"):
                    self.sites[site] = (call.args[0] if call.args else None, scope)
                    return frozenset((Optim(site),))
                if base in vocab.ACCELERATOR:     # ``class MyAccelerator(accelerate.Accelerator)``
                    return frozenset((Framework("accelerate", site, self._subclass_accumulates(callee.cls, call)),))
                if base in vocab.FABRIC:
                    return frozenset((Framework("fabric", site, "no", _single_device(call), _sharded(call)),))
                if vocab.tail(base) in vocab.SAMPLER_TAILS and base != qual:
                    # ``class ShardAwareSampler(DistributedSampler)``: its order is seeded by ``self.epoch`` too
                    return _sampler(call, site, self.info(scope))
            if callee.cls.node.name == "DistributedSampler" and _epoch_seeded_copy(callee.cls):
                # a project's own copy of torch's sampler (DB's data_loader.py): the same contract
                return _sampler(call, site, self.info(scope))
            return frozenset((Inst(callee.cls),))
        if isinstance(callee, Inst):
            method = self.project.attribute(callee.cls, "__call__")
            return self.returns(method) if isinstance(method, Function) else ONE_UNKNOWN
        if isinstance(callee, CtxFactory):
            return frozenset((Ctx(callee.effect, callee.site, callee.how + "()"),))
        if isinstance(callee, Partial):
            return ONE_UNKNOWN
        return frozenset((Obj(site),))

    def _static_graph_set_later(self, call, scope) -> bool:
        """``model = DDP(net); model._set_static_graph()`` (what ``static_graph=True`` calls) in the scope
        that binds the wrapper."""
        node = scope.node if isinstance(scope, Function) else scope.tree
        if "_set_static_graph" not in (self.module_of(scope).segment(node) if isinstance(scope, Function)
                                       else scope.text):
            return False
        info = self.info(scope)
        for n, tests in _calls_with_tests(node, "_set_static_graph"):
            if isinstance(n.func.value, ast.Name) and any(value is call for value, _ in info.assigns.get(n.func.value.id, ())):
                # (``if use_static_graph: model._set_static_graph()``: only when the option is on on a
                # run with default options, KAIR's off by default)
                return all(known_bool(self, test, scope) is True for test in tests)
        return False

    def _static_graph_in(self, node, scope) -> bool:
        """``DDP(net, **ddp_kwargs)`` where ``ddp_kwargs = {"static_graph": True, ...}`` (or
        ``dict(static_graph=True, ...)``) is bound in the same scope or at the module's top."""
        if not isinstance(node, ast.Name):
            return False
        if isinstance(scope, Function) and scope.node.args.kwarg is not None and scope.node.args.kwarg.arg == node.id:
            # ``def create_ddp_model(model, **kwargs): return DDP(model, **kwargs)``: what its callers
            # pass by keyword (Pointcept's ``create_ddp_model(model, static_graph=True)``)
            return any(kw.arg == "static_graph" and self._set_true(kw.value, caller)
                       for caller, call, _ in self.callers(scope) for kw in call.keywords)
        for value, _ in self.bound_expressions(node.id, scope):
            if isinstance(value, ast.Dict):
                if any(isinstance(k, ast.Constant) and k.value == "static_graph" and self._set_true(v, scope)
                       for k, v in zip(value.keys, value.values)):
                    return True
            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
                if any(kw.arg == "static_graph" and self._set_true(kw.value, scope) for kw in value.keywords):
                    return True
        return False

    def _set_true(self, node, scope) -> bool:
        """Is an option set to true as far as the code says on a run with default options (options.py):
        a true literal, a name bound only to one, a parameter by its default or its callers' arguments,
        an argparse option on by default? A value read from a config file is not known to be true."""
        if isinstance(node, ast.Constant):
            return _truthy(node)
        return known_bool(self, node, scope) is True

    def _subclass_accumulates(self, klass, call: ast.Call) -> str:
        """_accumulates of a project subclass of Accelerator: what its constructor hands to
        ``super().__init__(gradient_accumulation_steps=cfg.train.grad_accum, ...)``, else the call's."""
        for k in self.project.mro(klass):
            init = k.methods.get("__init__")
            if init is None:
                continue
            for node in walk_no_defs(init.node):
                if is_super_call(node, "__init__"):
                    return _accumulates(node)
            return "unknown"        # its own constructor, which we do not follow further
        return _accumulates(call)

    def _external_call(self, qual: str, call: ast.Call, scope, module, site) -> frozenset:
        kind = vocab.wrapper_kind(qual)
        last = vocab.tail(qual)
        if kind == "deepspeed":
            return frozenset((Tup((frozenset((Wrapper("deepspeed", site),)), frozenset((Optim(site, True),)),
                                   ONE_UNKNOWN, ONE_UNKNOWN)),))
        if kind:
            self.sites[site] = (_first_arg(call, "module"), scope)
            static = any(kw.arg == "static_graph" and self._set_true(kw.value, scope) for kw in call.keywords) or any(
                kw.arg is None and self._static_graph_in(kw.value, scope) for kw in call.keywords) or \
                self._static_graph_set_later(call, scope)
            return frozenset((Wrapper(kind, site, static),))
        if qual in vocab.ACCELERATOR:
            accumulates = _accumulates(call)
            if accumulates == "no" and (reads_the_plugin(scope) or launched_with_deepspeed(scope) and
                                        deepspeed_gives_the_micro_steps(scope)):
                # a function that reads the DeepSpeed plugin unconditionally (it is None otherwise), or a
                # project whose launch configurations are all DeepSpeed's: the DeepSpeed config says how
                # many micro-steps (vk_embedder's ``...deepspeed_config['gradient_accumulation_steps'] = 1``),
                # unless it says ``"auto"``: the Accelerator's count, one (LMFlow-distill)
                accumulates = "unknown"
            return frozenset((Framework("accelerate", site, accumulates),))
        if qual in vocab.FABRIC:
            return frozenset((Framework("fabric", site, "no", _single_device(call), _sharded(call)),))
        if last in vocab.SCALER_TAILS:
            return frozenset((Scaler(site),))
        if last in vocab.NATIVE_SCALER_TAILS:
            return frozenset((NativeScaler(site),))
        if last in vocab.SAMPLER_TAILS:
            return _sampler(call, site, self.info(scope))
        if last in vocab.LOADER_TAILS:
            self.sites[site] = (call, scope)
            return frozenset((Loader(site),))
        if last in ("nullcontext", "suppress") and qual.startswith("contextlib"):
            return frozenset((Ctx("null", site),))
        if last == "ExitStack":
            return frozenset((Ctx("exitstack", site),))
        if qual in ("functools.partial", "partial"):
            made = self.expr(call.args[0], scope) if call.args else EMPTY
            wrappers = frozenset(v for v in made if isinstance(v, Ext) and vocab.wrapper_kind(v.qualname))
            if wrappers:
                # ``wrap = partial(DistributedDataParallel, device_ids=[rank])``: calling it wraps
                return wrappers
            self.sites[site] = (call, scope)
            return frozenset((Partial(site),))
        if qual in ("torch.compile", "torch.jit.script", "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
                    "copy.deepcopy") and call.args:
            return self.expr(call.args[0], scope)
        if qual in ("list", "tuple") and len(call.args) == 1 and not call.keywords:
            # ``model, *optimizers = list(accelerator.prepare(model, *optimizers))``: the same items
            got = self.expr(call.args[0], scope)
            if any(isinstance(v, (Tup, Bag)) for v in got):
                return got
        if qual == "getattr" and len(call.args) >= 2:
            base = self.expr(call.args[0], scope)
            out = set(self.expr(call.args[2], scope)) if len(call.args) > 2 else set()
            if isinstance(call.args[1], ast.Constant) and call.args[1].value == "module":
                out |= self._unwrap(base)
            return frozenset(out) or ONE_UNKNOWN
        if last in vocab.ACCUMULATOR and (qual.startswith("synccheck") or qual == last):
            self.sites[site] = (call.args[0] if call.args else None, scope)
            return frozenset((Accumulator(site),))
        if last in vocab.LOCAL_SGD:
            self.sites[site] = (call.args[0] if call.args else None, scope)
            return frozenset((LocalSGD(site),))
        if vocab.is_optimizer_class(qual) and qual != "Optimizer":
            self.sites[site] = (call.args[0] if call.args else _kw(call, "params"), scope)
            return frozenset((Optim(site),))
        if last in vocab.OPTIMIZER_FACTORIES:
            self.sites[site] = (call.args[1] if len(call.args) > 1 else call.args[0] if call.args else None, scope)
            return frozenset((Optim(site),))
        return frozenset((Obj(site),))

    def _unwrap(self, values: frozenset) -> frozenset:
        out = set()
        for v in values:
            out.add(Inner(v) if isinstance(v, Wrapper) else v)
        return frozenset(out)

    def returns(self, fn: Function) -> frozenset:
        return self._memoized(("returns", fn.uid), lambda: self._returns(fn))

    def returns_for(self, fn: Function, receiver) -> frozenset:
        """What ``fn`` returns, called on ``receiver``. ``FluxPipeline.from_pretrained(...)``: the
        classmethod's ``cls(...)`` makes an instance of the class it was called on (or of a subclass),
        not of every subclass of the class that defines it (a pipeline library has hundreds)."""
        out = self.returns(fn)
        if not isinstance(receiver, Cls) or not fn.is_method or fn.cls is None or receiver.cls is fn.cls:
            return out
        mine = receiver.cls
        if not any(isinstance(v, (Inst, Cls)) and v.cls is not mine for v in out):
            return out
        mro = self.project.mro
        return frozenset(v for v in out if not (isinstance(v, (Inst, Cls)) and fn.cls in mro(v.cls)
                                                 and mine not in mro(v.cls)))

    def _made_per_call(self, values: frozenset, fn: Function, site) -> frozenset:
        """A factory's ``return component(*args)`` (a call we cannot follow, in the return statement)
        makes a new object on every call: the object one caller gets is its own, known by the caller's
        call (torchtune's ``config.instantiate``: the model one recipe shards is not the model of the
        single-device recipe). An object the function binds first (``model = build(); fully_shard(model);
        return model``) stays the one object it is."""
        if not any(isinstance(v, Obj) for v in values):
            return values
        return made_per_call(values, {site_of(fn.module, r) for r in self.info(fn).returns if isinstance(r, ast.Call)},
                             site)

    def call_returns(self, fn: Function, receiver, site) -> frozenset:
        """What a call at ``site`` of ``fn`` (on ``receiver``) returns to its caller."""
        return self._made_per_call(self.returns_for(fn, receiver), fn, site)

    def _returns(self, fn: Function) -> frozenset:
        info = self.info(fn)
        if not info.returns:
            return frozenset((Const(None),))
        unwrapped = _unwrapper_parameter(fn.node)
        if unwrapped is not None:
            # ``if hasattr(model, "module"): return model.module`` / ``return model`` (open_clip's
            # unwrap_model): the module inside where it is a wrapper, never the wrapper (as the
            # conditional expression in Values.expr)
            return frozenset(Inner(v) if isinstance(v, Wrapper) and v.kind in vocab.MODULE_INSIDE else v
                             for v in self.name(unwrapped, fn))
        out = set()
        for value in info.returns:
            out |= self.expr(value, fn)
        return frozenset(out)

    # -- relations looked up from sites --------------------------------------------------------------
    def wrapped_by(self, wrapper: Wrapper) -> frozenset:
        """The values a wrapper was built around (``DDP(model)`` -> what ``model`` holds)."""
        arg, scope = self.sites.get(wrapper.site, (None, None))
        if arg is None:
            return EMPTY
        return frozenset(v for v in self.expr(arg, scope) if not isinstance(v, Wrapper))

    def owners(self, optim: Optim) -> frozenset:
        """The models whose parameters an optimizer holds; empty when unknown."""
        return self._memoized(("owners", optim.site), lambda: self._owners(optim))

    def _owners(self, optim: Optim) -> frozenset:
        arg, scope = self.sites.get(optim.site, (None, None))
        if arg is None:
            return EMPTY
        out = set()
        for node in _parameter_sources(arg, scope, self):
            out |= self.expr(node, scope)
        return frozenset(v for v in out if isinstance(v, (Wrapper, Obj, Inner, Inst)))

    def context_models(self, ctx) -> frozenset:
        """The models a sync context (or factory) names."""
        arg, scope = self.sites.get(ctx.site, (None, None))
        if arg is None:
            return EMPTY
        return self.expr(arg, scope)


def _calls_with_tests(node, attr: str) -> list:
    """(call, the tests that hold where it runs: of each ``if`` whose body holds it, negated for an
    ``else``) for each ``x.attr(...)`` under ``node``."""
    ifs = [n for n in walk_no_defs(node) if isinstance(n, ast.If)]
    out = []
    for n in walk_no_defs(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
            tests = []
            for branch in ifs:
                if any(s.lineno <= n.lineno <= (s.end_lineno or s.lineno) for s in branch.body):
                    tests.append(branch.test)
                elif any(s.lineno <= n.lineno <= (s.end_lineno or s.lineno) for s in branch.orelse):
                    tests.append(ast.UnaryOp(ast.Not(), branch.test))
            out.append((n, tests))
    return out


def _epoch_seeded_copy(klass) -> bool:
    """A class with ``set_epoch`` whose ``__iter__`` reads ``self.epoch``: its order needs set_epoch."""
    methods = klass.methods
    if "set_epoch" not in methods or "__iter__" not in methods:
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "epoch" and isinstance(n.value, ast.Name) and
               n.value.id == "self" for n in ast.walk(methods["__iter__"].node))


def _sampler(call: ast.Call, site, info) -> frozenset:
    """The DistributedSampler (or a subclass) ``call`` makes; ``shuffle=False`` says no epoch reseeds it
    (spelled out, or in a ``**kwargs`` dict built beside it)."""
    shuffle = keyword_argument(call, "shuffle", info)
    return frozenset((Sampler(site, isinstance(shuffle, ast.Constant) and shuffle.value is False),))


def made_per_call(values: frozenset, made_at: set, caller_site) -> frozenset:
    """The objects made at one of ``made_at`` (calls in a return statement), as the caller at
    ``caller_site`` gets them: its own (see ValueCalls._made_per_call; the flow does the same at the
    ``return`` of a function it analyses in place)."""
    # (an object a factory got from a factory it called is made at that call too: ``return
    # _instantiate_node(...)`` returning what ``return _component_(*args)`` made)
    if not made_at or not any(isinstance(v, Obj) and v.site[:3] in made_at for v in values):
        return values
    return frozenset(Obj(caller_site + ("returned", v.site)) if isinstance(v, Obj) and v.site[:3] in made_at else v
                     for v in values)


def _forwarding_wrapper(klass, call: ast.Call):
    """The argument of ``Wrapper(module)`` a project class passes everything to: its constructor
    stores a parameter as ``self.<attr>``, its ``forward`` only returns ``self.<attr>(...)``, and its
    ``__getattr__`` reads ``self.<attr>``. None for any other class."""
    init, forward, getattr_ = (klass.methods.get(n) for n in ("__init__", "forward", "__getattr__"))
    if init is None or forward is None or getattr_ is None or len(init.params) < 2:
        return None
    stored = {}
    for stmt in init.node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Name) and \
                stmt.value.id in init.params[1:]:
            t = stmt.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == init.params[0]:
                stored[t.attr] = stmt.value.id
    body = [s for s in forward.node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return None
    func = body[0].value.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and forward.params and
            func.value.id == forward.params[0] and func.attr in stored):
        return None
    attr = func.attr
    if not any(isinstance(n, ast.Attribute) and n.attr == attr for n in walk_no_defs(getattr_.node)):
        return None
    param = stored[attr]
    return _argument(call, init, param, init.params.index(param), 1)


def _unwrapper_parameter(node) -> Optional[str]:
    """``def unwrap(m): if <test of m>: return m.module; [else:] return m``: the parameter, else None."""
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 2 and isinstance(body[0], ast.If) and not body[0].orelse and len(body[0].body) == 1 and \
            isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name):
        # ``if isinstance(net, (DataParallel, DDP)): net = net.module`` / ``return net`` (BasicSR's
        # get_bare_model)
        name, step = body[1].value.id, body[0].body[0]
        if isinstance(step, ast.Assign) and len(step.targets) == 1 and isinstance(step.targets[0], ast.Name) and \
                step.targets[0].id == name and module_or_itself(step.value, body[1].value, body[0].test):
            return name
    if not body or not isinstance(body[0], ast.If) or len(body) > 2:
        return None
    test = body[0]
    rest = test.orelse if test.orelse else body[1:]
    if len(test.body) != 1 or len(rest) != 1:
        return None
    for inside, plain in ((test.body[0], rest[0]), (rest[0], test.body[0])):
        if isinstance(inside, ast.Return) and isinstance(plain, ast.Return) and \
                module_or_itself(inside.value, plain.value, test.test):
            return plain.value.id
    return None

