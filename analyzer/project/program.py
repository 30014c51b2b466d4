"""The whole-program model the rules query: the project index, its values, and the sync dataflow of
every training loop in it.

A *root* is a function (or a script's top level) holding a loop that reaches a backward pass,
itself or through the project functions it calls. Each root gets one Flow; callees are analysed in
place from there, so a loop spread over a trainer's methods, or over ``main.py`` and ``engine.py``,
is seen whole. Findings are kept only where their node is: in a linted file.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.entry_points import drivers_of, per_call_step, sibling_step
from synccheck.analyzer.project.duck import duck_method
from synccheck.analyzer.project.definitions import called_name
from synccheck.analyzer.project.index import Function, Project
from synccheck.analyzer.project.traversal import block_nodes_no_defs, walk, walk_no_defs
from synccheck.analyzer.project.values import CALL_WORD, Bound, Cls, Func, Inst, Values
from synccheck.analyzer.project.wrapped_models import WrappedModels
# the words of a block, and the constants roots are found by (re-exported: importable from here)
from synccheck.analyzer.project.program_words import (EVENT_CALLS, MAX_ROOT_WORK, ROOT_WORDS, STEP_WORDS,  # noqa: F401
                                                      SYNC_WORDS, WRAP_CALLS, Words)

# ``no_sync`` on a line before any ``#``
_NO_SYNC_IN_CODE = re.compile(r"^[^#\n]*no_sync", re.MULTILINE)
# a base class's method analysed once per concrete subclass it runs on: at most this many (_receivers)
MAX_RECEIVERS = 4


class Program(Words, WrappedModels):
    def __init__(self, project: Project) -> None:
        self.project = project
        self.values = Values(project)
        self._words: dict = {}
        self._stmt_words: dict = {}
        self._inferred = None
        self._wrapping = None
        self._managed = None
        self._frozen = None              # wrapped_models.frozen_models
        self._parameter_loops: dict = {}  # function uid -> its loops over a model's parameters (managed_models)
        self._flows = None
        self.incomplete: list = []      # roots whose analysis hit a budget
        self._no_sync = None
        self._static_graph = (0, False)  # (modules looked at, whether one says static_graph)
        self._eventful: set = set()      # names of project functions that say ROOT_WORDS
        self._eventful_seen = 0
        self._call_words: dict = {}      # function uid -> the names its text calls
        self.calls_at: dict = {}         # path -> (line, column) -> the call there (call_kinds.calls_at)
        self._by_name: dict = {}         # function name -> the project functions of that name
        self._relays: dict = {}          # name -> whether a function of that name calls an eventful one
        self.per_call: set = set()       # uids of roots that are the body of a loop out of view
        self.then_call: dict = {}        # root uid -> the sibling method that steps after it
        self._ducks: dict = {}           # method name -> duck_method's answer
        self.never_skipping = None       # static._never_skipping: accumulate() calls that never skip

    def close(self) -> None:
        """Let go of everything (see Project.close): flows point back at this program."""
        for flow in self._flows or ():
            flow.close()
        self._flows = None
        self.values.close()
        self._words.clear()
        self._stmt_words.clear()
        self.project.close()

    @property
    def mentions_no_sync(self) -> bool:
        """Does the project turn sync off anywhere? (An opaque context may then hide a no_sync.)"""
        if self._no_sync is None:
            # (in code: nanoGPT's comment on why it writes the flag instead of ``model.no_sync()`` is none)
            self._no_sync = any("no_sync" in m.text and _NO_SYNC_IN_CODE.search(m.text)
                                for m in self.project.modules()) or \
                any(text is not None and "no_sync" in text and _NO_SYNC_IN_CODE.search(text)
                    for _, text in self.project.catalog.values())
        return self._no_sync

    @property
    def mentions_static_graph(self) -> bool:
        """Does a parsed module pass ``static_graph=``? Only then does a loop's first iteration matter
        beyond the tests of its own counter (SC106: the first forward of a static-graph DDP model)."""
        seen, found = self._static_graph
        modules = self.project.by_path
        if not found and seen < len(modules):
            found = any("static_graph" in m.text and _passes_static_graph(m.tree) for m in list(modules.values())[seen:])
            self._static_graph = (len(modules), found)
        return found

    # -- flows ---------------------------------------------------------------------------------------
    def flows(self) -> list:
        if self._flows is None:
            from synccheck.analyzer.project.syncflow import Flow
            self._flows = []
            work = 0
            for root in self.roots():
                if work > MAX_ROOT_WORK:
                    self.incomplete.append(root)
                    continue
                for receiver in self._receivers(root):
                    try:
                        flow = Flow(self, root, receiver).run()
                    except RecursionError:
                        self.incomplete.append(root)
                        continue
                    work += flow.work
                    if flow.incomplete:
                        self.incomplete.append(root)
                    self._flows.append(flow)
        return self._flows

    def _receivers(self, root) -> list:
        """The instances a root runs on, one analysis each: a base class's method whose class leaves
        hooks to its subclasses (``self.train_one_step(...)``, ``criterion = self.get_criterion()``
        filled in each of three ``TrainTester`` subclasses) runs on each of them apart, so the
        criterion one builds meets only its own step. [None] (``self`` as the values say) otherwise."""
        if not isinstance(root, Function) or not root.is_method or not root.params:
            return [None]
        held = self.values.parameter(root, root.params[0])
        classes = [v for v in held if isinstance(v, Inst)]
        if not 1 < len(classes) <= MAX_RECEIVERS or len(classes) != len(held) or \
                not self.values.leaves_a_hook(root.cls):
            return [None]
        return sorted(classes, key=lambda v: v.cls.uid)

    def roots(self) -> list:
        """Functions and script bodies of linted modules whose loop reaches a backward. Looking at one
        may parse more of the project (a caller, a base class): those modules are looked at too."""
        out, seen = [], set()
        drivers_read = False
        while True:
            fresh = [m for m in self.project.modules() if m.path not in seen]
            if not fresh and not drivers_read:
                # no training loop in view: a linted file of the component not parsed yet whose loop
                # calls a parsed training function nobody in view calls (mmengine-style
                # ``runner.run_iter`` -> ``optim_wrapper.update_params(loss)``) is where it is
                drivers_read = True
                fresh = drivers_of(self, seen)
            if not fresh:
                return out
            for module in fresh:
                seen.add(module.path)
                if not (module.linted or module.context) or module.on_demand and not module.linted:
                    # (a file parsed on demand, for a caller or a subclass, has none of a training
                    # loop's words: gate.eager said it cannot hold a finding; a context file's loop
                    # is a root, its findings in the linted files are reported)
                    continue
                if module.on_demand:
                    # a linted base class parsed for its subclass: its loop may drive the subclass's step
                    # (dessurt's ``BaseTrainer.train``: ``for self.iteration in range(...):
                    # self._train_iteration(self.iteration)``, the backward in QATrainer's override)
                    out.extend(fn for fn in list(module.functions.values()) if fn.cls is not None and
                               _loops(fn.node.body) and self._calls_a_hook(fn) and
                               self._calls_eventful(module.segment(fn.node), fn.uid) and
                               self._loop_reaches_backward(fn.node.body, fn, _loops(fn.node.body)))
                    continue
                engine_steps = _engine_process_functions(module) if "Engine(" in module.text else ()
                for fn in list(module.functions.values()):
                    # words first: most functions with a loop say nothing a training loop says
                    segment = module.segment(fn.node)
                    if fn.node.name in engine_steps and fn.uid not in self.per_call and \
                            self.fn_words(fn) & {"backward", "call"} and self.fn_words(fn) & {"step", "call"}:
                        # ignite's ``Engine(update)``: the engine calls ``update(engine, batch)`` once per
                        # batch, in a loop we do not see (CDial-GPT, ignite's references)
                        self.per_call.add(fn.uid)
                        out.append(fn)
                        continue
                    loops = ("for " in segment or "while " in segment) and (
                        any(w in segment for w in ROOT_WORDS) or self._calls_eventful(segment, fn.uid)) and _loops(fn.node.body)
                    if loops and self._loop_reaches_backward(fn.node.body, fn, loops):
                        out.append(fn)
                    elif lightning_manual_step(fn, segment):
                        out.append(fn)
                    elif ("step" in segment or "backward" in segment or self._calls_eventful(segment, fn.uid)) and \
                            per_call_step(self, fn):
                        self.per_call.add(fn.uid)
                        out.append(fn)
                    elif ("for " in segment or "while " in segment) and \
                            ("backward" in segment or self._calls_eventful(segment, fn.uid)) and \
                            _loops(fn.node.body) and (stepper := sibling_step(self, fn)) is not None:
                        self.then_call[fn.uid] = stepper
                        out.append(fn)
                top = module.script_body()
                loops = _loops(top)
                if loops and self._loop_reaches_backward(top, module, loops):
                    out.append(module)

    def _calls_a_hook(self, fn) -> bool:
        """Does the method call, on ``self``, one its class leaves to subclasses (abstract, a stub, or
        not defined in the class at all)?"""
        if not fn.params:
            return False
        for node in walk(fn.node):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == fn.params[0]:
                found = self.project.attribute(fn.cls, node.func.attr)
                if found is None or isinstance(found, Function) and (found.abstract or found.stub):
                    return True
        return False

    def _calls_eventful(self, segment: str, key=None) -> bool:
        """Does this code call, by name, a function of the project whose text says a training loop's
        words (``self.fit_batch(batch)`` where fit_batch runs the backward)? ``key``: the names the
        code calls are kept under it (a function is asked up to three times)."""
        modules = self.project.modules()
        if self._eventful_seen < len(modules):
            for module in modules[self._eventful_seen:]:
                for fn in module.functions.values():
                    self._by_name.setdefault(fn.node.name, []).append(fn)
                if not any(w in module.text for w in ROOT_WORDS):
                    continue            # (a function's text is a part of its module's)
                for fn in module.functions.values():
                    if fn.node.name not in self._eventful and any(w in module.segment(fn.node) for w in ROOT_WORDS):
                        self._eventful.add(fn.node.name)
            self._eventful_seen = len(modules)
            self._relays = {}
        words = self._names_called(segment, key)
        if not self._eventful.isdisjoint(words):
            return True
        # one call further: ``self.run_epoch(...)`` whose body is ``self.task.train_epoch(model=...)``
        for name in words:
            relays = self._relays.get(name)
            if relays is None:
                relays = self._relays[name] = any(
                    not self._eventful.isdisjoint(self._names_called(fn.module.segment(fn.node), fn.uid))
                    for fn in self._by_name.get(name, ()))
            if relays:
                return True
        return False

    def _names_called(self, segment: str, key=None) -> frozenset:
        words = self._call_words.get(key) if key is not None else None
        if words is None:
            words = frozenset(CALL_WORD.findall(segment))
            if key is not None:
                self._call_words[key] = words
        return words

    def _loop_reaches_backward(self, body, scope, loops) -> bool:
        """``loops``: the loops of ``body`` (_loops)."""
        for loop in loops:
            words = self.words(loop.body, scope)
            steps = "step" in words or "zero_grad" in words or bool(words & set(SYNC_WORDS))
            # the backward may be in a callable the loop holds as a value (MAE's ``loss_scaler(...)``)
            if steps and ("backward" in words or "call" in words):
                return True
            # micro-batches in an inner loop, one step after it (fairseq's ``train_step``)
            if "backward" in words and "step" in self.words(body, scope):
                return True
        return False

    def call_targets(self, call: ast.Call, scope) -> list:
        out = []
        for v in self.values.expr(call.func, scope):
            if isinstance(v, (Func, Bound)):
                out.append(v.fn)
            elif isinstance(v, Cls):
                init = self.project.attribute(v.cls, "__init__")
                if isinstance(init, Function):
                    out.append(init)
            elif isinstance(v, Inst):
                method = self.project.attribute(v.cls, "__call__")
                if isinstance(method, Function):
                    out.append(method)
        return out

    def returns_scaled(self, fn: Function) -> Optional[bool]:
        """Does what ``fn`` returns go through a division or multiplication (``return loss / accum``)?"""
        return self._scaled_returns(fn)[0]

    def scaled_through_items(self, fn: Function) -> bool:
        """Is what ``fn`` returns divided only in the entries of a container it sums (mmf's
        ``report.losses[key] = value.mean() / divisor`` then ``sum(... for l in loss_dict.values())``,
        ``loss_dict`` being ``report.losses``)? The walk of the function in place does not follow
        stores into a subscript of an attribute."""
        return self._scaled_returns(fn)[1]

    def _scaled_returns(self, fn: Function) -> tuple:
        key = ("scaled", fn.uid)
        if key not in self._words:
            info = self.values.info(fn)
            self._words[key] = (None, False)
            found, through_items = _scaled_walk(info, _item_stores(fn.node), fn.node)
            # (and not so without the stores: the walk with none is the names' own)
            self._words[key] = (found, found and through_items and not _scaled_walk(info, {}, fn.node)[0])
        return self._words[key]

    # words that are no event by themselves: a call of a value (maybe a model), a way out, a wrapper made
    CALLS_ONLY = frozenset(("call", "exit", "wrap"))

    def has_events(self, fn: Function) -> bool:
        """Worth analysing in place: it may run an event, or call a model held in a value."""
        return bool(self.fn_words(fn) - {"exit", "wrap"})

    def relevant_branch(self, stmt, fr) -> bool:
        return bool((self.words(stmt.body, fr.scope) | self.words(stmt.orelse, fr.scope)) - {"call"})

    def decides_step(self, stmt: ast.If, fr) -> bool:
        body, orelse = self.words(stmt.body, fr.scope), self.words(stmt.orelse, fr.scope)
        if "step" in body and "step" in orelse:
            # ``if use_fp16: ... scaler.step(opt) ... else: ... opt.step()``, each with its own early
            # ``break``: both sides step, a way out inside them is their own (SLAM-LLM, llama-recipes)
            return False
        if "backward" in body and "step" in body and not orelse:
            # ``if state == "train": loss.backward(); if (i + 1) % accum == 0: step()``: a mode that runs
            # the whole micro-step, its schedule inside (ClearerVoice's solver), not a check that skips
            # a step now and then
            return False
        return ("step" in body) != ("step" in orelse) or "exit" in body or "exit" in orelse

    def steps_in(self, stmts, fr) -> bool:
        return "step" in self.words(stmts, fr.scope)

    def loop_runs_backward(self, loop, fr) -> bool:
        return "backward" in self.words(loop.body, fr.scope)

    # -- models --------------------------------------------------------------------------------------
    def duck_method(self, name: str, caller=None, call=None):
        """``obj.name(...)`` on an object we cannot trace: see duck.py. Bound to an instance of the
        defining class, or None."""
        caller_cls = caller.cls if isinstance(caller, Function) else None
        key = (name, caller_cls.uid if caller_cls is not None else None,
               (len(call.args), tuple(k.arg or "" for k in call.keywords)) if call is not None else None)
        if key not in self._ducks:
            found = duck_method(self.project, name, caller_cls, call)
            self._ducks[key] = Bound(found[0], Inst(found[1])) if found is not None else None
        return self._ducks[key]


def _passes_static_graph(tree) -> bool:
    """``DDP(..., static_graph=True)``, ``dict(static_graph=...)``, ``{"static_graph": ...}``,
    ``model._set_static_graph()`` (not a docstring that names it)."""
    for node in ast.walk(tree):
        if type(node) is ast.keyword and node.arg == "static_graph" or \
                type(node) is ast.Constant and node.value == "static_graph" or \
                type(node) is ast.Attribute and node.attr == "_set_static_graph":
            return True
    return False


_walk_no_defs = walk_no_defs      # ast.walk without entering nested functions, classes or lambdas


def _loops(body) -> list:
    """The loops of a block, in the order ``_walk_no_defs`` meets them (nested functions' left out)."""
    return [node for stmt in body for node in block_nodes_no_defs(stmt)
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While))]


