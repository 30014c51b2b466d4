"""``DistributedSampler`` objects whose ``set_epoch`` is never called (SC302): where each is built, what
seeds it, and whether the program loops over epochs."""
from __future__ import annotations

import ast
import re
from typing import NamedTuple, Optional

from synccheck.analyzer.project.dead_code import class_never_made, never_runs
from synccheck.analyzer.project.definitions import Function, called_name, is_super_call
from synccheck.analyzer.project.traversal import walk, walk_no_defs
from synccheck.analyzer.project.unwrapped import _text
from synccheck.analyzer.project.value_helpers import parameter_default
from synccheck.analyzer.project.values import Const, Ext, Framework, Loader, Obj, Sampler, Unknown
from synccheck.analyzer.project.sampler_loops import (_EVALUATION, _EVALUATION_FUNCTION, _builder_shared,
                                                      _follow_loaders, _has_epoch_loop, _import_related,
                                                      _draws_from, _handed_loaders, _loops_over_epochs, _takers)


class UnseededSampler(NamedTuple):
    module: object
    node: object
    name: str
    once: bool = False        # set_epoch is called on it, once, before the epoch loop
    main_only: str = ""       # set_epoch is called on it only under this test of the main rank


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
    unknown_in: set = set()     # modules with a set_epoch on a receiver not followed
    once: dict = {}             # sampler -> the modules that set its epoch once, before the epoch loop
    main_only: dict = {}        # sampler -> (the rank test its only set_epoch calls are under, module)
    checker = None
    for scope, call in values.calls("set_epoch"):
        if not isinstance(call.func, ast.Attribute):
            continue
        last = _last_name(call.func.value)
        if _DATASET.search(last) and "sampler" not in last.lower():
            continue        # ``train_loader.dataset.set_epoch(epoch)``: a dataset's hook, not the sampler's
        if never_runs(program, scope) and not _part_of_its_own_loop(scope, call) and \
                not any(_reseeds_its_own(program, scope, s) for *_, s in made):
            # ``set_epoch`` in a hook nothing calls, or a hook class nothing registers (a class that
            # makes its sampler and reseeds it is one piece: made by a script out of view, or by nobody;
            # so is a base trainer's epoch loop reseeding what its subclass's get_dataloader built)
            continue
        if _under_a_false_flag(values, scope, call):
            continue        # ``if self.ddp: loader.sampler.set_epoch(epoch)`` with ``ddp=False`` left by every caller
        receiver = _built_loader_sampler(program, scope, call.func.value) or values.expr(call.func.value, scope)
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
        if _over_each_held(scope, call) or sum(isinstance(v, Sampler) for v in receiver) >= _MANY_SAMPLERS:
            # ``for loader in self.loaders: loader.sampler.set_epoch(epoch)``: every loader the container
            # holds, more than the values followed may name (a multi-task loader over a dozen tasks)
            unknown_in.add(values.module_of(scope))
        named = any(isinstance(v, Sampler) for v in receiver)
        for v in receiver:
            if isinstance(v, Sampler):
                seeded.setdefault(v, set()).add(values.module_of(scope))
            elif isinstance(v, (Unknown, Obj, Ext)) and not named:
                # (``sampler = DistributedSampler(d) if distributed else RandomSampler(d)``: the other
                # side is that run's own sampler, not some other one this call might reseed)
                # (a set_epoch on something not followed: it may reseed any sampler this script reaches)
                unknown_in.add(values.module_of(scope))
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
    # an OpenMMLab (or catalyst) runner trains on the loaders handed to it and reseeds their samplers itself
    # (``DistSamplerSeedHook``; ``IterLoader`` calls ``set_epoch`` each pass): mmseg/mmdet's builder copies
    unknown = unknown or any(_MM_RUNNER.search(text) for text in
                             [m.text for m in program.project.modules()] +
                             [t for _, t in program.project.catalog.values() if t is not None] if "runner" in text)
    # ``self.train_dataloader.dataset.shuffle(epoch)``: the dataset permutes its own items by the epoch,
    # the same on every rank, so the sampler's fixed indices draw a new order each epoch (Grad-W)
    unknown = unknown or any("shuffle" in m.text and _DATASET_RESHUFFLED.search(m.text)
                             for m in program.project.modules())
    if unknown:
        return []
    prepared = _prepared_loaders(program)
    out = []
    epoch_loop = None         # asked once: nothing below parses or reads a file
    for module, call, sampler, scope in made:
        if sampler in prepared or _seeded_by_epoch(call) or _over_data_made_each_epoch(scope, call) or \
                _never_read(module, call, scope):
            continue
        shared = module.linted and _builder_shared(module, call, scope)
        if unknown_in and not shared and module.linted and sampler not in seeded and any(
                m is module or _import_related(m, module) for m in unknown_in):
            continue        # (a set_epoch not followed, in this script or one related to it, may be this one's)
        if module.linted and sampler not in seeded and not (unknown_in and shared):
            sites = [(module, call, _assigned_name(module, call), scope)]
            if isinstance(scope, Function) and scope.cls is None:
                # a builder function (``get_loader(args)`` in utils/data_utils.py): the fix belongs in the
                # epoch loop of the script that takes its loader, so that script is told too
                sites += [site for site in _takers_of(program, sampler)
                          if site[0] is not module and _epochs_at(program, site) and
                          not _left_off_by(program, scope, call, site) and
                          not any(m is site[0] or _import_related(m, site[0]) for m in unknown_in)]
            if isinstance(scope, Function) and scope.cls is None or scope is module:
                if len(sites) == 1:
                    # ``train(model, train_dataloader, ...)`` of another file loops over the epochs
                    # itself, handed the loader (MPCoder's train_utils.py): said at that loop too
                    # (not where a set_epoch not followed may reseed it: MineSegSAT's
                    # ``dataloaders["train"].sampler.set_epoch(epoch)`` in the function handed the loaders)
                    sites += [(m, loop, f"{name}.sampler", fn) for m in program.project.linted() if m is not module
                              and not any(x is m or _import_related(x, m) for x in unknown_in)
                              for fn, loop, name in _handed_loaders(m)
                              if not _EVALUATION.search(name) and
                              _draws_from(program.values, program.values.parameter(fn, name), sampler, containers=True)]
        elif module.linted and not shared:
            sites = []
        else:
            # built by a builder that several scripts share, or in a file not linted
            # (``train_loader = make_dataloader(...)``, the sampler made two calls away): said where a
            # linted script takes it, unless a set_epoch of the same program reseeds it (not one in
            # another script that shares the builder); a set_epoch on a loader not followed (ALBEF's
            # ``train_loader.sampler.set_epoch`` beside a shared ``create_sampler``) may reseed the
            # samplers of its own script and of the scripts it imports or is imported by
            sites = [site for site in _takers_of(program, sampler)
                     if site[0] is not module and not _left_off_by(program, scope, call, site) and
                     not any(m is module or m is site[0] or _import_related(m, site[0])
                             for m in seeded.get(sampler, set()) | unknown_in) and
                     _epochs_at(program, site)]
        if not sites and sampler in seeded:
            sites = _calls_left_unseeded(program, sampler)
        if not sites:
            continue
        if epoch_loop is None:
            epoch_loop = _has_epoch_loop(program, followed)
        if not epoch_loop:
            continue
        for site_module, node, name, site_scope in sites:
            where = site_scope.node.name if isinstance(site_scope, Function) else ""
            built_on = _text(site_module, node.args[0]) if node is call and call.args else ""
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                # ``DATALOADER_DICT[args.datatype]["train_test"](args, tokenizer)``: the registry's key
                built_on += " " + _text(site_module, node.func.slice)
            if _EVALUATION.search(f"{name} {built_on}") or _EVALUATION_FUNCTION.search(where) or \
                    (node is call and _EVALUATION_BUILDER.search(where)):
                continue    # an evaluation pass gives the same metrics in any order
            def here(m, site_module=site_module) -> bool:
                return node is call or m is module or m is site_module or _import_related(m, site_module)
            test, tested_in = main_only.get(sampler, ("", None))
            out.append(UnseededSampler(site_module, node, name, any(map(here, once.get(sampler, ()))),
                                       test if tested_in is not None and here(tested_in) else ""))
    return out


