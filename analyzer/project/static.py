"""Facts that need the project's values but not the sync dataflow.

* sync controls called on the module inside a wrapper, not the wrapper (SC104): in unwrapped.py;
* ``accelerator.accumulate`` on an Accelerator never told how many steps to accumulate (SC105);
* collectives that only some ranks reach (SC301): in rank_branches.py;
* ``DistributedSampler`` objects whose ``set_epoch`` is never called (SC302).
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project.dead_code import class_never_made, never_runs
from synccheck.analyzer.project.definitions import Function, called_name, is_super_call
from synccheck.analyzer.project.values import Ext, Framework, Loader, Obj, Sampler, Unknown
from synccheck.analyzer.project.traversal import block_nodes, walk, walk_no_defs
# SC104's facts live in unwrapped.py; their names stay importable from here
from synccheck.analyzer.project.unwrapped import (Unwrapped, _binding, _forwards_through, _holds_wrapper,  # noqa: F401
                                                  _is_wrapping_call, _text, _unwrapped_alias, no_sync_on_unwrapped)


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
        # (one of several: ``if args.with_tracking: Accelerator(gradient_accumulation_steps=n, ...)`` /
        # ``else: Accelerator()`` leaves the default run without accumulation)
        if not frameworks or all(v.accumulates != "no" or v in configured or _built_where_one(program, v)
                                 for v in frameworks):
            continue
        if any(not isinstance(v, Framework) for v in receiver):
            continue
        out.append(UnconfiguredAccumulate(module, call, _text(module, call.func.value)))
    return out


def _built_where_one(program, framework) -> bool:
    """Was this Accelerator (built without steps) built where the count of micro-steps is 1: on the
    ``else`` side of ``if cfg.grad_accum_steps > 1:`` (or after that side returned), or in a script
    that sets ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, which ``Accelerator()`` reads?"""
    path, line = framework.site[0], framework.site[1]
    module = program.project.module_at(path)
    if module is None:
        return False
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in module.text:
        return True
    from synccheck.analyzer.project.branches import _count_is_one

    def inside(stmts) -> bool:
        return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in stmts)

    def search(stmts) -> bool:
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.If):
                one, in_body = _count_is_one(stmt.test)
                if one is not None:
                    if inside(stmt.body) and in_body or inside(stmt.orelse) and in_body is False:
                        return True
                    if not in_body and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)) and \
                            not stmt.orelse and inside(stmts[i + 1:]):
                        return True     # ``if n > 1: return Accelerator(gradient_accumulation_steps=n)``
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt) and inside(block) and \
                        search(block):
                    return True
        return False
    return search(module.tree.body)


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
    once: bool = False        # set_epoch is called on it, once, before the epoch loop
    main_only: str = ""       # set_epoch is called on it only under this test of the main rank


# a function that evaluates (``run_test``, ``evaluate``, ``validate``): a sampler it builds is read once
# per call, in whatever order
# (not a pytest function, ``test_distributed_sampler_padding``: a test of the training code)
_EVALUATION_FUNCTION = re.compile(r"(?i)^_*(?:(?:run_|do_)(?:test|eval|evaluate|validate|val|infer|inference|predict)|"
                                  r"eval|evaluate|evaluation|validate|validation|val|infer|inference|predict|test$)(?:_|$)")
# a sampler (or the dataset it samples) named for evaluation: ``val_sampler``, ``DistributedSampler(dataset_test)``,
# ``valsampler``, ``DistributedSampler(valset)``
_EVALUATION = re.compile(r"(?i)(?:^|[^a-z])(?:val|valid|validation|eval|evaluation|test|dev)"
                         r"(?:[^a-z]|$|sampler|loader|set|data)")


def samplers_without_set_epoch(program) -> list:
    values = program.values
    values.project.load_matching("DistributedSampler")
    values.project.load_matching("set_epoch")
    names = {"DistributedSampler"}
    for module in program.project.modules():
        for local, (mod, attr, _) in module.imports.items():
            if attr == "DistributedSampler":
                names.add(local)
        for klass in module.classes.values():
            # ``class ShardAwareSampler(DistributedSampler)``: made by its own name
            if any((b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")).endswith("Sampler")
                   for b in klass.node.bases) and any(
                    base.rpartition(".")[2] == "DistributedSampler" for base in program.project.external_bases(klass)):
                if _seeded_by_set_epoch(klass):
                    names.add(klass.node.name)
    # ``sampler_cls = RandomSampler if args.local_rank == -1 else DistributedSampler``, called later
    for module in program.project.modules():
        if "Sampler" in module.text:
            names |= _class_aliases(module.tree, names)
    made = []
    for name in sorted(names):
        for scope, call in values.calls(name):
            module = values.module_of(scope)
            for v in values.expr(call, scope):
                if isinstance(v, Sampler) and not v.shuffle_off:
                    made.append((module, call, v, scope))
    if not made:
        return []
    seeded, unknown, once = set(), False, set()
    main_only: dict = {}        # sampler -> the rank test its only set_epoch calls are under
    checker = None
    for scope, call in values.calls("set_epoch"):
        if not isinstance(call.func, ast.Attribute):
            continue
        last = _last_name(call.func.value)
        if _DATASET.search(last) and "sampler" not in last.lower():
            continue        # ``train_loader.dataset.set_epoch(epoch)``: a dataset's hook, not the sampler's
        if never_runs(program, scope) and not (class_never_made(program, scope) and any(
                isinstance(s, Function) and s.cls is scope.cls for *_, s in made)):
            # ``set_epoch`` in a hook nothing calls, or a hook class nothing registers (a class that
            # makes its sampler and reseeds it is one piece: made by a script out of view, or by nobody)
            continue
        receiver = values.expr(call.func.value, scope)
        if _once_before_the_loop(scope, call):
            once |= {v for v in receiver if isinstance(v, Sampler)}
            continue
        if checker is None:
            from synccheck.analyzer.project.rank_branches import _RankChecker
            checker = _RankChecker(program)
        test = _main_rank_test(checker, scope, call)
        if test is not None:
            # ``if is_main: pbar = tqdm(...); sampler.set_epoch(epoch)``: the other ranks never reseed
            for v in receiver:
                if isinstance(v, Sampler):
                    main_only.setdefault(v, test)
            continue
        for v in receiver:
            if isinstance(v, Sampler):
                seeded.add(v)
            elif isinstance(v, (Unknown, Obj, Ext)):
                unknown = True
    # ``self.sampler.epoch = epoch``: what set_epoch does, written by hand
    for scope, receiver in _epoch_stores(program):
        for v in values.expr(receiver, scope):
            if isinstance(v, Sampler):
                seeded.add(v)
    # ``getattr(loader.sampler, "set_epoch", lambda e: None)(epoch)``: called by a name in a string
    unknown = unknown or any(_SET_EPOCH_BY_NAME.search(m.text) for m in program.project.linted())
    if unknown:
        return []
    prepared = _prepared_loaders(program)
    out = []
    epoch_loop = None         # asked once: nothing below parses or reads a file
    for module, call, sampler, scope in made:
        if not module.linted or sampler in seeded or sampler in prepared or _seeded_by_epoch(call):
            continue
        if epoch_loop is None:
            epoch_loop = _has_epoch_loop(program)
        if not epoch_loop:
            continue
        name = _assigned_name(module, call)
        where = scope.node.name if isinstance(scope, Function) else ""
        if _EVALUATION.search(f"{name} {_text(module, call.args[0]) if call.args else ''}") or \
                _EVALUATION_FUNCTION.search(where):
            continue    # an evaluation pass gives the same metrics in any order
        out.append(UnseededSampler(module, call, name, sampler in once, main_only.get(sampler, "")))
    return out


def _main_rank_test(checker, scope, call) -> Optional[str]:
    """The test of the ``if`` around ``call`` (in its function) whose side it is on only the main rank
    takes (``if is_main:``, the ``else`` of ``if rank != 0:``), as written; None otherwise."""
    node = getattr(scope, "node", None)
    if node is None:
        return None
    line = call.lineno
    for n in ast.walk(node):
        if not isinstance(n, ast.If) or not (n.lineno <= line <= (n.end_lineno or n.lineno)):
            continue
        in_body = any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in n.body)
        in_else = any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in n.orelse)
        if not (in_body or in_else):
            continue
        on_true, on_false = checker.sides(n.test, scope)
        if (on_true if in_body else on_false) == "main":
            return ast.unparse(n.test) if in_body else f"not ({ast.unparse(n.test)})"
    return None


def _seeded_by_set_epoch(klass) -> bool:
    """A DistributedSampler subclass whose order the epoch set by ``set_epoch`` seeds: it keeps the
    base's ``__iter__``, or its own calls ``super().__iter__()`` or reads ``self.epoch``. One that bumps
    ``self.epoch`` itself on every pass (``self.epoch += 1`` outside ``set_epoch``) reshuffles without
    it, and one with an order of its own that no epoch seeds needs none."""
    iterate = klass.methods.get("__iter__")
    if iterate is None:
        return True
    for method in klass.methods.values():
        if method.node.name == "set_epoch":
            continue
        for node in ast.walk(method.node):
            if isinstance(node, ast.AugAssign) and _is_self_epoch(node.target) or (
                    method is iterate and isinstance(node, ast.Assign) and any(map(_is_self_epoch, node.targets))):
                return False
    return any(_is_self_epoch(node) or is_super_call(node, "__iter__") for node in ast.walk(iterate.node))


def _is_self_epoch(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "epoch" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _once_before_the_loop(scope, call) -> bool:
    """``sampler.set_epoch(start_epoch)`` before the function's epoch loop, in no loop itself: every
    later epoch replays that one order. (A helper with no loop, called each epoch, is not this.)"""
    node = getattr(scope, "node", None)
    if node is None or not hasattr(node, "body"):
        return False
    # an epoch loop: a count over epochs (``for epoch in range(start_epoch, epochs)``); a function
    # that runs one epoch, ``set_epoch(epoch)`` then ``for batch in loader:``, sets it for that epoch
    loops = [n for n in ast.walk(node) if isinstance(n, (ast.For, ast.AsyncFor)) and isinstance(n.iter, ast.Call)
             and called_name(n.iter) in ("range", "trange", "tqdm") and "epoch" in ast.unparse(n.iter).lower()]
    if not loops:
        return False
    return not any(loop.lineno <= call.lineno <= (loop.end_lineno or loop.lineno) for loop in loops)


_DATASET = re.compile(r"dataset|^ds$|_ds$", re.IGNORECASE)


def _last_name(node) -> str:
    """``train_loader.dataset`` -> ``dataset``; ``train_set`` -> ``train_set``."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


