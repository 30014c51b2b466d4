"""Where a program takes its data loaders and loops over epochs (SC302's part 2): the loaders a linted
script binds or is handed, when their sampler is made by a builder out of view, and whether a module,
or the program, loops over epochs."""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.definitions import Function, called_name
from synccheck.analyzer.project.traversal import block_nodes, walk
from synccheck.analyzer.project.values import Bag, Loader, Tup


# a function that evaluates (``run_test``, ``evaluate``, ``validate``): a sampler it builds is read once
# per call, in whatever order
# (not a pytest function, ``test_distributed_sampler_padding``: a test of the training code)
_EVALUATION_FUNCTION = re.compile(r"(?i)^_*(?:(?:run_|do_)(?:test|eval|evaluate|validate|val|infer|inference|predict)|"
                                  r"eval|evaluate|evaluation|validate|validation|val|infer|inference|predict|test$)(?:_|$)")
# a sampler (or the dataset it samples) named for evaluation: ``val_sampler``, ``DistributedSampler(dataset_test)``,
# ``valsampler``, ``DistributedSampler(valset)``
_EVALUATION = re.compile(r"(?i)(?:^|[^a-z])(?:val|vali|valid|validation|eval|evaluation|test|dev)"
                         r"(?:[^a-z]|$|sampler|loader|set|data)")


def _follow_loaders(program) -> None:
    """Work out what the loaders of the linted files that loop over epochs hold: that parses the files
    their builders live in (``train_loader, val_loader = create_dataloaders(...)`` in another module),
    so that a sampler made there is seen."""
    values = program.values
    for module in program.project.linted():
        if not _EPOCH_LOOP.search(module.text) or not _LOADER_NAME.search(module.text):
            continue
        for scope, name, _ in _loader_bindings(values, module):
            values.name(name, scope)
        for fn, _, name in _handed_loaders(module):
            values.parameter(fn, name)


def _loader_bindings(values, module):
    """(scope, name, bindings) for each name of the module's scopes that holds a loader or a sampler
    and is first bound by a call (``train_loader = make_dataloader(...)``)."""
    for scope in [module] + list(module.functions.values()):
        for name, bound in values.info(scope).assigns.items():
            # (``dataloader = None`` first, then ``dataloader, channels = get_dataset_distributed(...)``
            # in the epoch loop: pi-GAN)
            bound = [b for b in bound if not (isinstance(b[0], ast.Constant) and b[0].value is None)]
            if _LOADER_NAME.search(name) and bound and type(bound[0][0]) is ast.Call:
                yield scope, name, bound