# a builder named for what it loads for evaluation (``dataloader_msrvtt_test``, ``..._train_test``); read
# where the sampler is built only (HydraGNN's ``train_validate_test`` is the function that trains)
_EVALUATION_BUILDER = re.compile(r"(?i)(?:^|_)(?:test|val|valid|eval|evaluation|validation)$")


def _epochs_at(program, site) -> bool:
    """Does the taking site's module loop over epochs, or, for a trainer's method
    (``self.dataloader = get_dataset(...)`` in ``before_train``), the module of one of its class's bases
    (the template trainer's ``for self.epoch in range(...): before_iter(); train_in_iter()``, IDDM)?"""
    module, _, _, scope = site
    if _loops_over_epochs(module):
        return True
    cls = scope.cls if isinstance(scope, Function) else None
    return cls is not None and any(base.module is not module and _loops_over_epochs(base.module)
                                   for base in program.project.mro(cls))


def _calls_left_unseeded(program, sampler) -> list:
    """The taking sites of one call of a builder function, in a function that calls the builder
    twice and reseeds only the other call's sampler (TorchSemiSeg: ``train_sampler.set_epoch(epoch)``,
    never ``unsupervised_train_sampler``). A sampler is one value per place it is made, so the
    ``set_epoch`` of one call stands for both; the names each call binds tell them apart."""
    by_scope: dict = {}
    for site in _takers_of(program, sampler):
        by_scope.setdefault(id(site[3]), []).append(site)
    out = []
    for sites in by_scope.values():
        calls: dict = {}
        for site in sites:
            calls.setdefault(id(site[1]), []).append(site)
        if len(calls) < 2:
            continue
        scope = sites[0][3]
        text = _text(sites[0][0], scope.node) if isinstance(scope, Function) else sites[0][0].text
        reseeded = {}
        for key, group in calls.items():
            names = {site[2].partition(".")[0] for site in group}
            reseeded[key] = any(re.search(rf"(?<![\w.]){re.escape(n)}(?:\.sampler|\.batch_sampler)?\.set_epoch\(", text)
                                for n in names)
        if not any(reseeded.values()):
            continue
        for key, group in calls.items():
            if not reseeded[key] and not any(_EVALUATION.search(site[2]) for site in group):
                out.append(group[0])
    return out