_SET_EPOCH_BY_NAME = re.compile(r"getattr\([^)\n]*[\"']set_epoch[\"']")


def _seeded_by_epoch(call) -> bool:
    """``DistributedSampler(ds, seed=args.seed + epoch)``: a sampler made afresh each epoch, whose seed
    the epoch moves, shuffles differently every epoch without set_epoch."""
    return any(kw.arg == "seed" and any(isinstance(n, ast.Name) and "epoch" in n.id.lower() for n in ast.walk(kw.value))
               for kw in call.keywords)


def _class_aliases(tree, names: set) -> set:
    """Names bound to one of ``names`` as a class (not called), alone or as a branch of a conditional."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            options = (value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,)
            if any(not isinstance(o, ast.Call) and called_name(o) in names for o in options):
                out.add(node.targets[0].id)
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


_EPOCH_LOOP = re.compile(r"^[ \t]*(?:(?:async[ \t]+)?for[ \t]+[\w, ()]*epoch\w*[\w, ()]*[ \t]+in[ \t]|"
                         r"while[ \t][^\n:]*epoch[^\n:]*[<>][^\n]*:)", re.M | re.I)


def _epoch_stores(program) -> list:
    """(scope, receiver) of each ``receiver.epoch = ...`` in a function of a parsed module."""
    out = []
    for module in program.project.modules():
        if ".epoch =" not in module.text:
            continue
        for fn in module.functions.values():
            for node in walk_no_defs(fn.node):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "epoch"
                                                        for t in node.targets):
                    out.extend((fn, t.value) for t in node.targets
                               if isinstance(t, ast.Attribute) and t.attr == "epoch")
    return out


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
                # (``for epoch in ...``; ``while self._epoch < self._max_epochs:``, mmcv's runner)
                target = ast.unparse(node.target) if isinstance(node, ast.For) else ast.unparse(node.test)
                if "epoch" in target.lower():
                    return True
                if any(isinstance(n, (ast.For, ast.While)) for b in node.body for n in block_nodes(b)) and \
                        _counts(node, module) and _TRAINS.search(module.segment(node) or ""):
                    # (a loop that trains, or yields batches: not a dataset's ``while len(pick) < n: for sub in ...``)
                    return True
                if _refills_an_iterator(node):
                    return True
    return False


_TRAINS = re.compile(r"backward\(|\.step\(|train|fit\(|run_epoch|epoch|yield")


def _refills_an_iterator(loop) -> bool:
    """``except StopIteration: data_iter = iter(train_loader)`` inside an iteration-based loop: each new
    pass over the data is an epoch."""
    # (or ``while True: yield from loader``, an endless generator of batches: each pass is an epoch)
    return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
               and n.value.func.id == "iter" and n.value.args or isinstance(loop, ast.While) and isinstance(n, ast.YieldFrom)
               for n in walk(loop))


def _counts(loop, module) -> bool:
    """A loop that may run epochs: ``while``, or ``for`` over a count (``range(n)``, ``itertools.count()``,
    ``tqdm(range(n))``, a name bound to one: ``train_iterator = trange(...)``). One over data (``for
    batch in loader: for img in batch:``) runs a single pass."""
    if isinstance(loop, ast.While):
        return True
    it = loop.iter
    if isinstance(it, ast.Name):
        return re.search(r"^[ \t]*" + re.escape(it.id) + r"[ \t]*=[ \t]*(?:[\w.]*\.)?(?:trange|range|count|tqdm[ \t]*\([ \t]*range)\b",
                         module.text, re.M) is not None
    while isinstance(it, ast.Call) and it.args and called_name(it) in ("tqdm", "trange", "enumerate"):
        if called_name(it) == "trange":
            return True
        it = it.args[0]
    return isinstance(it, ast.Call) and called_name(it) in ("range", "count", "trange")


def _assigned_name(module, call) -> str:
    for node in walk(module.tree):
        if isinstance(node, ast.Assign) and (node.value is call or isinstance(node.value, (ast.IfExp, ast.BoolOp)) and
                                             any(sub is call for sub in ast.walk(node.value))):
            # (``val_sampler = DistributedSampler(valset) if distributed else None`` too)
            return ast.unparse(node.targets[0])
    return "the sampler"



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


def accelerate_static_graph_accumulation(program) -> list:
    """``Accelerator(gradient_accumulation_steps=n, kwargs_handlers=[DistributedDataParallelKwargs(
    static_graph=True)])`` with ``accelerator.accumulate(model)``: accelerate runs the micro-steps off
    the boundary under ``no_sync``, the very first one included (SC106; accelerate#3679)."""
    values = program.values
    out = []
    for scope, call in values.calls("Accelerator"):
        module = values.module_of(scope)
        if not module.linted or ".accumulate(" not in module.text:
            continue
        callee = values.expr(call.func, scope)
        if not any(isinstance(v, Ext) and v.qualname.startswith("accelerate") for v in callee):
            continue
        info = values.info(scope)
        accumulate = _keyword_argument(call, "gradient_accumulation_steps", info)
        if accumulate is None or (isinstance(accumulate, ast.Constant) and accumulate.value in (0, 1, None)):
            continue
        for node in _handlers(_keyword_argument(call, "kwargs_handlers", info), info):
            if called_name(node) == "DistributedDataParallelKwargs" and any(
                    k.arg == "static_graph" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords):
                # reported where the micro-steps go under no_sync: the ``accumulate(...)`` of this file
                entered = sorted((c for s, c in values.calls("accumulate") if values.module_of(s) is module),
                                 key=lambda c: (c.lineno, c.col_offset))
                out.append(LightningStaticGraph(module, entered[0] if entered else node, call))
                break
    return out


def _handlers(node, info, depth: int = 0) -> list:
    """The calls a ``kwargs_handlers=`` list holds, through names bound once in the function."""
    if node is None or depth > 3:
        return []
    if isinstance(node, (ast.List, ast.Tuple)):
        return [c for e in node.elts for c in _handlers(e, info, depth + 1)]
    if isinstance(node, ast.Call):
        return [node]
    if isinstance(node, ast.Name):
        return [c for value, path in info.assigns.get(node.id, ()) if not path
                for c in _handlers(value, info, depth + 1)]
    return []


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
        if called_name(node) == "DDPStrategy":
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