def _handed_loaders(module):
    """(function, its epoch loop, parameter) for each loader-named parameter of a function of the module
    that loops over epochs itself."""
    for fn in module.functions.values():
        loop = _epoch_loop_of(fn)
        if loop is not None:
            for name in fn.params:
                if _LOADER_NAME.search(name):
                    yield fn, loop, name
    # a trainer class handed the loader in its constructor (``Trainer(..., train_data_loader, ...)``,
    # kept as ``self.train_data_loader``) and looping over epochs in another method
    for klass in module.classes.values():
        init = klass.methods.get("__init__")
        if init is None:
            continue
        loop = next((found for method in klass.methods.values() if method is not init
                     for found in [_epoch_loop_of(method)] if found is not None), None)
        if loop is None:
            continue
        for stmt in init.node.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(stmt.value, ast.Name) and \
                    stmt.value.id in init.params[1:] and _LOADER_NAME.search(stmt.value.id):
                yield init, loop, stmt.value.id


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
        for scope, name, bound in _loader_bindings(values, module):
            made = bound[0][0]
            if isinstance(scope, Function) and any(isinstance(n, ast.Name) and n.id in scope.params and
                                                   _LOADER_NAME.search(n.id) for a in made.args for n in ast.walk(a)):
                continue        # (``loader = tqdm(loader)``: what a caller handed in, taken there)
            held = values.name(name, scope)
            if _holds(values, held, sampler):
                loader = not any(v == sampler for v in held)
                # (the binding that holds it: ``loader = dist_loader(...)`` in the else of
                # ``if single: loader = plain_loader(...)``)
                made = next((value for value, path in bound if type(value) is ast.Call and _holds(
                    values, values.unpack(values.expr(value, scope), path, value, scope), sampler)), made)
                out.append((module, made, f"{name}.sampler" if loader else name, scope))
        # ``self.train_dataloader = build_dataloader(cfg, 'Train', ...)`` in a trainer's ``__init__``
        # (OpenOCR's tools/engine/trainer.py): the trainer's epoch loop iterates it
        for scope in module.functions.values():
            if not scope.is_method:
                continue
            for attr, bound in values.info(scope).self_attrs.items():
                if not _LOADER_NAME.search(attr) or not bound or type(bound[0][0]) is not ast.Call or bound[0][1]:
                    continue
                held = values.expr(bound[0][0], scope)
                if _holds(values, held, sampler):
                    loader = not any(v == sampler for v in held)
                    out.append((module, bound[0][0], f"self.{attr}.sampler" if loader else f"self.{attr}", scope))
    if not out:
        # ``def train_validate_test(model, optimizer, train_loader, ...)``: handed the loader, it loops
        # over epochs itself (said at that loop)
        for module in program.project.linted():
            for fn, loop, name in _handed_loaders(module):
                if not _EVALUATION.search(name) and _draws_from(values, values.parameter(fn, name), sampler):
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


def _draws_from(values, held, sampler, containers: bool = False) -> bool:
    """Is one of ``held`` a loader whose ``.sampler`` is ``sampler``? With ``containers``, or a container
    that holds one (``dataloaders = {"Train": DataLoader(ds, sampler=sampler), ...}`` handed to
    ``train(..., dataloaders)``): for a parameter, not a name a builder's tuple is bound to."""
    inside = set()
    for v in held if containers else ():
        if isinstance(v, Bag) and v.fields:
            # (``{"train": ..., "val": ..., "test": ...}``: the evaluation entries are not trained on)
            inside.update(x for key, vals in v.fields if not _EVALUATION.search(str(key)) for x in vals)
        elif isinstance(v, (Bag, Tup)):
            inside |= values.elements(frozenset((v,)), values_of_dict=True)
    return any(isinstance(v, Loader) and sampler in values.loader_samplers(v, "sampler") for v in held | inside)


def _holds(values, held, sampler) -> bool:
    """Is ``sampler`` one of ``held``, or drawn from by a loader among them?"""
    return sampler in held or _draws_from(values, held, sampler)


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


_EPOCH_LOOP = re.compile(r"^[ \t]*(?:(?:async[ \t]+)?for[ \t]+[\w, ()]*epoch\w*[\w, ()]*[ \t]+in[ \t]|"
                         r"while[ \t][^\n:]*epoch[^\n:]*[<>][^\n]*:)", re.MULTILINE | re.IGNORECASE)


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
            if isinstance(node, ast.While) and _STEP_BUDGET.search(target) and any(
                    isinstance(n, ast.Call) and _RUNS_AN_EPOCH.search(called_name(n) or "") and
                    any(isinstance(a, ast.Name) and _LOADER_NAME.search(a.id) for a in n.args)
                    for b in node.body for n in walk(b)):
                # ``while global_step < args.num_steps: global_step, ... = train(args, global_step,
                # train_loader, ...)`` (VoCo): each call is a pass over the loader
                return True
            if any(isinstance(n, (ast.For, ast.While)) for b in node.body for n in block_nodes(b)) and \
                    _counts(node, module) and _TRAINS.search(module.segment(node) or ""):
                # (a loop that trains, or yields batches: not a dataset's ``while len(pick) < n: for sub in ...``)
                return True
            if _refills_an_iterator(node):
                return True
    return False


_RUNS_AN_EPOCH = re.compile(r"(?i)train|fit|epoch")
_STEP_BUDGET = re.compile(r"(?i)step|iter")
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
