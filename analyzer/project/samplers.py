"""``DistributedSampler`` objects whose ``set_epoch`` is never called (SC302): where each is built, what
seeds it, and whether the program loops over epochs."""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project.dead_code import class_never_made, never_runs
from synccheck.analyzer.project.definitions import Function, called_name, is_super_call
from synccheck.analyzer.project.traversal import block_nodes, walk, walk_no_defs
from synccheck.analyzer.project.unwrapped import _text
from synccheck.analyzer.project.values import Ext, Framework, Loader, Obj, Sampler, Unknown


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
    parsed_before = set(map(id, program.project.modules()))
    _follow_loaders(program)
    # (the files parsed only to follow the loaders are not where the program loops over epochs)
    followed = {id(m) for m in program.project.modules()} - parsed_before
    made = []
    for name in sorted(names):
        for scope, call in values.calls(name):
            module = values.module_of(scope)
            for v in values.expr(call, scope):
                if isinstance(v, Sampler) and not v.shuffle_off:
                    made.append((module, call, v, scope))
    if not made:
        return []
    seeded: dict = {}           # sampler -> the modules whose set_epoch calls reseed it
    unknown = False
    once: dict = {}             # sampler -> the modules that set its epoch once, before the epoch loop
    main_only: dict = {}        # sampler -> (the rank test its only set_epoch calls are under, module)
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
            for v in receiver:
                if isinstance(v, Sampler):
                    once.setdefault(v, set()).add(values.module_of(scope))
            continue
        if checker is None:
            from synccheck.analyzer.project.rank_branches import _RankChecker
            checker = _RankChecker(program)
        test = _main_rank_test(checker, scope, call)
        if test is not None:
            # ``if is_main: pbar = tqdm(...); sampler.set_epoch(epoch)``: the other ranks never reseed
            for v in receiver:
                if isinstance(v, Sampler):
                    main_only.setdefault(v, (test, values.module_of(scope)))
            continue
        for v in receiver:
            if isinstance(v, Sampler):
                seeded.setdefault(v, set()).add(values.module_of(scope))
            elif isinstance(v, (Unknown, Obj, Ext)):
                unknown = True
    # ``pre_epoch = sampler.set_epoch`` (a bound method kept and called later, NaviLLM)
    for scope, receiver in _set_epoch_kept(program):
        for v in values.expr(receiver, scope):
            if isinstance(v, Sampler):
                seeded.setdefault(v, set()).add(values.module_of(scope))
    # ``self.sampler.epoch = epoch``: what set_epoch does, written by hand
    for scope, receiver in _epoch_stores(program):
        for v in values.expr(receiver, scope):
            if isinstance(v, Sampler):
                seeded.setdefault(v, set()).add(values.module_of(scope))
    # ``getattr(loader.sampler, "set_epoch", lambda e: None)(epoch)``: called by a name in a string
    unknown = unknown or any(_SET_EPOCH_BY_NAME.search(m.text) for m in program.project.linted())
    if unknown:
        return []
    prepared = _prepared_loaders(program)
    out = []
    epoch_loop = None         # asked once: nothing below parses or reads a file
    for module, call, sampler, scope in made:
        if sampler in prepared or _seeded_by_epoch(call):
            continue
        if module.linted and sampler not in seeded:
            sites = [(module, call, _assigned_name(module, call), scope)]
        elif module.linted and not _builder_shared(module, call, scope):
            continue
        else:
            # built by a builder that several scripts share, or in a file not linted
            # (``train_loader = make_dataloader(...)``, the sampler made two calls away): said where a
            # linted script takes it, unless a set_epoch of the same program reseeds it (not one in
            # another script that shares the builder)
            sites = [site for site in _takers(program, sampler)
                     if not any(m is module or m is site[0] or _import_related(m, site[0])
                                for m in seeded.get(sampler, ())) and
                     _loops_over_epochs(site[0])]
        if not sites:
            continue
        if epoch_loop is None:
            epoch_loop = _has_epoch_loop(program, followed)
        if not epoch_loop:
            continue
        for site_module, node, name, site_scope in sites:
            where = site_scope.node.name if isinstance(site_scope, Function) else ""
            built_on = _text(site_module, node.args[0]) if node is call and call.args else ""
            if _EVALUATION.search(f"{name} {built_on}") or _EVALUATION_FUNCTION.search(where):
                continue    # an evaluation pass gives the same metrics in any order
            def here(m, site_module=site_module) -> bool:
                return node is call or m is module or m is site_module or _import_related(m, site_module)
            test, tested_in = main_only.get(sampler, ("", None))
            out.append(UnseededSampler(site_module, node, name, any(map(here, once.get(sampler, ()))),
                                       test if tested_in is not None and here(tested_in) else ""))
    return out


