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
"""
from __future__ import annotations

import ast
import bisect
import re
import builtins
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.index import (Class, External, Function, GlobalRef, Module, ModuleRef, Project,
                                              qualified_name)
from synccheck.analyzer.project.scopes import scope_info

MAX_VALUES = 24
MAX_CALLERS = 120
MAX_DEPTH = 48            # values being computed at once (a chain of parameters, returns, attributes)
MAX_WORK = 200_000        # values computed per project: past it, what is not known is unknown
MAX_REDONE = 20_000        # past it, values seen inside a cycle are kept as they were then
MAX_PARAM_DEPTH = 5       # parameters followed to their callers' arguments at once
_BUILTINS = frozenset(dir(builtins))


# ---------------------------------------------------------------------------------------------------
# Values. Small named tuples: hashable, compared by what they are.

class Wrapper(NamedTuple):
    kind: str                 # ddp, fsdp, fsdp2, accelerate, fabric, deepspeed
    site: tuple               # (path, line, column[, argument index])
    static_graph: bool = False
    single: bool = False      # Fabric(devices=1): one process, nothing to synchronize


class Obj(NamedTuple):
    """An object we know only by where it came from (``Net()``, a parameter nobody passes)."""
    site: tuple


class Inner(NamedTuple):
    """``wrapper.module``: the module inside a wrapper."""
    wrapper: Wrapper


class Optim(NamedTuple):
    site: tuple
    managed: bool = False     # accelerate / DeepSpeed: zero_grad and step do nothing off the boundary


class Framework(NamedTuple):
    kind: str                 # accelerate | fabric
    site: tuple
    accumulates: str          # "yes" | "no" | "unknown": was it given gradient_accumulation_steps?
    single: bool = False


class Scaler(NamedTuple):
    site: tuple


class NativeScaler(NamedTuple):
    """timm's ``NativeScaler``: ``loss_scaler(loss, optimizer)`` runs backward and step."""
    site: tuple


class Sampler(NamedTuple):
    site: tuple
    shuffle_off: bool = False


class Loader(NamedTuple):
    site: tuple


class Ctx(NamedTuple):
    """A context manager that matters to sync: ``model.no_sync()``, ``accelerator.accumulate(model)``,
    ``fabric.no_backward_sync(model, enabled=...)``, ``nullcontext()``, an ``ExitStack``."""
    effect: str               # off | managed | null | exitstack | accumulator
    site: tuple
    how: str = ""


class CtxFactory(NamedTuple):
    """``model.no_sync`` not yet called: the callable form of a sync control."""
    effect: str
    site: tuple
    how: str = ""


class Func(NamedTuple):
    fn: Function


class Bound(NamedTuple):
    fn: Function
    receiver: object          # the value the method was looked up on


class Cls(NamedTuple):
    cls: Class


class Inst(NamedTuple):
    cls: Class


class Partial(NamedTuple):
    site: tuple


class Mod(NamedTuple):
    module: Module


class Ext(NamedTuple):
    qualname: str


class Tup(NamedTuple):
    items: tuple              # of frozensets


class Bag(NamedTuple):
    """A list, set or dict whose elements we know but not their order: ``[unet]`` grown by
    ``append``, ``{"g": opt_g, "d": opt_d}``, ``[opts[k] for k in opts]``."""
    items: frozenset
    keyed: bool = False       # a dict: iterating it gives its keys, not these
    fields: tuple = ()        # a dict literal with string keys: ((key, values), ...)

    def item(self, key) -> frozenset:
        """``bag["key"]``: that entry's values when the dict literal named it, else any element."""
        if self.fields and isinstance(key, str):
            return next((vals for k, vals in self.fields if k == key), ONE_UNKNOWN)
        return self.items


class Const(NamedTuple):
    value: object


class Accumulator(NamedTuple):
    """synccheck.runtime.GradientAccumulator: syncs exactly at the boundary."""
    site: tuple


class LocalSGD(NamedTuple):
    site: tuple


class Unknown(NamedTuple):
    pass