def _engine_process_functions(module) -> set:
    """Names of the functions handed to ``Engine(fn)`` (ignite's, or a subclass named ``...Engine``) in a
    module: each runs once per batch of ``engine.run(loader)``."""
    out = set()
    for node in walk(module.tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name) and \
                called_name(node).endswith("Engine"):
            out.add(node.args[0].id)
    return out


def lightning_manual_step(fn, segment: str) -> bool:
    """A LightningModule's ``training_step`` under manual optimization: Lightning calls it once per
    batch, so its body is the micro-step of a loop we do not see (``self.manual_backward(loss)``,
    ``opt.step()`` every few batches)."""
    return fn.node.name == "training_step" and fn.cls is not None and "manual_backward(" in segment and \
        "automatic_optimization" in fn.module.segment(fn.cls.node) and len(fn.params) >= 3


def _scaled_walk(info, items: dict, fn_node=None) -> tuple:
    """(does a division or multiplication reach what the function returns, was one reached only through
    an entry stored into a container): the returns, the names' assignments, and the entries ``items``
    stored into a container the returned loss sums (``sum(l for l in d.values())``, not a metrics
    dict beside the loss)."""
    from synccheck.analyzer.project.event_methods import scales_by_count
    from synccheck.analyzer.project.events import not_the_count
    found, through_items = False, False
    todo, seen = [(e, False, False) for e in info.returns], set()
    while todo:
        expr, via_items, summed = todo.pop()
        entries = _containers_summed(expr)
        for node in _outside_fresh_calls(expr):
            if isinstance(node, ast.BinOp) and (isinstance(node.op, (ast.Div, ast.FloorDiv)) and
                                                not not_the_count(node, fn_node) or isinstance(
                    node.op, ast.Mult) and (scales_by_count(node.left) or scales_by_count(node.right))):
                # (a product by a weight, ``beta * kld``, ``-0.5 * torch.mean(...)``, is not 1/N)
                found = True
                through_items = through_items or via_items
            elif isinstance(node, (ast.Name, ast.Attribute)):
                text = ast.unparse(node) if isinstance(node, ast.Attribute) else node.id
                if text in seen:
                    continue
                seen.add(text)
                whole = summed or text in entries
                if isinstance(node, ast.Name):
                    todo.extend((value, via_items, whole) for value, _ in info.assigns.get(node.id, ()))
                if whole:
                    todo.extend((value, True, False) for value in items.get(text, ()))
    return found, through_items