def _follow_loaders(program) -> None:
    """Work out what the loaders of the linted files that loop over epochs hold: that parses the files
    their builders live in (``train_loader, val_loader = create_dataloaders(...)`` in another module),
    so that a sampler made there is seen."""
    values = program.values
    for module in program.project.linted():
        if not _EPOCH_LOOP.search(module.text) or not _LOADER_NAME.search(module.text):
            continue
        for scope in [module] + list(module.functions.values()):
            for name, bound in values.info(scope).assigns.items():
                if _LOADER_NAME.search(name) and bound and type(bound[0][0]) is ast.Call:
                    values.name(name, scope)
            if isinstance(scope, Function) and _epoch_loop_of(scope) is not None:
                for name in scope.params:
                    if _LOADER_NAME.search(name):
                        values.parameter(scope, name)


def _builder_shared(module, call, scope) -> bool:
    """Is the sampler made in a function (a builder), in a module that is not a script of its own?"""
    return isinstance(scope, Function) and "__main__" not in module.text


# a name that holds a data loader or a sampler (``train_loader``, ``dataloader``, ``loader_train``,
# ``train_dl``, ``sampler``)
_LOADER_NAME = re.compile(r"(?i)loader|sampler|(?:^|_)dl(?:$|_)")


def _takers(program, sampler) -> list:
    """(module, the call, name, scope) where a linted file binds a name to ``sampler`` or to a loader
    that draws from it, first binding of each name (``train_loader = make_dataloader(...)``,
    ``loader, sampler = build(cfg)``): the sampler is made in a file not linted."""
    values = program.values
    out = []
    for module in program.project.linted():
        scopes = [module] + list(module.functions.values())
        for scope in scopes:
            info = values.info(scope)
            for name, bound in info.assigns.items():
                if not _LOADER_NAME.search(name) or not bound or type(bound[0][0]) is not ast.Call:
                    continue
                made = bound[0][0]
                if isinstance(scope, Function) and any(isinstance(n, ast.Name) and n.id in scope.params and
                                                       _LOADER_NAME.search(n.id) for a in made.args for n in ast.walk(a)):
                    continue        # (``loader = tqdm(loader)``: what a caller handed in, taken there)
                held = values.name(name, scope)
                if sampler in held or any(isinstance(v, Loader) and sampler in values.loader_samplers(v, "sampler")
                                          for v in held):
                    loader = not any(v == sampler for v in held)
                    # (the binding that holds it: ``loader = dist_loader(...)`` in the else of
                    # ``if single: loader = plain_loader(...)``)
                    made = next((value for value, path in bound if type(value) is ast.Call and _holds(
                        values, values.unpack(values.expr(value, scope), path, value, scope), sampler)), made)
                    out.append((module, made, f"{name}.sampler" if loader else name, scope))
    if not out:
        # ``def train_validate_test(model, optimizer, train_loader, ...)``: handed the loader, it loops
        # over epochs itself (said at that loop)
        for module in program.project.linted():
            for fn in module.functions.values():
                loop = _epoch_loop_of(fn)
                if loop is None:
                    continue
                for name in fn.params:
                    if _LOADER_NAME.search(name) and not _EVALUATION.search(name) and any(
                            isinstance(v, Loader) and sampler in values.loader_samplers(v, "sampler")
                            for v in values.parameter(fn, name)):
                        out.append((module, loop, f"{name}.sampler", fn))
        return out
    # a builder of the linted files that returns what it binds is not where the loader is iterated:
    # its callers are (unless no linted file calls it)
    kept = [site for site in out if not _returns_name(site[3], site[2].partition(".")[0])] or out
    # ``sampler = build_sampler(...)`` and ``loader = DataLoader(ds, sampler=sampler)``: the sampler's name
    return [site for site in kept if not site[2].endswith(".sampler") or
            not any(other[3] is site[3] and not other[2].endswith(".sampler") for other in kept)]