UNKNOWN = Unknown()
EMPTY: frozenset = frozenset()
ONE_UNKNOWN = frozenset((UNKNOWN,))


def site_of(module: Module, node, extra=None) -> tuple:
    base = (module.path, getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
    return base + (extra,) if extra is not None else base


def _cap(values) -> frozenset:
    values = frozenset(values)
    if len(values) > MAX_VALUES:
        keep = sorted(values, key=lambda v: (isinstance(v, (Obj, Unknown, Const)), repr(v)))[:MAX_VALUES]
        return frozenset(keep)
    return values


# ---------------------------------------------------------------------------------------------------

class Values:
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
        evaluated must not stay without the wrapper); asked again afterwards, it is computed afresh.
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
        if pending and self.redone < MAX_REDONE:
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
        if sym is not None and not isinstance(sym, GlobalRef):
            out |= self.symbol(sym)
        if not out:
            # a builtin, or a name bound somewhere we cannot see (a notebook's other cell, exec):
            # the latter is still one object wherever it is used
            out.add(Ext(name) if name in _BUILTINS else Obj((module.path, "<free>", name)))
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
        if name in fn.nested:
            out.add(Func(fn.nested[name]))
        out = self._grown(name, out, info, fn)
        for ctx_expr in info.with_as.get(name, ()):
            out |= self.entered(self.expr(ctx_expr, fn))
        if name in info.for_names:
            out |= self._iterated(name, info, fn)
        if name in fn.module.imports and not out:
            sym = self.project.resolve(fn.module, name)
            if sym is not None:
                out |= self.symbol(sym)
        return frozenset(out) or ONE_UNKNOWN

    def _grown(self, name: str, out: set, info, scope) -> set:
        """A list or dict the scope fills in place (``models.append(unet)``, ``opts["g"] = opt``)
        holds what was put in it too."""
        added = [value for value in info.item_stores.get(name, ())]
        spread = []
        for call in info.calls:
            func = call.func
            if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == name:
                if func.attr in ("append", "add") and call.args:
                    added.append(call.args[0])
                elif func.attr in ("insert", "setdefault") and len(call.args) > 1:
                    added.append(call.args[1])
                elif func.attr in ("extend", "update") and call.args:
                    spread.append(call.args[0])
        if not added and not spread:
            return out
        items, keyed, rest = set(), False, set()
        for v in out:
            if isinstance(v, Tup):
                items.update(x for part in v.items for x in part)
            elif isinstance(v, Bag):
                items |= v.items
                keyed = keyed or v.keyed
            else:
                rest.add(v)
        if len(rest) == len(out):
            return out
        for node in added:
            items |= self.expr(node, scope)
        for node in spread:
            items |= self.elements(self.expr(node, scope), values_of_dict=True)
        return rest | {Bag(_cap(items), keyed)}

    def _iterated(self, name: str, info, scope) -> frozenset:
        """What ``for name in expr`` binds: the elements of a list or tuple we know, else unknown."""
        out = set()
        for node, path in info.fors.get(name, ()):
            out |= self.unpack(self.iteration(node, scope), path, node, scope)
        return frozenset(out) or ONE_UNKNOWN

    def iteration(self, node, scope) -> frozenset:
        """The values one turn of ``for x in node`` gives ``x``."""
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id == "enumerate":
                return frozenset((Tup((ONE_UNKNOWN, self.iteration(node.args[0], scope))),))
            if isinstance(func, ast.Name) and func.id == "zip":
                return frozenset((Tup(tuple(self.iteration(a, scope) for a in node.args)),))
            if isinstance(func, ast.Name) and func.id in ("list", "tuple", "reversed", "sorted", "iter"):
                return self.iteration(node.args[0], scope)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            if node.func.attr == "values":
                return self.elements(self.expr(node.func.value, scope), values_of_dict=True)
            if node.func.attr == "items":
                return frozenset((Tup((ONE_UNKNOWN, self.elements(self.expr(node.func.value, scope),
                                                                   values_of_dict=True))),))
        return self.elements(self.expr(node, scope))

    @staticmethod
    def elements(values: frozenset, values_of_dict: bool = False) -> frozenset:
        out = set()
        for v in values:
            if isinstance(v, Tup):
                out.update(x for part in v.items for x in part)
            elif isinstance(v, Bag) and (values_of_dict or not v.keyed):
                out |= v.items
            else:
                out.add(UNKNOWN)
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

    # -- parameters ----------------------------------------------------------------------------------
    def parameter(self, fn: Function, name: str) -> frozenset:
        return self._memoized(("param", fn.uid, name), lambda: self._parameter(fn, name))

    def _param_depth(self) -> int:
        return sum(1 for k in self._busy if k[0] == "param")

    def _parameter(self, fn: Function, name: str) -> frozenset:
        index = fn.params.index(name)
        node = fn.node
        if fn.is_method and index == 0:
            if any(_deco(d) == "classmethod" for d in node.decorator_list):
                return frozenset(Cls(k) for k in self.project.subclasses(fn.cls))
            return frozenset(Inst(k) for k in self.project.subclasses(fn.cls))
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
            elif default is None:
                out.add(UNKNOWN)
        if not callers:
            out.add(Obj((fn.module.path, node.lineno, node.col_offset, name)))
        return frozenset(out)

    def _annotation(self, fn: Function, name: str) -> frozenset:
        """``model: DDP`` / ``model: DistributedDataParallel``: a wrapper whoever calls."""
        for arg in fn.node.args.posonlyargs + fn.node.args.args + fn.node.args.kwonlyargs:
            if arg.arg == name and arg.annotation is not None:
                sym = self.project.resolve_expr(fn.module, arg.annotation)
                kind = vocab.wrapper_kind(qualified_name(sym)) if sym is not None else ""
                if kind:
                    return frozenset((Wrapper(kind, site_of(fn.module, arg)),))
        return EMPTY

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
                lines = _call_lines(module).get(name)
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
            # ``Sub(...)`` runs Base.__init__ when Sub does not define its own
            names = [k.node.name for k in self.project.subclasses(fn.cls)
                     if self.project.attribute(k, "__init__") is fn]
        # the callers are in its own module and in the modules that import it
        self.project.importers(fn.module, tuple(names))
        candidates = [c for n in names for c in self.calls(n)]
        if fn.cls is not None and fn.node.name == "__call__":
            candidates = []        # called through an instance under any name: no parameter values from calls
        out = []
        if len(candidates) <= MAX_CALLERS:
            for scope, call in candidates:
                for v in self.expr(call.func, scope):
                    shift = self._binds(v, fn)
                    if shift is not None:
                        out.append((scope, call, shift))
                        break
        self._plain[key] = tuple(out)
        return self._plain[key]

    def _binds(self, v, fn: Function) -> Optional[int]:
        if isinstance(v, Func) and v.fn is fn:
            return 1 if fn.is_method else 0      # Class.method(obj, ...) passes self explicitly
        if isinstance(v, Bound) and v.fn is fn:
            return 1
        if isinstance(v, Cls) and fn.node.name == "__init__" and fn.cls in self.project.mro(v.cls):
            return 1
        return None if not isinstance(v, Func) else None

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

    def unpack(self, values: frozenset, path: tuple, value_node, scope) -> frozenset:
        for index in path:
            out = set()
            for v in values:
                if isinstance(v, Tup) and index < len(v.items):
                    out |= v.items[index]
                elif isinstance(v, Obj):
                    # ``text_encoder, vae, unet = load(...)``: still one object each, known by its place
                    out.add(Obj(v.site + (f"[{index}]",)))
                else:
                    out.add(UNKNOWN)
            values = frozenset(out)
        return values

    def attribute(self, receivers: frozenset, attr: str, node, scope) -> frozenset:
        out = set()
        for v in receivers:
            if isinstance(v, (Mod, Ext, Cls)):
                sym = self.project.attribute(v.module if False else _symbol_of(v), attr)
                out |= self.symbol(sym) if sym is not None else (
                    {Ext(f"{v.qualname}.{attr}")} if isinstance(v, Ext) else {UNKNOWN})
            elif isinstance(v, Inst):
                out |= self.instance_attribute(v, attr)
            elif isinstance(v, Wrapper):
                if attr == "module":
                    out.add(Inner(v))
                elif attr == "no_sync":
                    out.add(CtxFactory("off", site_of(self.module_of(scope), node), "no_sync"))
                    self.sites[site_of(self.module_of(scope), node)] = (node.value, scope)
                else:
                    out.add(UNKNOWN)
            elif isinstance(v, Loader) and attr in ("sampler", "batch_sampler"):
                out |= self.loader_samplers(v)
            elif isinstance(v, (Obj, Unknown)) and attr == "no_sync":
                out.add(CtxFactory("off", site_of(self.module_of(scope), node), "no_sync"))
                self.sites[site_of(self.module_of(scope), node)] = (node.value, scope)
            else:
                out.add(UNKNOWN)
        return frozenset(out)

    def instance_attribute(self, inst: Inst, attr: str) -> frozenset:
        return self._memoized(("iattr", inst.cls.uid, attr), lambda: self._instance_attribute(inst, attr))

    def _instance_attribute(self, inst: Inst, attr: str) -> frozenset:
        out = set()
        for klass in self.project.mro(inst.cls):
            if attr in klass.methods:
                return frozenset((Bound(klass.methods[attr], inst),))
            for scope, value, path in _class_attrs(self, klass).get(attr, ()):
                out |= self.unpack(self.expr(value, scope), path, value, scope)
        # stores from outside: ``trainer.model = DDP(...)``
        for scope, receiver, value, path in self._outside_stores(attr):
            if inst in self.expr(receiver, scope):
                out |= self.unpack(self.expr(value, scope), path, value, scope)
        return frozenset(out) or ONE_UNKNOWN

    def _outside_stores(self, attr: str) -> list:
        """``obj.attr = value`` outside the class's own methods, in the parsed modules."""
        stores = self._plain.setdefault(("stores",), {})
        done = self._plain.setdefault(("stores-done",), set())
        for module in self.project.modules():
            if module.path in done:
                continue
            done.add(module.path)
            if not _OUTSIDE_STORE.search(module.text):
                continue
            for scope in [module] + list(module.functions.values()):
                if isinstance(scope, Function) and not _OUTSIDE_STORE.search(module.segment(scope.node)):
                    continue
                for receiver, a, value, path in self.info(scope).obj_attrs:
                    stores.setdefault(a, []).append((scope, receiver, value, path))
        return stores.get(attr, [])

    def loader_samplers(self, loader: Loader) -> frozenset:
        call, scope = self.sites.get(loader.site, (None, None))
        if call is None:
            return ONE_UNKNOWN
        out = set()
        for kw in call.keywords:
            if kw.arg in ("sampler", "batch_sampler"):
                out |= {v for v in self.expr(kw.value, scope) if isinstance(v, (Sampler, Unknown, Obj))}
        if len(call.args) >= 3:          # DataLoader(dataset, batch_size, shuffle, sampler, ...)
            pass
        return frozenset(out) or EMPTY

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
        out = set()
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
                return frozenset(out) or ONE_UNKNOWN
        for callee in callees:
            out |= self._call_value(callee, call, scope, module)
        return frozenset(out) or ONE_UNKNOWN

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
            return self.returns(callee.fn)
        if isinstance(callee, Cls):
            qual = qualified_name(callee.cls)
            ext = self.project.external_bases(callee.cls)
            # a project class deriving from a wrapper or an optimizer is one (its own code is read
            # where it matters: a project's NativeScaler copy is analysed, not assumed)
            for base in ext + [qual]:
                kind = vocab.wrapper_kind(base)
                if kind:
                    self.sites[site] = (call.args[0] if call.args else None, scope)
                    return frozenset((Wrapper(kind, site),))
                if vocab.is_optimizer_class(base) and base.startswith("torch.optim"):
                    self.sites[site] = (call.args[0] if call.args else None, scope)
                    return frozenset((Optim(site),))
            return frozenset((Inst(callee.cls),))
        if isinstance(callee, Inst):
            method = self.project.attribute(callee.cls, "__call__")
            return self.returns(method) if isinstance(method, Function) else ONE_UNKNOWN
        if isinstance(callee, CtxFactory):
            return frozenset((Ctx(callee.effect, callee.site, callee.how + "()"),))
        if isinstance(callee, Partial):
            return ONE_UNKNOWN
        return frozenset((Obj(site),))

    def _external_call(self, qual: str, call: ast.Call, scope, module, site) -> frozenset:
        kind = vocab.wrapper_kind(qual)
        last = vocab.tail(qual)
        if kind == "deepspeed":
            return frozenset((Tup((frozenset((Wrapper("deepspeed", site),)), frozenset((Optim(site, True),)),
                                   ONE_UNKNOWN, ONE_UNKNOWN)),))
        if kind:
            self.sites[site] = (_first_arg(call, "module"), scope)
            static = any(kw.arg == "static_graph" and _truthy(kw.value) for kw in call.keywords)
            return frozenset((Wrapper(kind, site, static),))
        if qual in vocab.ACCELERATOR:
            return frozenset((Framework("accelerate", site, _accumulates(call)),))
        if qual in vocab.FABRIC:
            return frozenset((Framework("fabric", site, "no", _single_device(call)),))
        if last in vocab.SCALER_TAILS:
            return frozenset((Scaler(site),))
        if last in vocab.NATIVE_SCALER_TAILS:
            return frozenset((NativeScaler(site),))
        if last in vocab.SAMPLER_TAILS:
            shuffle = next((kw.value for kw in call.keywords if kw.arg == "shuffle"), None)
            return frozenset((Sampler(site, isinstance(shuffle, ast.Constant) and shuffle.value is False),))
        if last in vocab.LOADER_TAILS:
            self.sites[site] = (call, scope)
            return frozenset((Loader(site),))
        if last in ("nullcontext", "suppress") and qual.startswith("contextlib"):
            return frozenset((Ctx("null", site),))
        if last == "ExitStack":
            return frozenset((Ctx("exitstack", site),))
        if qual in ("functools.partial", "partial"):
            self.sites[site] = (call, scope)
            return frozenset((Partial(site),))
        if qual in ("torch.compile", "torch.jit.script", "torch.nn.SyncBatchNorm.convert_sync_batchnorm",
                    "copy.deepcopy") and call.args:
            return self.expr(call.args[0], scope)
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

    def _prepare(self, call, attr: str, scope, module) -> frozenset:
        items = []
        for i, arg in enumerate(call.args):
            values = self.expr(arg, scope)
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
                items.append(frozenset((Wrapper("accelerate", site),)))
        if len(items) == 1:
            return items[0]
        return frozenset((Tup(tuple(items)),))

    def _fabric_setup(self, call, attr: str, receiver, scope, module) -> frozenset:
        single = any(isinstance(v, Framework) and v.single for v in receiver)
        items = []
        for i, arg in enumerate(call.args):
            site = site_of(module, call, i)
            if attr == "setup_optimizers" or (attr == "setup" and i > 0):
                self.sites[site] = (None, scope)
                items.append(frozenset((Optim(site),)))
            else:
                self.sites[site] = (arg, scope)
                items.append(frozenset((Wrapper("fabric", site, single=single),)))
        return items[0] if len(items) == 1 else frozenset((Tup(tuple(items)),))

    def _unwrap(self, values: frozenset) -> frozenset:
        out = set()
        for v in values:
            out.add(Inner(v) if isinstance(v, Wrapper) else v)
        return frozenset(out)

    def returns(self, fn: Function) -> frozenset:
        return self._memoized(("returns", fn.uid), lambda: self._returns(fn))

    def _returns(self, fn: Function) -> frozenset:
        info = self.info(fn)
        if not info.returns:
            return frozenset((Const(None),))
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