def _under_a_false_flag(values, scope, call) -> bool:
    """Is ``call`` inside an ``if flag:`` whose flag is a false constant wherever it is set: a
    parameter's default of False that no caller passes (KPGT's ``Trainer(..., ddp=False)``, built
    by its DDP script without ``ddp=``), kept on ``self``? Or after ``if not flag: return ...`` at
    the top of its function?"""
    node = getattr(scope, "node", None)
    if node is None:
        return False
    for n in walk_no_defs(node):
        if isinstance(n, ast.If) and isinstance(n.test, (ast.Name, ast.Attribute)) and \
                any(s.lineno <= call.lineno <= (s.end_lineno or s.lineno) for s in n.body) and \
                _always_false(values, n.test, scope):
            return True
    for n in node.body:
        if n.lineno >= call.lineno:
            break
        if isinstance(n, ast.If) and isinstance(n.test, ast.UnaryOp) and isinstance(n.test.op, ast.Not) and \
                isinstance(n.test.operand, (ast.Name, ast.Attribute)) and n.body and \
                isinstance(n.body[-1], (ast.Return, ast.Raise)) and _always_false(values, n.test.operand, scope):
            return True
    return False


def _always_false(values, test, scope) -> bool:
    """Is the flag false wherever it is set, as the callers in view set it? A parameter (or an
    attribute stored from one in ``__init__``) is false only when every caller in view passes a false
    constant or leaves a false default, read from the calls themselves (a keyword-only parameter
    after ``*args`` included); with no caller in view it may hold anything."""
    held = values.expr(test, scope)
    if not held or not all(isinstance(v, Const) and v.value in (False, None, 0) for v in held):
        return False
    found = _setting_function(test, scope)
    if found is None:
        return True
    fn, param = found
    if _referenced_as_a_value(values.project, fn):
        return False        # ``mp.spawn(train_worker, args=(..., True))``: called where we cannot see
    callers = values.callers(fn)
    return bool(callers) and all(_passes_false(fn, param, call, shift) for _, call, shift in callers)