def _epoch_loop_of(fn) -> Optional[ast.For]:
    """The function's loop over epochs (``for epoch in range(n_epochs)``), if it has one."""
    for node in fn.nodes():
        if isinstance(node, ast.For) and ("epoch" in ast.unparse(node.target).lower() or
                                          isinstance(node.iter, ast.Call) and called_name(node.iter) == "range"
                                          and "epoch" in ast.unparse(node.iter).lower()):
            return node
    return None


def _holds(values, held, sampler) -> bool:
    return sampler in held or any(isinstance(v, Loader) and sampler in values.loader_samplers(v, "sampler")
                                  for v in held)


def _returns_name(scope, name: str) -> bool:
    """Does the function return ``name`` (alone, or in a tuple or a dict)?"""
    return isinstance(scope, Function) and any(
        isinstance(n, ast.Return) and n.value is not None and any(
            isinstance(x, ast.Name) and x.id == name for x in ast.walk(n.value)) for n in scope.nodes())


def _import_related(a, b) -> bool:
    """Does one of the two modules import the other (by its last dotted name)?"""
    def imports(x, y) -> bool:
        stem = y.name.rpartition(".")[2]
        return any(mod.rpartition(".")[2] == stem or attr == stem for mod, attr, _ in x.imports.values())
    return imports(a, b) or imports(b, a)


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
                         r"while[ \t][^\n:]*epoch[^\n:]*[<>][^\n]*:)", re.MULTILINE | re.IGNORECASE)


_SET_EPOCH_KEPT = re.compile(r"\.set_epoch\b(?![ \t]*\()")


def _set_epoch_kept(program) -> list:
    """(scope, receiver) of each ``receiver.set_epoch`` read without being called (kept to call later)."""
    out = []
    for module in program.project.modules():
        if not _SET_EPOCH_KEPT.search(module.text):
            continue
        for scope in [module] + list(module.functions.values()):
            calls = set()
            nodes = scope.nodes() if isinstance(scope, Function) else walk_no_defs(scope.tree)
            for node in nodes:
                if isinstance(node, ast.Call):
                    calls.add(id(node.func))
            for node in nodes:
                if isinstance(node, ast.Attribute) and node.attr == "set_epoch" and isinstance(node.ctx, ast.Load) \
                        and id(node) not in calls:
                    out.append((scope, node.value))
    return out


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


def _has_epoch_loop(program, skip: frozenset = frozenset()) -> bool:
    """Does the program loop over epochs? The files parsed so far, and the text of those the
    analysis has not needed to parse (which of them it needed depends on what it followed)."""
    project = program.project
    for apath in list(project.catalog):
        text = project.catalog_text(apath) if apath in project.catalog else None
        if text is not None and _EPOCH_LOOP.search(text):
            return True
    return any(_loops_over_epochs(module) for module in program.project.modules() if id(module) not in skip)


def _loops_over_epochs(module) -> bool:
    """Does the module loop over epochs?"""
    if _EPOCH_LOOP.search(module.text):
        return True
    # (loops are statements: the statements of each tree are looked at, not every node)
    for node in block_nodes(module.tree):
        if isinstance(node, (ast.For, ast.While)):
            # (``for epoch in ...``; ``while self._epoch < self._max_epochs:``, mmcv's runner)
            target = ast.unparse(node.target) if isinstance(node, ast.For) else ast.unparse(node.test)
            if "epoch" in target.lower():
                return True
            if isinstance(node, ast.For) and _counts(node, module) and "epoch" in ast.unparse(node.iter).lower() and \
                    any(isinstance(n, ast.Call) and (_RUNS_AN_EPOCH.search(called_name(n) or "") or any(
                        isinstance(a, ast.Name) and _LOADER_NAME.search(a.id) for a in n.args))
                        for b in node.body for n in walk(b)):
                return True     # ``for i in range(args.epoch): train(i, loader, ...)``
            if any(isinstance(n, (ast.For, ast.While)) for b in node.body for n in block_nodes(b)) and \
                    _counts(node, module) and _TRAINS.search(module.segment(node) or ""):
                # (a loop that trains, or yields batches: not a dataset's ``while len(pick) < n: for sub in ...``)
                return True
            if _refills_an_iterator(node):
                return True
    return False


_RUNS_AN_EPOCH = re.compile(r"(?i)train|fit|epoch")
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
                         module.text, re.MULTILINE) is not None
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