def _outside_fresh_calls(expr):
    """The nodes of ``expr``, not entering the arguments of a nonlinearity or a loss function
    (``F.log_softmax(student_logits / T)``: a temperature divides the logits, not the loss)."""
    from synccheck.analyzer.project.event_calls import _FRESH_LOSS

    todo = [expr]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in _FRESH_LOSS:
                todo.append(func)
                continue
        todo.extend(ast.iter_child_nodes(node))


def _containers_summed(expr):
    """The texts of the containers whose entries ``expr`` sums or iterates (``sum(d.values())``,
    ``sum(l.mean() for l in loss_dict.values())``, ``sum(losses)``)."""
    out = set()
    for node in walk(expr):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("values", "items") \
                and isinstance(node.func.value, (ast.Name, ast.Attribute)):
            out.add(ast.unparse(node.func.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sum" and node.args and \
                isinstance(node.args[0], (ast.Name, ast.Attribute)):
            out.add(ast.unparse(node.args[0]))
        elif isinstance(node, ast.comprehension) and isinstance(node.iter, (ast.Name, ast.Attribute)):
            out.add(ast.unparse(node.iter))
    return out


def _item_stores(fn_node) -> dict:
    """``base[key] = value`` in a function, by the text of ``base``: ``{"report.losses": [value]}``."""
    out: dict = {}
    for node in walk_no_defs(fn_node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, (ast.Name, ast.Attribute)):
                    out.setdefault(ast.unparse(target.value), []).append(node.value)
    return out