# a set_epoch whose receiver stands for this many samplers stands for any: the values followed there
# were cut at MAX_VALUES (``self.train_loader`` of a base trainer that two dozen task scripts share)
_MANY_SAMPLERS = 8


_MM_RUNNER = re.compile(r"from mmcv\.runner import [^\n]*\bbuild_runner\b|\bDistSamplerSeedHook\b|"
                        r"from mmengine\.runner import [^\n]*\bRunner\b|"
                        # catalyst's runners call ``set_epoch`` on the DistributedSampler of each loader
                        # they are handed (Kaggle-2020-Alaska2's ``SupervisedRunner().train(loaders=...)``)
                        r"from catalyst(?:\.dl)? import [^\n]*\b\w*Runner\b")


def _takers_of(program, sampler) -> list:
    """_takers, less the loaders a project builder made around another sampler of the same call
    (``source_loader = build_dataloader(ds, sampler=source_sampler)`` does not take the target's)."""
    out = []
    for site in _takers(program, sampler):
        module, made, name, scope = site
        base, _, attr = name.partition(".")
        if attr == "sampler":
            held = ast.Attribute(ast.Name(base, ast.Load()), "sampler", ast.Load())
            own = _built_loader_sampler(program, scope, held)
            if own and sampler not in own:
                continue
        out.append(site)
    return out


def _built_loader_sampler(program, scope, receiver) -> frozenset:
    """``source_loader.sampler`` where ``source_loader = build_dataloader(ds, sampler=source_sampler)``
    and the project's ``build_dataloader`` returns ``DataLoader(..., sampler=sampler)``: the sampler
    this call handed it (read through the function alone, its ``sampler`` stands for every caller's,
    the target domain's too). EMPTY when the receiver is not such a loader's sampler."""
    from synccheck.analyzer.project.value_helpers import _argument
    if not (isinstance(receiver, ast.Attribute) and receiver.attr == "sampler" and
            isinstance(receiver.value, ast.Name)):
        return frozenset()
    values = program.values
    bound = values.info(scope).assigns.get(receiver.value.id, ()) if isinstance(scope, Function) else ()
    if len(bound) != 1 or bound[0][1] or not isinstance(bound[0][0], ast.Call):
        return frozenset()
    made = bound[0][0]
    targets = program.call_targets(made, scope)
    if len(targets) != 1:
        return frozenset()
    fn = targets[0]
    returns = [n.value for n in walk_no_defs(fn.node) if isinstance(n, ast.Return) and n.value is not None]
    if len(returns) != 1 or not isinstance(returns[0], ast.Call) or \
            not (getattr(returns[0].func, "id", None) or getattr(returns[0].func, "attr", "")).endswith("DataLoader"):
        return frozenset()
    given = next((k.value for k in returns[0].keywords if k.arg == "sampler"), None)
    if not isinstance(given, ast.Name) or given.id not in fn.params:
        return frozenset()
    arg = _argument(made, fn, given.id, fn.params.index(given.id), 1 if fn.is_method else 0)
    if arg is None:
        return frozenset()
    held = values.expr(arg, scope)
    return held if any(isinstance(v, Sampler) for v in held) else frozenset()