# ---------------------------------------------------------------------------------------------------
# helpers

# ``obj.attr = value`` (or ``a.b.attr = value``) where obj is not ``self``: a store from outside a class
_OUTSIDE_STORE = re.compile(r"(?<![\w.])(?!self\.\w+[ \t]*=)[A-Za-z_]\w*(?:\.\w+)+[ \t]*(?:=(?!=)|,)")


def _calls_named(module: Module, name: str, lines: list) -> list:
    """The calls of ``name`` in a module, with the scope (function or module) each is in: a walk that
    enters only the nodes that span one of ``lines`` (where the text says ``name(``), so a big
    module costs what its matches cost."""
    scopes = {id(fn.node): fn for fn in module.functions.values()}
    out = []
    stack = [(module.tree, module)]
    while stack:
        node, scope = stack.pop()
        for child in ast.iter_child_nodes(node):
            first = getattr(child, "lineno", None)
            if first is not None:
                decorators = getattr(child, "decorator_list", None)
                if decorators:
                    first = min(first, min(d.lineno for d in decorators))
                i = bisect.bisect_left(lines, first)
                if i == len(lines) or lines[i] > child.end_lineno:
                    continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((child, scopes.get(id(child), scope)))
                continue
            if isinstance(child, ast.Call):
                func = child.func
                key = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
                if key == name:
                    out.append((scope, child))
            stack.append((child, scope))
    out.reverse()
    return out


