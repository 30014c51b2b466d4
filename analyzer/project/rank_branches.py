"""SC301's fact, from the project's values without the sync dataflow: collectives that only some ranks reach.

A rank test's branches must run the same collectives -- or the function must balance them, as the
download-first idiom does (``if rank not in (-1, 0): barrier()`` ... ``if rank == 0: barrier()``).
Helpers called under a rank test are followed, with the literal arguments of the call folded into the
helper's own rank tests (``zero_first(rank=-1)``).
"""
from __future__ import annotations

import ast
import re
from collections import deque
from typing import NamedTuple, Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.definitions import called_name
from synccheck.analyzer.project.index import Function
from synccheck.analyzer.project.values import Ext, Framework, Func, Inst, Obj, Wrapper
from synccheck.analyzer.project.traversal import children, walk, walk_no_defs
from synccheck.analyzer.project.rank_tests import RANK_NAME, RankTests, _kind, _negation, _ranked
from synccheck.analyzer.project.collective_calls import (_COMMUNICATING, _case_value, _collective_aliases,
                                                         _full_state_dict_models, _is_wildcard, _runs_deepspeed,
                                                         _sub_group)
from synccheck.analyzer.project.literal_arguments import (_UNKNOWN, _fallback_test, _fold, _functions_tested,
                                                          _literal_arguments)

class RankCollective(NamedTuple):
    module: object
    node: object            # the collective, or the call that runs one
    what: str
    test_text: str
    through: bool


def collectives_in_rank_branches(program) -> list:
    out = []
    checker = _RankChecker(program)
    from synccheck.analyzer.rules.sc301 import CollectiveInRankBranch as rule
    for module in program.project.linted():
        if not (rule.wants(module.text) or rule.reaches(module.text)):
            continue
        scopes = [module] + list(module.functions.values())
        paired: dict = {}       # class uid -> what its __enter__ and __exit__ run, balanced together
        sided: list = []        # (scope, the collectives on a side of its rank tests)
        for scope in scopes:
            body = scope.node.body if isinstance(scope, Function) else module.script_body()
            found: list = []
            only = _main_only(scope, checker) if isinstance(scope, Function) else None
            if only is not None:
                # ``@rank_zero_only def save(...)``: the whole body is the main rank's side
                checker.walk(body, "main", f"@{only}", scope, found)
            else:
                checker.walk(body, None, None, scope, found)
            if isinstance(scope, Function) and scope.cls is not None and scope.node.name in _ENTER_EXIT:
                # a zero-first context manager written as a class: the other ranks' barrier in
                # ``__enter__``, the main rank's in ``__exit__``; every rank runs one
                paired.setdefault(scope.cls.uid, []).extend(found)
                continue
            sided.append((scope, found))
        # a function whose other ranks serve the main rank in a loop: the main rank's collectives there
        # (and in the functions nested in it, a closure the optimizer calls) are its requests
        for scope, found in sided:
            outer = scope
            while isinstance(outer, Function) and outer.uid not in checker.serving:
                outer = outer.parent
            if (outer.uid if isinstance(outer, Function) else module.path) not in checker.serving:
                out.extend(_unbalanced(module, found, checker.guarded, checker.exiting))
        for found in paired.values():
            out.extend(_unbalanced(module, found, checker.guarded, checker.exiting))
    return out


def _serving_loop(stmt) -> bool:
    """``while True:`` on one side of a rank test: the other ranks serve the main rank's requests
    (a demo's workers waiting in ``barrier`` / ``broadcast_object_list`` for each prompt, a signal
    loop answering the main rank's closure), as many collectives as it sends, not a count to match."""
    # (or ``while has_data: dist.broadcast(has_data, src=0)``: the loop goes on while the main rank's
    # broadcast says so, returnn's evaluation on rank 0)
    if not isinstance(stmt, ast.While):
        return False
    if isinstance(stmt.test, ast.Constant):
        return bool(stmt.test.value)
    tested = {n.id for n in walk(stmt.test) if isinstance(n, ast.Name)}
    return any(isinstance(n, ast.Call) and any(isinstance(a, ast.Name) and a.id in tested for a in n.args)
               and isinstance(n.func, ast.Attribute) and n.func.attr.startswith(("broadcast", "recv", "all_reduce"))
               for s in stmt.body for n in walk(s))