def _over_each_held(scope, call) -> bool:
    """Is the set_epoch's receiver (``loader.sampler``, ``sampler``) the variable of a loop over a
    container (``for loader in self.loaders:``, ``for s in samplers:``)?"""
    base = call.func.value
    while isinstance(base, (ast.Attribute, ast.Subscript)):
        base = base.value
    node = getattr(scope, "node", None)
    if not isinstance(base, ast.Name) or node is None:
        return False
    return any(isinstance(n, (ast.For, ast.AsyncFor)) and isinstance(n.target, ast.Name) and n.target.id == base.id
               and isinstance(n.iter, (ast.Name, ast.Attribute, ast.Call)) and
               n.lineno <= call.lineno <= (n.end_lineno or n.lineno) for n in walk_no_defs(node))


def _left_off_by(program, builder, sampler_call, site) -> bool:
    """Does the taker's call of the builder leave off the flag the sampler is made under (``if
    multi_gpu is True: ... DistributedSampler(...)`` in ``build_loader``, called with
    ``multi_gpu=False`` by the single-GPU script)? Its loader draws from a plain sampler."""
    taker = site[1]
    if not isinstance(builder, Function) or not isinstance(taker, ast.Call):
        return False
    flags = [n.test.left if isinstance(n.test, ast.Compare) else n.test for n in walk_no_defs(builder.node)
             if isinstance(n, ast.If) and _flag_test(n.test) and
             any(s.lineno <= sampler_call.lineno <= (s.end_lineno or s.lineno) for s in n.body)]
    params = [f.id for f in flags if isinstance(f, ast.Name) and f.id in builder.params]
    if not params or builder not in program.call_targets(taker, site[3]):
        return False
    shift = 1 if builder.is_method else 0
    return any(_passes_false(builder, param, taker, shift) for param in params)


def _flag_test(test) -> bool:
    """``if flag:``, ``if flag is True:``, ``if flag == True:``."""
    if isinstance(test, ast.Name):
        return True
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1 and \
        isinstance(test.ops[0], (ast.Is, ast.Eq)) and isinstance(test.comparators[0], ast.Constant) and \
        test.comparators[0].value is True


def _referenced_as_a_value(project, fn) -> bool:
    """Is the function (the class, for an ``__init__``) named anywhere but at its calls and its
    definition: handed to ``mp.spawn``, a registry, a callback list?"""
    name = fn.cls.node.name if fn.node.name == "__init__" and fn.cls is not None else fn.node.name
    bare = re.compile(r"(?<![\w.])" + re.escape(name) + r"\b(?!\s*\()")
    for module in project.modules():
        if name not in module.text:
            continue
        for match in bare.finditer(module.text):
            line = module.text.count("\n", 0, match.start()) + 1
            head = module.text[module.text.rfind("\n", 0, match.start()) + 1:match.start()]
            if head.lstrip().startswith(("def ", "class ", "async def ", "#", "import ", "from ")) or \
                    (module is fn.module and line == fn.node.lineno):
                continue
            return True
    return False


def _passes_false(fn, param: str, call, shift: int) -> bool:
    """Does this call leave ``param`` false: a false constant passed, or not passed over a false
    default? (Read from the call itself: a keyword-only parameter after ``*args`` included.)"""
    node = fn.node
    for kw in call.keywords:
        if kw.arg == param:
            return _false_constant(kw.value)
        if kw.arg is None:
            return False        # ``**kwargs`` may hold it
    positional = [a.arg for a in node.args.posonlyargs + node.args.args]
    if param in positional:
        index = positional.index(param) - shift
        if any(isinstance(a, ast.Starred) for a in call.args[:max(index + 1, 0)]):
            return False
        if 0 <= index < len(call.args):
            return _false_constant(call.args[index])
    return _false_constant(parameter_default(node, param))


