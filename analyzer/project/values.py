"""Stage 5 of the pipeline: abstract values, computed on demand across the whole project.

"What can ``model`` hold in ``train_one_epoch``?" is answered the way a points-to analysis would,
but only for the things gradient synchronization depends on: data-parallel wrappers (and their kind
and options), optimizers (and the models they own), Accelerator / Fabric objects (and whether they
were told to accumulate), scalers, samplers and loaders, sync contexts (``model.no_sync()``), and the
functions, classes and instances that carry them around. Values flow through assignments (with tuple
unpacking), conditional expressions, returns, call arguments into parameters (from every call site in
the project), ``self.x`` attributes across methods and base classes, annotations (``model: DDP``) and
``torch.compile``. A value set is a *may* set: ``model = DDP(m) if distributed else m`` holds both.

The answer is demand driven and memoized: only the names the sync analysis and the rules ask about
are ever evaluated, so a project of thousands of functions costs what its training loops need.
Wrappers, optimizers and loaders are identified by the place they were made (a *site*); what they
wrap or own is looked up from that site on demand, so a value's identity never depends on the order
in which the analysis met it.

The stage's modules: value_types.py (the values and the budgets), value_helpers.py (the syntax read),
value_containers.py, value_params.py, value_calls.py, value_frameworks.py, value_records.py and
value_attributes.py (parts of ``Values``: containers, parameters and their callers, calls, what
accelerate's prepare and Fabric's setup make, records, attributes), and this one:
``Values`` itself, memoization with cycles, names and expressions. Every name these modules define
stays importable from here.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import (Class, External, Function, GlobalRef, Module, ModuleRef,
                                                    qualified_name)
from synccheck.analyzer.project.index import Project
from synccheck.analyzer.project.scopes import ITEM, scope_attribute_stores, scope_info
from synccheck.analyzer.project.value_attributes import _LOADER_SAMPLERS, AttributeValues, _receiver_of
from synccheck.analyzer.project.value_calls import CallValues
from synccheck.analyzer.project.value_containers import ContainerValues
from synccheck.analyzer.project.value_frameworks import FrameworkValues
from synccheck.analyzer.project.value_params import ParameterValues
from synccheck.analyzer.project.value_records import RecordValues
# re-exported: every name values.py held before the split stays importable from here
from synccheck.analyzer.project.value_helpers import (CALL_WORD, _ARITHMETIC, _OUTSIDE_STORE, _accumulates,
                                                      _argument, _arithmetic, _call_lines, _calls_named,
                                                      _class_attrs, called_name, _first_arg, _kw, _mentions, _named,
                                                      _parameter_sources, _reaching, _single_device, _symbol_of,
                                                      _strings, _text, _truthy, module_or_itself, parameter_default)
from synccheck.analyzer.project.value_types import (_BUILTINS, EMPTY, MAX_CALLERS, MAX_DEPTH, MAX_PARAM_DEPTH,
                                                    MAX_KEY_REDONE, MAX_REDONE, MAX_VALUES, MAX_WORK, ONE_UNKNOWN, UNKNOWN,
                                                    Accumulator, Bag, Bound, Cls, Const, Ctx, CtxFactory, Ext,
                                                    Framework, Func, Inner, Inst, Loader, LocalSGD, Mod,
                                                    NativeScaler, Obj, Optim, Partial, Sampler, Scaler, Super, Tup,
                                                    Unknown, Wrapper, _cap, site_of)


# ---------------------------------------------------------------------------------------------------

class Values(AttributeValues, ContainerValues, ParameterValues, CallValues, FrameworkValues, RecordValues):
    """The value analysis of one project."""

    def __init__(self, project: Project) -> None:
        self.project = project
        self._memo: dict = {}         # (kind, key) -> frozenset
        self._plain: dict = {}        # caches that are not values (callers, attribute stores)
        self._busy: set = set()
        self._hits: set = set()
        self._provisional: dict = {}
        self._tentative: dict = {}    # key -> (value, the open cycles' heads whose guess it saw)
        self.redone = 0               # tentative values dropped to be computed again
        self._stale: dict = {}        # key -> how many times its tentative value was dropped
        self.spent = 0
        self.exhausted = False
        self.sites: dict = {}         # site -> (call node, scope): what a wrapper wraps, an optimizer owns
        self._calls: dict = {}            # name -> [(scope, call)]
        self._calls_checked: dict = {}    # name -> how many modules were looked at for it

    def close(self) -> None:
        for store in (self._memo, self._plain, self._provisional, self._tentative, self.sites):
            store.clear()
        self._calls = {}

    # -- scopes --------------------------------------------------------------------------------------
    @staticmethod
    def info(scope):
        found = scope.info
        if found is None:
            if isinstance(scope, Function):
                self_name = scope.params[0] if scope.is_method and scope.params else None
                found = scope_info(scope.node.body, scope.params, self_name)
                scope.locals = found.locals
            else:
                found = scope_info([s for s in scope.tree.body], [], None)
            scope.info = found
        return found

    def bound_expressions(self, name: str, scope) -> list:
        """(expression, scope) for each assignment of ``name``: the function's own when it binds the
        name, else the module's top level (``ctx = nullcontext() if cpu else autocast()``,
        ``ddp_options = dict(static_graph=True)``)."""
        if isinstance(scope, Function) and name in self.info(scope).locals:
            return [(value, scope) for value, _ in self.info(scope).assigns.get(name, ())]
        module = self.module_of(scope)
        found = [(value, module) for value in module.globals.get(name, ())]
        if not found and name in module.imports:
            # ``from config import DDP_KWARGS``: the other module's top-level binding
            sym = self.project.resolve(module, name)
            if isinstance(sym, GlobalRef):
                found = [(value, sym.module) for value in sym.module.globals.get(sym.name, ())]
        return found

    def bound_once(self, node, scope):
        """The expression a name is bound to when it is bound once (bound_expressions), else None; any
        other node as it is (``{True: a, False: b}[flag]`` and ``table[flag]`` with ``table = {...}``)."""
        if not isinstance(node, ast.Name):
            return node
        bound = self.bound_expressions(node.id, scope)
        return bound[0][0] if len(bound) == 1 else None

    @staticmethod
    def module_of(scope) -> Module:
        return scope.module if isinstance(scope, Function) else scope

    def _memoized(self, key, compute) -> frozenset:
        """compute() once per key, demand driven.

        A cycle returns what is known so far to the inner request (``_local`` evaluates a name's
        plain bindings before the ones that mention the name itself, so ``model = model.to(dev)`` and
        ``a, b = accelerator.prepare(a, b)`` see the earlier bindings) and is iterated at its head. A
        value computed inside a cycle, from the head's guess, is kept only until the head is done
        (``self.model`` read while ``self.model, opt = accelerator.prepare(self.model, opt)`` is being
        evaluated must not stay without the wrapper); asked again afterwards, it is computed afresh --
        at most MAX_KEY_REDONE times: in a cycle through many classes (a mixin's ``self.x = self.x | y``
        read for every pipeline that inherits it, ``self`` being any of them) each value dropped and
        computed again drops the ones it saw, and the work doubles with every class of the cycle.
        """
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        hit = self._tentative.get(key)
        if hit is not None:
            return hit[0]
        if key in self._busy:
            self._hits.add(key)
            return self._provisional.get(key, EMPTY)
        if len(self._busy) > MAX_DEPTH or self.spent > MAX_WORK:
            self.exhausted = self.exhausted or self.spent > MAX_WORK
            return ONE_UNKNOWN
        self.spent += 1
        self._busy.add(key)
        outer_hits, self._hits = self._hits, set()
        head = False
        try:
            result = _cap(compute())
            for _ in range(2):
                if key not in self._hits:
                    break
                head = True
                self._hits.discard(key)
                self._provisional[key] = result
                again = _cap(result | compute())
                if again == result:
                    break
                result = again
        finally:
            self._busy.discard(key)
            self._provisional.pop(key, None)
            hits, self._hits = self._hits, outer_hits
            pending = hits - {key}
            self._hits |= pending
        if head and self._tentative:
            # what was computed from this head's guess is computed again when next asked
            stale = [k for k, (_, deps) in self._tentative.items() if key in deps]
            self.redone += len(stale)
            for k in stale:
                del self._tentative[k]
                self._stale[k] = self._stale.get(k, 0) + 1
        if pending and self.redone < MAX_REDONE and self._stale.get(key, 0) < MAX_KEY_REDONE:
            self._tentative[key] = (result, frozenset(pending))
        else:
            self._memo[key] = result
        return result

    # -- names ---------------------------------------------------------------------------------------
    def name(self, name: str, scope, line: int = 0) -> frozenset:
        """What ``name`` can hold in ``scope``; on ``line``, only the bindings that reach that line."""
        if isinstance(scope, Function):
            info = self.info(scope)
            if name in info.locals:
                reach = info.reaching(name, line) if line else None
                if reach is not None:
                    return self._memoized(("local", scope.uid, name, reach),
                                          lambda: self._local(name, scope, info, reach))
                return self._memoized(("local", scope.uid, name), lambda: self._local(name, scope, info))
            outer = scope.parent
            while outer is not None:
                if name in self.info(outer).locals:
                    return self.name(name, outer)
                outer = outer.parent
            return self.module_name(name, scope.module)
        if line:
            reach = self.info(scope).reaching(name, line)
            if reach is not None:
                return self._memoized(("global", scope.path, name, reach), lambda: self._global(name, scope, reach))
        return self.module_name(name, scope)

    def module_name(self, name: str, module: Module) -> frozenset:
        return self._memoized(("global", module.path, name), lambda: self._global(name, module))

    def _global(self, name: str, module: Module, reach=None) -> frozenset:
        info = self.info(module)
        out = set()
        for value, path in _reaching(info.assigns.get(name, ()), reach):
            out |= self.unpack(self.expr(value, module), path, value, module)
        for target, call in info.inplace_wraps:
            if target == name:
                out |= self.expr(call, module)
        out = self._grown(name, out, info, module)
        if name in info.with_as:
            out.add(UNKNOWN)
        if name in info.for_names:
            out |= self._iterated(name, info, module)
        sym = self.project.resolve(module, name) if not out else None
        if sym is not None and not (isinstance(sym, GlobalRef) and (sym.module is module or not _a_registry(sym))):
            # (a module-level variable imported from another module: only a registry of callables,
            # ``from parallelize import PARALLELIZE``, is read there)
            out |= self.symbol(sym)
        if not out:
            # a builtin, or a name bound somewhere we cannot see (a notebook's other cell, exec):
            # the latter is still one object wherever it is used
            out.add(Ext(name) if name in _BUILTINS else Obj((module.path, "<free>", name)))
        return frozenset(out)

    def _sharded_by_helper(self, call, scope) -> frozenset:
        """The wrappers a project function makes of its first parameter in place (``def apply_fsdp(model):
        fully_shard(model)``), for the name a statement ``apply_fsdp(model)`` hands it (duo-attention,
        after ``model = model.model``: an attribute of a value not followed)."""
        out = set()
        for v in self.expr(call.func, scope):
            fn = v.fn if isinstance(v, Func) else None
            if fn is None or not fn.params or fn.is_method:
                continue
            for target, inner in self.info(fn).inplace_wraps:
                if target == fn.params[0]:
                    out |= {w for w in self.expr(inner, fn) if isinstance(w, Wrapper)}
        return frozenset(out)

    def _local(self, name: str, fn: Function, info, reach=None) -> frozenset:
        out = set()
        key = ("local", fn.uid, name) if reach is None else ("local", fn.uid, name, reach)
        assigns = _reaching(info.assigns.get(name, ()), reach)
        # bindings that do not mention the name first: a cycle through the name then sees them
        ordered = sorted(assigns, key=lambda a: _mentions(a[0], name))
        if name in fn.params and not (reach and reach[1]):
            out |= self.parameter(fn, name)
            self._provisional[key] = frozenset(out)
        for value, path in ordered:
            got = self.unpack(self.expr(value, fn), path, value, fn)
            if name in info.annotated and not path and all(isinstance(v, (Unknown, Obj)) for v in got):
                # ``engine: TrainingEngine = registry.construct(...)``: what the annotation names
                got = self.annotated_instance(fn.module, info.annotated[name], value) or got
            if path and got == ONE_UNKNOWN and type(value) is ast.Call:
                # ``text_encoder, vae, unet = load(...)`` from code we cannot follow: still one object
                # each, known by the place that bound it (so ``raw = unet`` and a later
                # ``accelerator.prepare(unet)`` name the same thing)
                got = frozenset((Obj(site_of(fn.module, value) + (f"[{'.'.join(map(str, path))}]",)),))
            out |= got
            self._provisional[key] = frozenset(out)
        for target, call in info.inplace_wraps:
            if target == name:
                out |= self.expr(call, fn)
        for target, call in info.helper_calls:
            if target == name:
                out |= self._sharded_by_helper(call, fn)
        if name in fn.nested:
            out.add(Func(fn.nested[name]))
        local_class = fn.module.classes.get(f"{fn.qualname}.<locals>.{name}")
        if local_class is not None:
            out.add(Cls(local_class))        # ``class Wrapped(ddp_class):`` defined in the function
        out = self._grown(name, out, info, fn)
        for ctx_expr in info.with_as.get(name, ()):
            out |= self.entered(self.expr(ctx_expr, fn))
        if name in info.for_names:
            out |= self._iterated(name, info, fn)
        if name in info.imports and not out:
            # ``from torch.nn.parallel import DistributedDataParallel`` inside the function
            for spec in [info.imports[name]] + info.imports_more.get(name, []):
                sym = self.project.resolve_import(fn.module, spec)
                if sym is not None:
                    out |= self.symbol(sym)
        if name in fn.module.imports and not out:
            sym = self.project.resolve(fn.module, name)
            if sym is not None:
                out |= self.symbol(sym)
        return frozenset(out) or ONE_UNKNOWN

    def symbol(self, sym) -> frozenset:
        if isinstance(sym, Function):
            return frozenset((Func(sym),))
        if isinstance(sym, Class):
            return frozenset((Cls(sym),))
        if isinstance(sym, ModuleRef):
            return frozenset((Mod(sym.module),))
        if isinstance(sym, External):
            return frozenset((Ext(sym.qualname),))
        if isinstance(sym, GlobalRef):
            return self.module_name(sym.name, sym.module)
        return ONE_UNKNOWN

    def entered(self, ctx_values: frozenset) -> frozenset:
        """What ``with X as name`` binds: an ExitStack itself, else something we do not track."""
        out = {v for v in ctx_values if isinstance(v, Ctx) and v.effect == "exitstack"}
        return frozenset(out) or ONE_UNKNOWN

    # -- expressions ---------------------------------------------------------------------------------
    def expr(self, node, scope) -> frozenset:
        t = type(node)
        if t is ast.Name:
            return self.name(node.id, scope, node.lineno)
        if t is ast.Attribute:
            return self.attribute(self.expr(node.value, scope), node.attr, node, scope)
        if t is ast.Call:
            return self._memoized(("call", id(node)), lambda: self.call(node, scope))
        if t is ast.IfExp:
            known = self._type_test(node.test, scope)
            if known is not None:
                return self.expr(node.body if known else node.orelse, scope)
            unwrapped = _unwrapping(node)
            if unwrapped is not None:
                # ``model.module if is_parallel(model) else model`` (YOLO's de_parallel): the module
                # inside where it is a wrapper, the model itself where it is not: never the wrapper
                return frozenset(Inner(v) if isinstance(v, Wrapper) and v.kind in vocab.MODULE_INSIDE else v
                                 for v in self.expr(unwrapped, scope))
            return self.expr(node.body, scope) | self.expr(node.orelse, scope)
        if t is ast.BoolOp:
            return frozenset().union(*(self.expr(v, scope) for v in node.values))
        if t in (ast.Tuple, ast.List):
            return frozenset((Tup(tuple(self.expr(e, scope) for e in node.elts)),))
        if t is ast.Subscript:
            base = self.expr(node.value, scope)
            index = node.slice
            if type(index) is ast.Slice:
                return frozenset(v for v in base if isinstance(v, (Tup, Bag))) or ONE_UNKNOWN
            const = isinstance(index, ast.Constant) and isinstance(index.value, int)
            out = set()
            for v in base:
                if isinstance(v, Tup):
                    if const and -len(v.items) <= index.value < len(v.items):
                        out |= v.items[index.value]
                    elif not const:
                        out.update(x for part in v.items for x in part)
                elif isinstance(v, Bag):
                    out |= v.item(index.value if isinstance(index, ast.Constant) else None)
            return frozenset(out) or ONE_UNKNOWN
        if t is ast.Dict:
            vals = [self.expr(v, scope) for v in node.values]
            items = frozenset().union(*vals)
            fields = ()
            if len(node.keys) <= 64 and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                            for k in node.keys):
                fields = tuple((k.value, _cap(v)) for k, v in zip(node.keys, vals))
            return frozenset((Bag(_cap(items), True, fields),))
        if t is ast.BinOp:
            return _arithmetic(node.op, self.expr(node.left, scope), self.expr(node.right, scope))
        if t is ast.Set:
            return frozenset((Bag(_cap(frozenset().union(*(self.expr(v, scope) for v in node.elts))), False),))
        if t in (ast.ListComp, ast.SetComp, ast.GeneratorExp):
            return frozenset((Bag(_cap(self.expr(node.elt, scope)), False),))
        if t is ast.DictComp:
            return frozenset((Bag(_cap(self.expr(node.value, scope)), True),))
        if t is ast.Constant:
            return frozenset((Const(node.value),)) if isinstance(node.value, (bool, int, type(None))) else ONE_UNKNOWN
        if t is ast.NamedExpr:
            return self.expr(node.value, scope)
        if t is ast.Await:
            return self.expr(node.value, scope)
        return ONE_UNKNOWN

    def _type_test(self, test, scope) -> Optional[bool]:
        """``isinstance(m, DDP)`` / ``type(m) == DDP`` (or ``hasattr(m, "module")``) when every value of
        ``m`` is a DDP wrapper (True) or none is a wrapper (False); else None."""
        subject = cls = None
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr" and \
                len(test.args) == 2 and isinstance(test.args[1], ast.Constant) and test.args[1].value == "module":
            # ``m.module if hasattr(m, "module") else m``: a wrapper has a ``.module``
            values = self.expr(test.args[0], scope)
            if values and all(isinstance(v, Wrapper) and v.kind in ("ddp", "fsdp") for v in values):
                return True
            if values and not any(isinstance(v, (Wrapper, Unknown, Obj, Inst)) for v in values):
                return False
            return None
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" and \
                len(test.args) == 2:
            subject, cls = test.args
        elif isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is)) and \
                isinstance(test.left, ast.Call) and isinstance(test.left.func, ast.Name) and \
                test.left.func.id == "type" and len(test.left.args) == 1:
            subject, cls = test.left.args[0], test.comparators[0]
        if subject is None or not any(isinstance(v, Ext) and vocab.wrapper_kind(v.qualname) == "ddp"
                                      for v in self.expr(cls, scope)):
            return None
        values = self.expr(subject, scope)
        if values and all(isinstance(v, Wrapper) and v.kind in ("ddp", "accelerate") for v in values):
            return True
        if values and not any(isinstance(v, (Wrapper, Unknown, Obj)) for v in values):
            return False
        return None

    def unpack(self, values: frozenset, path: tuple, value_node, scope) -> frozenset:
        for index in path:
            out = set()
            for v in values:
                if isinstance(v, Tup) and index < len(v.items):
                    out |= v.items[index]
                elif isinstance(v, Obj):
                    # ``text_encoder, vae, unet = load(...)``: still one object each, known by its place
                    out.add(Obj(v.site + (f"[{index}]",)))
                elif isinstance(v, Bag) and not v.keyed:
                    out |= v.items           # ``a, b = (f(m) for m in [x, y])``: one of the elements
                else:
                    out.add(UNKNOWN)
            values = frozenset(out)
        return values


def _unwrapping(node: ast.IfExp):
    """The name of ``x.module if <test of x> else x`` (either way round), or None."""
    for inside, plain in ((node.body, node.orelse), (node.orelse, node.body)):
        if module_or_itself(inside, plain, node.test):
            return plain
    return None


def _a_registry(ref) -> bool:
    """Is the module-level variable ``ref`` bound to a dict literal whose values are all names
    (``PARALLELIZE = {"llama": parallelize_llama}``), or a dict of such dicts, one literal or filled
    entry by entry at the module's level (``LOADERS = {}``, ``LOADERS["msrvtt"] = {"train": f, "val": None}``)?"""
    def of_names(value, depth=0) -> bool:
        if isinstance(value, (ast.Name, ast.Attribute)):
            return True
        if isinstance(value, ast.Constant) and value.value is None:
            return True
        return depth < 1 and isinstance(value, ast.Dict) and bool(value.values) and \
            all(of_names(v, depth + 1) for v in value.values)

    bound = entries = False
    for stmt in ref.module.tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        if any(isinstance(t, ast.Name) and t.id == ref.name for t in stmt.targets):
            value = stmt.value
            if not isinstance(value, ast.Dict) or (value.values and not all(of_names(v) for v in value.values)):
                return False
            bound = True
            entries = entries or bool(value.values)
        elif any(isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == ref.name
                 for t in stmt.targets):
            if not of_names(stmt.value):
                return False
            entries = True
    return bound and entries