_ENTER_EXIT = ("__enter__", "__exit__", "__aenter__", "__aexit__")


def _unbalanced(module, found: list, guarded=frozenset(), exiting=frozenset()) -> list:
    """Collectives that one side of the rank tests runs more often than the other (the download-first
    idiom runs one barrier on each side, which balances). ``guarded``: the ids of collectives that run
    on their side only when a further test holds; where one side's are all guarded so and the other's
    are not, the guarded ones may not run when the others wait (rank 0 releasing the others' barrier
    only when the cache is missing, or when it stops early)."""
    out = []
    kinds = {what for _, what, _, _, _ in found}
    for kind in kinds:
        main = [f for f in found if f[1] == kind and f[2] == "main"]
        other = [f for f in found if f[1] == kind and f[2] == "other"]
        if len(main) == len(other):
            main_guarded = [f for f in main if id(f[0]) in guarded]
            other_guarded = [f for f in other if id(f[0]) in guarded]
            if main and (len(main_guarded) == len(main)) != (len(other_guarded) == len(other)):
                out.extend(RankCollective(module, node, what, test, through)
                           for node, what, side, test, through in main_guarded + other_guarded)
            continue
        extra = main if len(main) > len(other) else other
        fewer = other if extra is main else main
        leaving = [f for f in extra if id(f[0]) in exiting]
        if leaving and len(extra) - len(leaving) == len(fewer) and len(leaving) <= len(fewer) and \
                not any(id(f[0]) in exiting for f in fewer):
            continue        # (each path of the busier side runs as many: the one that leaves early, or the rest)
        through_calls = [f for f in extra if f[4]]
        if through_calls and len(through_calls) < len(extra) and len(extra) - len(fewer) <= len(through_calls) and \
                not any(f[4] for f in fewer):
            # the busier side's own collectives pair with the other side's (the download-first barriers,
            # ``if rank not in (-1, 0): barrier()`` ... ``if rank == 0: barrier()``); what it runs more is
            # what it reaches through calls (``evaluate()`` on rank 0 only, whose helper runs its own
            # pair: AnswerExtract)
            extra = through_calls
        for node, what, side, test, through in extra:
            out.append(RankCollective(module, node, what, test, through))
    return out