def _false_constant(node) -> bool:
    return isinstance(node, ast.Constant) and node.value in (False, None, 0)


def _setting_function(test, scope):
    """(function, parameter) the flag is: ``scope``'s own parameter, or the class's ``__init__``
    parameter that ``self.flag`` is stored from; None for anything else."""
    if not isinstance(scope, Function):
        return None
    if isinstance(test, ast.Name):
        names = [a.arg for a in scope.node.args.posonlyargs + scope.node.args.args + scope.node.args.kwonlyargs]
        return (scope, test.id) if test.id in names else None
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and scope.cls is not None and \
            scope.params and test.value.id == scope.params[0]:
        init = scope.cls.methods.get("__init__")
        if isinstance(init, Function):
            for n in walk_no_defs(init.node):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in init.params and \
                        any(isinstance(t, ast.Attribute) and t.attr == test.attr for t in n.targets):
                    return init, n.value.id
    return None


def _part_of_its_own_loop(scope, call) -> bool:
    """Is this ``set_epoch`` in a class's own epoch loop, though nothing in view makes the class: in a
    loop of the method, or in a method its class calls itself (``self._before_epoch()`` from its
    ``run_epoch``)? The class is then one piece with the loop that draws from the sampler, made by a
    script out of view; a hook nothing registers (a callback's ``on_epoch_start``) is called by
    nobody in its class."""
    if not isinstance(scope, Function) or scope.cls is None:
        return False
    if any(isinstance(n, (ast.For, ast.While)) and n.lineno < call.lineno <= (n.end_lineno or n.lineno)
           for n in scope.nodes()):
        return True
    name = scope.node.name
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name and
               isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
               for other in scope.cls.methods.values() if other is not scope for n in other.nodes())


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


def _reseeds_its_own(program, scope, made_in) -> bool:
    """Does the method ``scope`` reseed a sampler its own class makes (made by a script out of view,
    or by nobody), or one a subclass of it makes, the subclass made by nobody in view (a base
    trainer's epoch loop, the subclass's ``get_dataloader``: ultralytics)?"""
    if not isinstance(made_in, Function) or made_in.cls is None or not isinstance(scope, Function) or scope.cls is None:
        return False
    if made_in.cls is scope.cls:
        return class_never_made(program, scope)
    return made_in.cls in program.project.subclasses(scope.cls) and class_never_made(program, made_in)


def _is_self(node, method) -> bool:
    return isinstance(node, ast.Name) and bool(method.params) and node.id == method.params[0]


def _seeded_by_set_epoch(klass) -> bool:
    """A DistributedSampler subclass whose order the epoch set by ``set_epoch`` seeds: it keeps the
    base's ``__iter__``, or its own calls ``super().__iter__()`` or reads ``self.epoch``. One that bumps
    ``self.epoch`` itself on every pass (``self.epoch += 1`` outside ``set_epoch``, or
    ``self.set_epoch(self.epoch + 1)`` in its ``__iter__``) reshuffles without it, and one with an order
    of its own that no epoch seeds needs none."""
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
            if method is iterate and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "set_epoch" and _is_self(node.func.value, method):
                return False        # ``self.set_epoch(self.epoch + 1)`` at the end of each pass (dolomite-engine)
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
    # (in no loop at all: ``while True: epoch += 1; ...; sampler.set_epoch(epoch)`` beside an inner
    # ``for i in range(CFG.EPOCHK)`` sets it every epoch)
    inside = [n for n in ast.walk(node) if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and
              n.lineno <= call.lineno <= (n.end_lineno or n.lineno)]
    return not inside