# ``name(`` in source text: a call of name (or its def), found without a parse
CALL_WORD = re.compile(r"([A-Za-z_]\w*)\s*\(")


def _call_lines(module: Module) -> dict:
    """name -> sorted line numbers where the module's text says ``name(``: one scan of the text."""
    table = getattr(module, "_call_lines", None)
    if table is None:
        text = module.text
        starts = [0]
        find = text.find
        i = find("\n")
        while i != -1:
            starts.append(i + 1)
            i = find("\n", i + 1)
        table = {}
        line, nxt = 1, (starts[1] if len(starts) > 1 else len(text) + 1)
        for m in CALL_WORD.finditer(text):
            at = m.start()
            if at >= nxt:
                line = bisect.bisect_right(starts, at)
                nxt = starts[line] if line < len(starts) else len(text) + 1
            bucket = table.setdefault(m.group(1), [])
            if not bucket or bucket[-1] != line:
                bucket.append(line)
        module._call_lines = table
    return table


def _strings(node, info, depth: int = 0) -> list:
    """The string constants an expression can be: a literal, a conditional of literals, or a local
    name bound only to those."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.IfExp):
        body, orelse = _strings(node.body, info, depth), _strings(node.orelse, info, depth)
        return body + orelse if body and orelse else []
    if isinstance(node, ast.Name) and depth < 3 and node.id in info.assigns and node.id not in info.for_names:
        out = []
        for value, path in info.assigns[node.id]:
            found = _strings(value, info, depth + 1) if not path else []
            if not found:
                return []
            out.extend(found)
        return out
    return []


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _arithmetic(op, left: frozenset, right: frozenset) -> frozenset:
    """Integer arithmetic on constants we know (``batch_size // MAX_GPU_BATCH_SIZE``), else unknown."""
    fn = _ARITHMETIC.get(type(op))
    out = set()
    for a in left:
        for b in right:
            if fn is None or not (isinstance(a, Const) and isinstance(b, Const)) or \
                    type(a.value) is not int or type(b.value) is not int or abs(a.value) > 1 << 32 or \
                    abs(b.value) > 1 << 32:
                return ONE_UNKNOWN
            try:
                out.add(Const(fn(a.value, b.value)))
            except ZeroDivisionError:
                return ONE_UNKNOWN
    return _cap(out) if out and len(out) <= 8 else ONE_UNKNOWN


def _reaching(assigns, reach) -> list:
    """The bindings a use can see (``ScopeInfo.reaching``): all of them when ``reach`` is None."""
    if reach is None:
        return list(assigns)
    return [assigns[i] for i in reach[0]]


def _mentions(node, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _class_attrs(values: "Values", klass: Class) -> dict:
    """attr -> [(scope, value, unpack path)] for ``self.attr = value`` in the class's methods and
    ``attr = value`` in its body, indexed once per class."""
    if klass.attrs is None:
        table: dict = {}
        for method in klass.methods.values():
            for attr, items in values.info(method).self_attrs.items():
                table.setdefault(attr, []).extend((method, value, path) for value, path in items)
        for stmt in klass.node.body:
            if isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        table.setdefault(t.id, []).append((klass.module, stmt.value, ()))
        klass.attrs = table
    return klass.attrs


def _symbol_of(v):
    if isinstance(v, Mod):
        return ModuleRef(v.module)
    if isinstance(v, Ext):
        return External(v.qualname)
    if isinstance(v, Cls):
        return v.cls
    return None


def _deco(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def parameter_default(node, name: str):
    """The default expression of parameter ``name`` of a function node, or None."""
    args = node.args
    positional = args.posonlyargs + args.args
    offset = len(positional) - len(args.defaults)
    for i, a in enumerate(positional):
        if a.arg == name:
            return args.defaults[i - offset] if i >= offset else None
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if a.arg == name:
            return d
    return None


def _argument(call: ast.Call, fn: Function, name: str, index: int, shift: int):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    position = index - shift
    positional = []
    for a in call.args:
        if isinstance(a, ast.Starred):
            return None
        positional.append(a)
    if 0 <= position < len(positional) and name not in [a.arg for a in fn.node.args.kwonlyargs]:
        return positional[position]
    return None


def _first_arg(call: ast.Call, keyword: str):
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return _kw(call, keyword)


def _kw(call: ast.Call, keyword: str):
    return next((kw.value for kw in call.keywords if kw.arg == keyword), None)


def _truthy(node) -> bool:
    return not (isinstance(node, ast.Constant) and node.value in (False, None, 0))


def _accumulates(call: ast.Call) -> str:
    names = {kw.arg for kw in call.keywords}
    if "gradient_accumulation_steps" in names or "gradient_accumulation_plugin" in names:
        steps = _kw(call, "gradient_accumulation_steps")
        if isinstance(steps, ast.Constant) and steps.value == 1:
            return "no"
        return "yes"
    if None in names or any(isinstance(a, ast.Starred) for a in call.args):
        return "unknown"       # Accelerator(**kwargs)
    return "no"


def _single_device(call: ast.Call) -> bool:
    devices = _kw(call, "devices")
    strategy = _kw(call, "strategy")
    if isinstance(devices, ast.Constant) and devices.value == 1:
        return True
    if isinstance(strategy, ast.Constant) and strategy.value in ("single_device", "dp"):
        return True
    accelerator = _kw(call, "accelerator")
    return devices is None and isinstance(accelerator, ast.Constant) and accelerator.value == "cpu"


def _named(node, words: tuple) -> bool:
    """Does the name (or the called function's name: ``build_optimizer(model)``) say what it is?"""
    if isinstance(node, ast.Call):
        node = node.func
    text = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    text = text.lower()
    return any(w in text for w in words)


def _text(module: Module, node) -> str:
    return module.segment(node)


def _parameter_sources(arg, scope, values: Values, depth: int = 0) -> list:
    """The receivers of ``.parameters()`` / ``.named_parameters()`` in an optimizer's first argument,
    following a local name to its assignments once or twice (``params = model.parameters()``)."""
    out = []
    for node in ast.walk(arg):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("parameters", "named_parameters"):
            receiver = node.func.value
            if isinstance(receiver, ast.Attribute) and receiver.attr == "module":
                receiver = receiver.value
            out.append(receiver)
        elif isinstance(node, ast.Name) and depth < 2 and isinstance(scope, Function):
            for value, _ in values.info(scope).assigns.get(node.id, ()):
                out.extend(_parameter_sources(value, scope, values, depth + 1))
    return out