class _RankChecker(RankTests):
    def __init__(self, program) -> None:
        self.program = program
        self.values = program.values
        self._runs: dict = {}
        self._names_bound: dict = {}         # module path -> its names for collectives (_may_name_collective)
        self._attribute_stores: dict = {}    # class uid -> attribute -> [(value, method)] (rank_tests)
        self._full_state_dict: list = []     # the models of the ``with FSDP.state_dict_type(model, FULL_STATE_DICT)`` around
        self._guarded = 0                    # how many tests other than the ranks' guard the walk here
        self.guarded: set = set()            # ids of the collectives found under such a test, on one side
        self.exiting: set = set()            # ids of those in a block that then leaves (``...; return``)
        self.serving: set = set()            # the scopes with a serving loop on one side (_serving_loop)
        self._context: list = []             # the tests a rank branch's ``return`` sits under (walk)

    def _extra_condition(self, test, scope) -> bool:
        """Is ``test`` a rank test joined by ``and`` to a test that is not about the ranks or the job?"""
        return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and \
            any(self._sides(v, scope, 0) == (None, None) for v in test.values)

    def _main_and_more(self, test, scope) -> bool:
        """Is ``test`` (or the one name it is bound to in the function) the main rank's test joined by
        ``and`` to a test that is not about the ranks?"""
        if isinstance(test, ast.Name) and isinstance(scope, Function):
            bound = self.values.info(scope).assigns.get(test.id, ())
            if len(bound) == 1 and not bound[0][1]:
                test = bound[0][0]
        return self._extra_condition(test, scope)

    def walk(self, stmts, side: Optional[str], test: Optional[str], scope, found: list) -> Optional[tuple]:
        """Collect the collectives of ``stmts`` with the side of the rank tests they run on. Returns
        (side, test) where a rank branch returns and only the other side goes on past ``stmts``."""
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, ast.If):
                read = self._sides(stmt.test, scope, 0)
                on_true, on_false = _ranked(read)
                if side is not None and "single" in read:
                    # ``if args.local_rank == -1: evaluate(...)`` on the main rank's side: that branch
                    # runs in a job that is not distributed, where no collective can hang
                    self._calls(stmt.test, side, test, scope, found)
                    self.walk(stmt.orelse if read[0] == "single" else stmt.body, side, test, scope, found)
                    continue
                if on_true == "main" and on_false is None and stmt.orelse and self._main_and_more(stmt.test, scope):
                    # ``if hv is not None and local_rank == 0: ... load_checkpoint(...) else: ...
                    # load_checkpoint(...)`` (OpenDiloco): every other rank takes the else side (with the
                    # main rank when the other test fails), so what it runs answers the main side's
                    on_false = "other"
                if (on_true is not None or on_false is not None) and side is None:
                    text, negated = ast.unparse(stmt.test), _negation(stmt.test)
                    # ``if rank == 0 and not os.path.exists(cache):``: the main side runs only when
                    # the cache is missing, which the other side's barrier does not wait for
                    extra = self._extra_condition(stmt.test, scope)
                    self._guarded += extra
                    before = len(found)
                    self.walk(stmt.body, on_true, text, scope, found)
                    if extra:
                        # ``if rank == 0 and os.path.exists(index): ...; broadcast(...); return``: one path
                        # of the main side; without the index it goes on to the broadcasts further down
                        self._leaving(stmt.body, found[before:])
                    self._guarded -= extra
                    self.walk(stmt.orelse, on_false, negated, scope, found)
                    # (a branch that raises is an error check, ``if world_size == 1 and rank != 0: raise``,
                    # not ranks sent another way: no rank is meant to take it)
                    body_exits, else_exits = _exits(stmt.body), _exits(stmt.orelse)
                    if body_exits and not else_exits:
                        # ``if not is_main: return``: the rest of the block runs on the other side only
                        # (``if not fsdp and not is_main: return``: on every rank when ``fsdp`` holds)
                        self.walk(stmts[i + 1:], on_false, negated, scope, found)
                        return (on_false, negated) if isinstance(stmt.body[-1], ast.Return) else None
                    if else_exits and not body_exits:
                        self.walk(stmts[i + 1:], on_true, text, scope, found)
                        return (on_true, text) if isinstance(stmt.orelse[-1], ast.Return) else None
                    continue
                self._calls(stmt.test, side, test, scope, found)
                # a test that is not the ranks' inside a rank branch: what it guards runs on some turns
                # (not the test a rank branch's ``return`` sits under: after it, the same test holds on
                # both sides)
                said = ast.unparse(stmt.test)
                guarded = side is not None and on_true is None and on_false is None and said not in self._context
                self._guarded += guarded
                before = len(found)
                left = self.walk(stmt.body, side, test, scope, found)
                if side is not None:
                    # ``if config is None: broadcast_object_list([None, None]); return`` on the main side:
                    # the path that leaves here runs these instead of what follows
                    self._leaving(stmt.body, found[before:])
                left_else = self.walk(stmt.orelse, side, test, scope, found)
                self._guarded -= guarded
                if side is None and left is not None and left_else is None and not _exits(stmt.orelse):
                    # ``if self.distributed: ... if not is_main: barrier(); return``: after this ``if``
                    # only the side that did not return goes on (YOLOX's evaluator: the others'
                    # barrier before their return, the main rank's after its gather, under the same test)
                    self._context.append(said)
                    self.walk(stmts[i + 1:], left[0], left[1], scope, found)
                    self._context.pop()
                    return left
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if side is not None and _serving_loop(stmt):
                if self._serves(stmt, scope):
                    self.serving.add(scope.uid if isinstance(scope, Function) else scope.path)
                continue
            if isinstance(stmt, ast.Match) and side is None and self._rank_match(stmt, scope):
                # ``match dist.get_rank(): case 0: ... case _: ...``: the cases are rank branches
                subject = ast.unparse(stmt.subject)
                for case in stmt.cases:
                    value = _case_value(case)
                    sided = "main" if value == 0 else "other" if _is_wildcard(case) else None
                    said = f"{subject} == 0" if sided == "main" else f"{subject} != 0" if sided else None
                    self.walk(case.body, sided, said, scope, found)
                continue
            for field in ("test", "iter", "value", "exc", "subject"):
                node = getattr(stmt, field, None)
                if isinstance(node, ast.expr):
                    self._calls(node, side, test, scope, found)
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    self._calls(item.context_expr, side, test, scope, found)
            full = _full_state_dict_models(stmt)
            self._full_state_dict.extend(full)
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self.walk(block, side, test, scope, found)
            del self._full_state_dict[len(self._full_state_dict) - len(full):]
            for handler in getattr(stmt, "handlers", ()):
                self.walk(handler.body, side, test, scope, found)

    def _leaving(self, body, found: list) -> None:
        """The collectives ``found`` in ``body`` are one path of their side when the body then leaves
        (``...; return``): ``_unbalanced`` counts them apart from the rest of that side."""
        if _exits(body):
            self.exiting.update(id(f[0]) for f in found)

    def _serves(self, loop, scope) -> bool:
        """Does the serving loop run a collective (itself or through a project function)?"""
        for call in walk(loop):
            if isinstance(call, ast.Call) and (self.collective(call, scope) or any(
                    self.runs(fn) for fn in self.program.syntactic_targets(call, scope) or ())):
                return True
        return False

    def _rank_match(self, stmt, scope) -> bool:
        """A ``match`` on the rank: its subject reads one, and one case is rank 0."""
        subject = stmt.subject
        named = bool(RANK_NAME.search(ast.unparse(subject))) or self._rank_valued(subject, scope)
        return named and any(_case_value(c) == 0 for c in stmt.cases)

    def _calls(self, expr, side, test, scope, found: list) -> None:
        for node, side, test in self._sided_calls(expr, side, test, scope):
            what = self.collective(node, scope) or self._full_gather(node, scope)
            if what == "save_state" and test and "DEEPSPEED" in test.upper():
                # ``if distributed_type == DEEPSPEED or is_main_process: accelerator.save_state(...)``:
                # under DeepSpeed (where save_state meets the others) every rank is in the block
                continue
            if what:
                found.append((node, what, side, test, False))
                if self._guarded:
                    self.guarded.add(id(node))
                continue
            if side is None:
                continue
            targets = self.program.syntactic_targets(node, scope)
            if targets is None:
                # (a callable held in a value: not one whose required parameters this call leaves
                # out, ``save_fn(model)`` beside a ``save_fn(model, *, training_state, kind)``)
                targets = [fn for fn in self.program.call_targets(node, scope) if _can_take(fn, node)]
            if not targets:
                targets = self._communicating_method(node, scope)
            for fn in targets:
                runs = self.runs(fn, _literal_arguments(node, fn, {}))
                if runs:
                    found.append((node, sorted(runs)[0], side, test, True))
                    if self._guarded:
                        self.guarded.add(id(node))
                    break

    def _sided_calls(self, expr, side, test, scope):
        """(call, side, test) for the calls in ``expr``; a conditional expression on a rank test
        (``evaluate(model) if rank == 0 else None``) is a rank branch like an ``if``."""
        todo = deque([(expr, side, test)])      # (breadth first, as ``walk``)
        while todo:
            node, at, said = todo.popleft()
            if isinstance(node, ast.IfExp) and at is None:
                on_true, on_false = _ranked(self._sides(node.test, scope, 0))
                if on_true is not None or on_false is not None:
                    todo.append((node.test, None, None))
                    todo.append((node.body, on_true, ast.unparse(node.test)))
                    todo.append((node.orelse, on_false, _negation(node.test)))
                    continue
            if isinstance(node, ast.Call):
                yield node, at, said
            todo.extend((child, at, said) for child in children(node))

    def _full_gather(self, call: ast.Call, scope=None) -> Optional[str]:
        """``with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg): model.state_dict()``:
        FSDP all-gathers every parameter for it, on every rank (rank0_only only says who keeps it); so
        does ``FSDP.optim_state_dict(model, optimizer)`` there, ``FSDP.full_optim_state_dict`` anywhere, and
        ``FSDP.summon_full_params(model)``. ``FSDP.set_state_dict_type(model, FULL_STATE_DICT, cfg)`` earlier
        in the function sets the same for the rest of it (RSTnet's ``save_model``)."""
        func = call.func
        if not isinstance(func, ast.Attribute):
            return None
        if func.attr == "state_dict" and not call.args and (
                ast.unparse(func.value) in self._full_state_dict or
                ast.unparse(func.value) in _set_full_state_dict(scope, call.lineno)):
            return "state_dict"
        if func.attr == "summon_full_params":
            # ``with FSDP.summon_full_params(model):`` all-gathers the shards, on every rank
            # (``rank0_only=True`` only says who keeps the result)
            receiver = ast.unparse(func.value)
            if "FSDP" in receiver or "FullyShardedDataParallel" in receiver or not call.args:
                return func.attr
        if func.attr == "full_optim_state_dict" or (func.attr == "optim_state_dict" and call.args and
                                                    ast.unparse(call.args[0]) in self._full_state_dict):
            receiver = ast.unparse(func.value)
            if isinstance(func.value, (ast.Name, ast.Attribute)) and "FSDP" in receiver or \
                    "FullyShardedDataParallel" in receiver:
                return func.attr
        return None

    def _torchmetrics_metric(self, node, scope) -> bool:
        """Is ``node`` an object made by a torchmetrics class (``FrechetInceptionDistance(...)``)?"""
        module = self.values.module_of(scope)
        if module is None or "torchmetrics" not in module.text:
            return False
        for v in self.values.expr(node, scope):
            site = getattr(v, "site", None) if isinstance(v, Obj) else None
            if not site or len(site) < 3 or not isinstance(site[1], int):
                continue
            where = self.values.project.module_at(site[0])
            made = where.call_at(site[1], site[2]) if where is not None else None
            # (``FrechetInceptionDistance(feature=2048).to(device)``: the class's call inside)
            while made is not None and isinstance(made.func, ast.Attribute) and \
                    made.func.attr in ("to", "cuda", "cpu", "eval", "train", "float", "double", "half") and \
                    isinstance(made.func.value, ast.Call):
                made = made.func.value
            if made is not None and any(isinstance(f, Ext) and f.qualname.startswith("torchmetrics.")
                                        for f in self.values.expr(made.func, scope)):
                return True
        return False

    def collective(self, call: ast.Call, scope) -> Optional[str]:
        group = next((kw.value for kw in call.keywords if kw.arg == "group"), None)
        if group is not None and _sub_group(group, scope):
            # ``dist.all_reduce(t, group=even_group)``: a collective of a sub-group, which the ranks of
            # the branch may be exactly (``if rank % 2 == 0`` with ``new_group(range(0, world, 2))``)
            return None
        func = call.func
        if not isinstance(func, ast.Attribute):
            if isinstance(func, ast.Name) and not self._may_name_collective(func.id, scope):
                return None
            vals = self.values.expr(func, scope)
            for v in vals:
                if isinstance(v, Ext) and v.qualname.startswith("torch.distributed.") and \
                        vocab.tail(v.qualname) in vocab.COLLECTIVES:
                    return _kind(vocab.tail(v.qualname))
                if isinstance(v, Ext) and v.qualname.startswith("accelerate.utils.") and \
                        vocab.tail(v.qualname) in vocab.ACCELERATE_UTILS_COLLECTIVES:
                    # ``from accelerate.utils import broadcast``: every process must call it (Emuru)
                    return _kind(vocab.tail(v.qualname))
            return None
        attr = func.attr
        if attr == "save_state":
            # ``accelerator.save_state(path)`` under DeepSpeed saves through every engine's
            # ``save_checkpoint``, which starts with a barrier (accelerate#1171, diffusers#2606); with
            # ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it numbers the checkpoint
            # folder and then calls ``wait_for_everyone()`` (accelerate's save_state; Emuru)
            deepspeed = _runs_deepspeed(self.values.module_of(scope))
            receiver = self.values.expr(func.value, scope)
            if any(isinstance(v, Framework) and v.kind == "accelerate" and
                   (deepspeed or _names_checkpoints(self.values.project, v)) for v in receiver):
                return "save_state"
            return None
        if attr in ("save_checkpoint", "load_checkpoint"):
            # a DeepSpeed engine's checkpoint, which every process must write (each saves its ZeRO
            # shard, and the engine waits for all): ``model_engine.save_checkpoint(dir)`` of
            # ``deepspeed.initialize``, or of ``ds_engine = accelerator.deepspeed_engine`` (lerobot forks)
            receiver = self.values.expr(func.value, scope)
            if any(isinstance(v, Wrapper) and v.kind == "deepspeed" for v in receiver) or \
                    self._deepspeed_engine(func.value, scope):
                return "save_checkpoint"
            return None
        if attr in ("save", "load", "save_state_dict", "load_state_dict", "async_save"):
            receiver = self.values.expr(func.value, scope)
            if any(isinstance(v, Ext) and v.qualname == "torch.distributed.checkpoint" for v in receiver):
                # ``dcp.save(state, checkpoint_id=path)``: every rank writes its shard, and the ranks
                # agree on the plan first (torch.distributed.checkpoint's collectives)
                return "dcp." + attr
            if attr not in ("save", "load"):
                return None
            # ``fabric.save(path, state)`` / ``fabric.load(path)``: Fabric ends both with a barrier that
            # every process must reach (a single-device Fabric has no other process to wait for)
            fabrics = [v for v in receiver if isinstance(v, Framework) and v.kind == "fabric"]
            if fabrics and not all(v.single for v in fabrics):
                return _kind("barrier")
            return None
        if attr == "compute" and not call.args:
            # ``fid.compute()`` on a torchmetrics metric: it syncs its states over every process
            # before computing (``sync_on_compute``), so a rank-0-only ``compute`` waits alone
            return "compute" if self._torchmetrics_metric(func.value, scope) else None
        if attr not in vocab.COLLECTIVES and attr not in vocab.FRAMEWORK_COLLECTIVES:
            return None
        receiver = self.values.expr(func.value, scope)
        for v in receiver:
            if isinstance(v, Ext) and (v.qualname in ("torch.distributed", "torch.distributed.distributed_c10d")
                                       or v.qualname.endswith(".distributed")) and attr in vocab.COLLECTIVES:
                return _kind(attr)
            if isinstance(v, Framework) and attr in vocab.FRAMEWORK_COLLECTIVES:
                return _kind(attr)
            if isinstance(v, Inst) and attr == "all_gather" and self._lightning_module(v.cls):
                # ``self.all_gather(x)`` in a LightningModule gathers over every rank
                return _kind(attr)
        text = ast.unparse(func.value)
        if text in ("dist", "torch.distributed", "distributed") and attr in vocab.COLLECTIVES:
            return _kind(attr)
        # Lightning's ``trainer.strategy.barrier()`` / ``self.trainer.strategy.broadcast(x)`` too
        if text.endswith(("accelerator", "fabric", "strategy")) and attr in vocab.FRAMEWORK_COLLECTIVES:
            return _kind(attr)
        return None

    def _deepspeed_engine(self, node, scope) -> bool:
        """``accelerator.deepspeed_engine``, or a local name bound only to it."""
        if isinstance(node, ast.Attribute):
            return node.attr == "deepspeed_engine"
        if not isinstance(node, ast.Name) or not isinstance(scope, Function):
            return False
        bound = self.values.info(scope).assigns.get(node.id, ())
        return bool(bound) and all(not path and isinstance(value, ast.Attribute) and value.attr == "deepspeed_engine"
                                   for value, path in bound)

    def _communicating_method(self, call: ast.Call, scope) -> list:
        """``meter.synchronize_between_processes()`` on a meter we cannot trace (a value of
        ``defaultdict(SmoothedValue)``): a method whose name says it communicates, defined in the
        project by one class family only (duck.py), is that family's."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and _COMMUNICATING.search(func.attr)):
            return []
        bound = self.program.duck_method(func.attr, scope, call)
        return [bound.fn] if bound is not None else []

    def _lightning_module(self, cls) -> bool:
        return any(vocab.tail(b) == "LightningModule" for b in self.values.project.external_bases(cls))

    def _may_name_collective(self, name: str, scope) -> bool:
        """Can a plain name called here be torch.distributed's collective: it is one's name, or the
        module binds it to one (``from torch.distributed import barrier as b``, ``reduce =
        dist.all_reduce``)? Most calls in a script are ``len(...)``, ``print(...)``, a function of
        the project or a model: their values are not worked out for this."""
        if name in vocab.COLLECTIVES or name in vocab.ACCELERATE_UTILS_COLLECTIVES:
            return True
        module = scope.module if isinstance(scope, Function) else scope
        bound = self._names_bound.get(module.path)
        if bound is None:
            bound = self._names_bound[module.path] = _collective_aliases(module.tree)
        return name in bound

    def runs(self, fn: Function, binding: frozenset = frozenset()) -> set:
        """The collectives a project function runs on every rank that calls it (transitively), given
        the literal values of some of its parameters (``evaluate=True``, ``rank=-1``): a branch whose
        test those values make false is not taken."""
        key = (fn.uid, binding)
        found = self._runs.get(key)
        if found is not None:
            return found
        self._runs[key] = set()
        out: set = set()
        known = dict(binding)
        for name in _functions_tested(fn):
            known.setdefault(name, True)
        self._runs_in(fn.node.body, fn, known, out)
        for decorator in fn.node.decorator_list:
            # ``@leader_only def log(...)``: the project decorator's wrapper runs around every call,
            # with whatever collectives it holds (oumi's barrier after the main rank's work)
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            sym = self.program.project.resolve_expr(fn.module, target) \
                if isinstance(target, (ast.Name, ast.Attribute)) else None
            if isinstance(sym, Function) and sym is not fn:
                # (a decorator factory, ``@local_leader_only()``: the wrapper is nested twice)
                todo = list(sym.nested.values())
                while todo:
                    inner = todo.pop()
                    out |= self.runs(inner)
                    todo.extend(inner.nested.values())
        self._runs[key] = out
        return out

    def _runs_in(self, stmts, fn: Function, binding: dict, out: set) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or _serving_loop(stmt):
                continue
            if binding and stmts is fn.node.body and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
                    isinstance(stmt.targets[0], ast.Name):
                # ``resumable = training_state is not None`` at the top of the body, with the call's
                # ``training_state`` left at its default: later tests of ``resumable`` fold too
                value = _fold(stmt.value, binding)
                if value is not _UNKNOWN and isinstance(value, (bool, int, str, type(None))):
                    binding[stmt.targets[0].id] = value
                else:
                    binding.pop(stmt.targets[0].id, None)
            folded = _fold(stmt.test, binding) if binding and isinstance(stmt, (ast.If, ast.While)) else _UNKNOWN
            read = self._sides(stmt.test, fn, 0) if isinstance(stmt, ast.If) and folded is _UNKNOWN else ()
            if "single" in read:
                # ``if not ddp: value = gather(value)`` with ``ddp = bool(world_size)``: that side runs in
                # a job that is not distributed, where no collective can hang (as ``walk`` reads it),
                # unless the literal arguments of this call decide the test (``distributed=False``)
                self._runs_calls(stmt.test, fn, binding, out)
                self._runs_in(stmt.orelse if read[0] == "single" else stmt.body, fn, binding, out)
                continue
            if isinstance(stmt, ast.If) and not stmt.orelse and _fallback_test(stmt.test, fn):
                # ``dir_name = None; for h in handlers: ... dir_name = ...; if dir_name is None:
                # dir_name = get_local_time()``: a fallback for when the search found nothing, which
                # says nothing of what every caller runs (RecBole's tensorboard writer)
                self._runs_calls(stmt.test, fn, binding, out)
                continue
            if isinstance(stmt, (ast.If, ast.While)) and binding:
                value = folded if folded is _UNKNOWN else bool(folded)
                self._runs_calls(stmt.test, fn, binding, out)
                if value is not False:
                    self._runs_in(stmt.body, fn, binding, out)
                if value is not True:
                    self._runs_in(stmt.orelse, fn, binding, out)
                continue
            full = _full_state_dict_models(stmt)
            self._full_state_dict.extend(full)
            for child in children(stmt):
                if isinstance(child, ast.stmt):
                    self._runs_in([child], fn, binding, out)
                elif isinstance(child, ast.excepthandler):
                    self._runs_in(child.body, fn, binding, out)
                elif isinstance(child, (ast.expr, ast.withitem)):
                    self._runs_calls(child, fn, binding, out)
            del self._full_state_dict[len(self._full_state_dict) - len(full):]

    def _runs_calls(self, node, fn: Function, binding: dict, out: set) -> None:
        for call in walk(node):
            if not isinstance(call, ast.Call):
                continue
            what = self.collective(call, fn) or self._full_gather(call, fn)
            if what:
                out.add(what)
                continue
            for callee in self.program.syntactic_targets(call, fn) or self._communicating_method(call, fn):
                if callee is not fn:
                    out |= self.runs(callee, _literal_arguments(call, callee, binding))


def _can_take(fn: Function, call: ast.Call) -> bool:
    """Can ``call`` bind every parameter of ``fn`` that has no default? (A ``*args``/``**kwargs`` on
    either side may supply anything.)"""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return True
    a = fn.node.args
    positional = a.posonlyargs + a.args
    if fn.is_method and positional:
        positional = positional[1:]
    passed = {k.arg for k in call.keywords}
    required = positional[:len(positional) - len(a.defaults)] if a.defaults else positional
    if len(call.args) > len(positional) and a.vararg is None:
        return False
    if any(p.arg not in passed for p in required[len(call.args):]):
        return False
    return all(p.arg in passed for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None)


def _main_only(fn, checker=None) -> Optional[str]:
    """The decorator that makes ``fn`` run on the main process only, if it has one: a library's
    (``rank_zero_only``) or the project's own (Torchpie's ``rank0_fn``, whose wrapper calls the
    function only under ``if local_rank_is_0:``)."""
    from synccheck.analyzer.rules.sc301 import RANK_DECORATORS
    named = next((called_name(d) for d in fn.node.decorator_list if called_name(d) in RANK_DECORATORS), None)
    if named is not None or checker is None:
        return named
    for d in fn.node.decorator_list:
        if not isinstance(d, (ast.Name, ast.Attribute)):
            continue        # (a decorator factory, ``@retry(3)``: not followed)
        for v in checker.values.expr(d, fn.parent or fn.module):
            if isinstance(v, Func) and _calls_on_main_only(checker, v.fn):
                return called_name(d)
    return None


def _calls_on_main_only(checker, deco: Function) -> bool:
    """Does the decorator ``deco`` return a wrapper that calls the function it was given only where a
    rank test says the main rank (``if local_rank_is_0: return fn(*args, **kwargs)``)?"""
    if not deco.params:
        return False
    given = deco.params[0]
    for inner in deco.node.body:
        if not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [n for n in walk(inner) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == given]
        if not calls:
            continue
        for n in walk(inner):
            if not isinstance(n, ast.If):
                continue
            on_true, on_false = checker.sides(n.test, deco)
            body_calls = {id(c) for s in n.body for c in walk(s)}
            else_calls = {id(c) for s in n.orelse for c in walk(s)}
            if all(id(c) in body_calls for c in calls) and on_true == "main" or \
                    all(id(c) in else_calls for c in calls) and on_false == "main":
                return True
            # ``if rank != 0: return None`` first, the call after it
            if n in inner.body and _exits(n.body) and not n.orelse and on_true == "other" and \
                    all(c.lineno > n.end_lineno for c in calls):
                return True
    return False


def _exits(stmts) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Continue, ast.Break))


_AUTOMATIC_NAMING = re.compile(r"automatic_checkpoint_naming\s*=\s*True")


def _names_checkpoints(project, framework) -> bool:
    """Was this Accelerator built in a file that turns on ``automatic_checkpoint_naming``, under an
    accelerate that waits for everyone there (0.22 and later: ddpo-pytorch pins 0.17, d3po 0.22)?"""
    from synccheck.analyzer.project.launch_configs import accelerate_pinned_before

    site = getattr(framework, "site", None)
    module = project.module_at(site[0]) if site else None
    return module is not None and _AUTOMATIC_NAMING.search(module.text) is not None and \
        not accelerate_pinned_before(module.path, (0, 22))


def _set_full_state_dict(scope, line: int) -> set:
    """The models (their texts) a function puts in FULL_STATE_DICT mode before ``line`` with a bare
    ``FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, ...)`` statement."""
    node = getattr(scope, "node", None)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    out = set()
    for stmt in walk_no_defs(node):
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and stmt.lineno < line:
            c = stmt.value
            if isinstance(c.func, ast.Attribute) and c.func.attr == "set_state_dict_type" and c.args and \
                    "FULL_STATE_DICT" in ast.unparse(c):
                out.add(ast.unparse(c.args[0]))
    return out