_DATASET = re.compile(r"dataset|^ds$|_ds$", re.IGNORECASE)


def _last_name(node) -> str:
    """``train_loader.dataset`` -> ``dataset``; ``train_set`` -> ``train_set``."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


_SET_EPOCH_BY_NAME = re.compile(r"getattr\([^)\n]*[\"']set_epoch[\"']")
_DATASET_RESHUFFLED = re.compile(r"(?i)(?:dataset|data_set|\bds)\w*\.(?:re)?shuffle\w*\(\s*(?:self\.)?\w*epoch")


def _seeded_by_epoch(call) -> bool:
    """``DistributedSampler(ds, seed=args.seed + epoch)``: a sampler made afresh each epoch, whose seed
    the epoch moves, shuffles differently every epoch without set_epoch."""
    return any(kw.arg == "seed" and any(isinstance(n, ast.Name) and "epoch" in n.id.lower() for n in ast.walk(kw.value))
               for kw in call.keywords)


def _over_data_made_each_epoch(scope, call) -> bool:
    """``for epoch in ...: dataset = build(..., shuffle=True); sampler = DistributedSampler(dataset)``:
    a sampler made afresh each epoch over a dataset made afresh each epoch (coconut reshuffles the
    data itself as it builds it); what each epoch sees is the dataset's to say, not set_epoch's."""
    if not isinstance(scope, Function) or not call.args or not isinstance(call.args[0], ast.Name):
        return False
    data = call.args[0].id
    for loop in scope.nodes():
        if isinstance(loop, ast.For) and "epoch" in ast.unparse(loop.target).lower() and \
                loop.lineno < call.lineno <= (loop.end_lineno or loop.lineno):
            # (built with ``shuffle=True``: the same data reloaded each epoch, albert's and TinyBERT's
            # pregenerated files, replays one order)
            return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and
                       any(isinstance(t, ast.Name) and t.id == data for t in n.targets) and
                       any(k.arg == "shuffle" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                           for k in n.value.keywords)
                       and loop.lineno < n.lineno < call.lineno for b in loop.body for n in walk(b))
    return False


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
    """Samplers whose loader goes through ``accelerator.prepare`` or ``fabric.setup_dataloaders``
    (whose loaders set their sampler's epoch at each new pass)."""
    values = program.values
    out = set()
    for scope, call in values.calls("prepare") + values.calls("setup_dataloaders"):
        if not isinstance(call.func, ast.Attribute):
            continue
        if not any(isinstance(v, Framework) for v in values.expr(call.func.value, scope)):
            continue
        for arg in call.args:
            for v in values.expr(arg, scope):
                if isinstance(v, Loader):
                    out |= {s for s in values.loader_samplers(v) if isinstance(s, Sampler)}
    return out


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


def _assigned_name(module, call) -> str:
    for node in walk(module.tree):
        if isinstance(node, ast.Assign) and (node.value is call or isinstance(node.value, (ast.IfExp, ast.BoolOp)) and
                                             any(sub is call for sub in ast.walk(node.value))):
            # (``val_sampler = DistributedSampler(valset) if distributed else None`` too)
            return ast.unparse(node.targets[0])
    return "the sampler"


def _never_read(module, call, scope) -> bool:
    """Is the sampler bound to a local name that nothing reads (``train_sampler = DistributedSampler(ds)``
    with the loader's ``sampler=train_sampler`` commented out, Med_Query)? Then no loader draws from it."""
    if not isinstance(scope, Function):
        return False
    node = scope.node
    name = None
    for stmt in walk(node):
        if isinstance(stmt, ast.Assign) and (stmt.value is call or isinstance(stmt.value, ast.IfExp) and
                                             any(sub is call for sub in ast.walk(stmt.value))):
            if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
                return False
            name = stmt.targets[0].id
            break
    if name is None:
        return False
    return not any(isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Store)
                   for n in ast.walk(node))
