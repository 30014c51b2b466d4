"""The words of a block of code (a part of Program): what it may do, read from syntax and the project
index only, through the project functions it calls (``backward``, ``step``, ``zero_grad``, a sync
control, a wrapper made, a call of a value that may be a model). They decide which functions are
roots and whether a callee is worth analysing in place; the flows then resolve every call precisely.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project import vocabulary as vocab
from synccheck.analyzer.project.call_kinds import sets_sync_flag
from synccheck.analyzer.project.index import Class, Function, GlobalRef
from synccheck.analyzer.project.traversal import walk_no_defs
from synccheck.analyzer.project.value_helpers import _class_attrs

# Calls whose names make a file worth a root: words a training loop must say.
STEP_WORDS = ("step",)
SYNC_WORDS = ("no_sync", "require_backward_grad_sync", "set_requires_gradient_sync", "no_backward_sync",
              "accumulate", "disable_allreduce")
EVENT_CALLS = frozenset(("backward", "step", "zero_grad", "no_sync", "accumulate", "set_requires_gradient_sync",
                         "no_backward_sync", "enter_context", "disable_allreduce",
                         "enable_allreduce")) | vocab.GRAD_SYNC
MAX_ROOT_WORK = 400_000
# a root's own text holds one of these (the backward may be in a helper; the step, zero_grad or a
# sync control is where the schedule is)
ROOT_WORDS = ("step", "zero_grad", "no_sync", "backward", "accumulate", "require_backward_grad_sync")
WRAP_CALLS = frozenset(("DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP", "fully_shard", "replicate", "prepare",
                        "prepare_model", "setup", "setup_module", "initialize"))


class Words:
    """What blocks of code and functions may do (a part of Program)."""

    def words(self, stmts, scope) -> frozenset:
        if not stmts:
            return frozenset()
        key = (id(stmts[0]), len(stmts), id(scope))
        found = self._stmt_words.get(key)
        if found is None:
            found = self._stmt_words[key] = self._words_of(stmts, scope)
        return found

    def _stepping_step_classes(self) -> bool:
        """Does a project class named like a scheduler have a ``step`` method that steps an optimizer
        (``self.scaler.step(self.optim)``, ``self.optimizer.step()``)? Then ``scheduler.step()`` may be
        one (a loss-scaling ``Scheduler`` that owns the optimizer), whatever its name says. (An optimizer
        wrapper's own ``step``, fairseq's ``FairseqOptimizer``, says nothing of ``lr_scheduler.step()``.)"""
        found = getattr(self, "_stepping_steps", None)
        if found is None:
            found = False
            for module in self.project.modules():
                if "def step" not in module.text:
                    continue
                for klass in module.classes.values():
                    if "sched" not in klass.node.name.lower():
                        continue
                    method = klass.methods.get("step")
                    if method is not None and _STEPS_AN_OPTIMIZER.search(module.segment(method.node) or ""):
                        found = True
                        break
                if found:
                    break
            self._stepping_steps = found
        return found

    def _words_of(self, stmts, scope) -> frozenset:
        """Event words of a block, through the project functions it calls: syntax and the index only
        (this decides what to analyse; the flows then resolve every call precisely)."""
        out = set()
        for stmt in stmts:
            for node in _walk_no_defs(stmt):
                t = type(node)
                if t is ast.Call:
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                    if name in EVENT_CALLS:
                        if name == "step" and isinstance(func, ast.Attribute) and \
                                _receiver_is_scheduler(func.value) and not self._stepping_step_classes():
                            continue
                        out.add(name)
                    elif name in WRAP_CALLS:
                        out.add("wrap")
                    elif sets_sync_flag(node):
                        out.add("require_backward_grad_sync")
                    targets = self.syntactic_targets(node, scope)
                    if not targets and isinstance(func, ast.Attribute) and vocab.STEPPING_METHOD.match(name):
                        out.add("step")          # ``model.optim_step()`` on an object we cannot follow
                    if targets is None:
                        out.add("call")          # a callable held in a variable or attribute: a model?
                    for fn in targets or ():
                        out |= self.fn_words(fn)
                elif t in (ast.Continue, ast.Break, ast.Return, ast.Raise):
                    out.add("exit")
                elif t is ast.Attribute and isinstance(node.ctx, ast.Store) and node.attr == "require_backward_grad_sync":
                    out.add("require_backward_grad_sync")
                elif t is ast.Attribute and node.attr == "no_sync" and isinstance(node.ctx, ast.Load):
                    out.add("no_sync")           # ``maybe_no_sync = model.no_sync``, entered later
        return frozenset(out)

    def _subclass_methods(self, klass, name: str) -> list:
        from synccheck.analyzer.project.value_helpers import _class_attrs
        if any(name in _class_attrs(self.values, k) for k in self.project.mro(klass)):
            return []
        out = []
        for sub in self.project.subclasses(klass):
            method = self.project.attribute(sub, name)
            if isinstance(method, Function) and not method.is_property and method not in out:
                out.append(method)
        return out

    def syntactic_targets(self, call: ast.Call, scope) -> Optional[list]:
        """The project functions a call names, from syntax and the index alone: ``f()``, ``self.m()``,
        ``module.f()``, ``Class()``. None when the callee is a value (a parameter, ``self.model``)."""
        func = call.func
        module = scope.module if isinstance(scope, Function) else scope
        if isinstance(func, ast.Name):
            if isinstance(scope, Function):
                fn = scope
                while fn is not None:
                    if func.id in fn.nested:
                        return [fn.nested[func.id]]
                    if func.id in fn.params:
                        return None
                    fn = fn.parent
            sym = self.project.resolve(module, func.id)
            return _callables(self.project, sym)
        if isinstance(func, ast.Subscript):
            return None                          # self.modules["encoder"](x): a model kept in a container
        if isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super" and \
                    isinstance(scope, Function) and scope.cls is not None:
                # ``super().compute_loss(batch)`` in a mixin: the method after this class in the MRO of
                # every class that has it
                return self._after_in_mro(scope.cls, func.attr)
            if isinstance(base, ast.Name) and isinstance(scope, Function) and scope.cls is not None and \
                    scope.params and base.id == scope.params[0]:
                found = self.project.attribute(scope.cls, func.attr)
                if isinstance(found, Function) and found.is_property:
                    return None                  # ``self._pytorch_model(batch)``: what the property returns is called
                if isinstance(found, Function) and (found.abstract or found.stub):
                    # a hook the subclasses fill (``raise NotImplementedError``, or left empty): what
                    # runs is their overrides
                    out = []
                    for sub in self.project.subclasses(scope.cls):
                        override = self.project.attribute(sub, func.attr)
                        if isinstance(override, Function) and not override.abstract and not override.stub and \
                                override not in out:
                            out.append(override)
                    return out or [found]
                if isinstance(found, Function):
                    return [found]
                if found is None:
                    # ``self.run_step()`` in a base class that leaves it to its subclasses without a stub
                    # (detectron2's TrainerBase.train): what runs is theirs, unless it is an attribute
                    subs = self._subclass_methods(scope.cls, func.attr)
                    if subs:
                        return subs
                return None                      # self.model(...): an attribute, maybe a wrapper
            if isinstance(base, ast.Name) and isinstance(scope, Function) and \
                    base.id in self.values.info(scope).assigns:
                # ``trainer = Trainer(...)`` then ``trainer.train_step(batch)``: the class's method
                found = []
                for value, path in self.values.info(scope).assigns[base.id]:
                    if isinstance(value, ast.Call) and not path and isinstance(value.func, (ast.Name, ast.Attribute)):
                        sym = self.project.resolve_expr(module, value.func)
                        # (``trainer = build_trainer(args)``, a factory that returns ``YoloTrainer(args)``)
                        for klass in [sym] if isinstance(sym, Class) else _returned_classes(self.project, sym):
                            for target in _callables(self.project, self.project.attribute(klass, func.attr)):
                                if target not in found:
                                    found.append(target)
                return found
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and isinstance(scope, Function) and \
                    scope.cls is not None and scope.params and base.value.id == scope.params[0]:
                # ``self.optim_wrapper.update_params(loss)`` with ``self.optim_wrapper = AmpOptimWrapper(...)``
                found = []
                for klass in self._stored_classes(scope.cls, base.attr):
                    for target in _callables(self.project, self.project.attribute(klass, func.attr)):
                        if target not in found:
                            found.append(target)
                if found:
                    return found
            if isinstance(base, (ast.Name, ast.Attribute)):
                sym = self.project.resolve_expr(module, base)
                if sym is not None and not isinstance(sym, GlobalRef):
                    return _callables(self.project, self.project.attribute(sym, func.attr))
            if any(_names_model(a) for a in list(call.args) + [k.value for k in call.keywords]) or (
                    vocab.STEPPING_METHOD.match(func.attr) and isinstance(base, ast.Name) and
                    isinstance(scope, Function) and base.id in scope.params):
                # ``self.task.train_step(sample, self.model, ...)``: an object we cannot trace, handed
                # the model (see duck.py); or a parameter's method that steps
                # (``accelerator.take_optimizer_step()`` on a project's wrapper of the Accelerator)
                duck = self.duck_method(func.attr, scope, call)
                return [duck.fn] if duck is not None else []
            if isinstance(base, ast.Name) and isinstance(scope, Function) and base.id in scope.params and \
                    _MODEL_ATTRIBUTE.search(func.attr):
                return None         # ``policy.model(x)``: a model kept on an object handed in
            return []
        return []

    def _stored_classes(self, klass, attr: str) -> list:
        """The project classes whose instances the class's methods store in ``self.attr``
        (``self.optim_wrapper = AmpOptimWrapper(optimizer, ...)``), from syntax and the index."""
        out = []
        for owner, value, path in _class_attrs(self.values, klass).get(attr, ()):
            if isinstance(value, ast.Call) and not path and isinstance(value.func, (ast.Name, ast.Attribute)):
                sym = self.project.resolve_expr(owner.module if isinstance(owner, Function) else owner, value.func)
                if isinstance(sym, Class) and sym not in out:
                    out.append(sym)
        return out

    def _after_in_mro(self, klass, name: str) -> list:
        if name.startswith("__"):
            return []               # ``super().__init__(...)``: as any call on a value we cannot see
        out = []
        for sub in self.project.subclasses(klass):
            method = self.project.method_after(sub, klass, name)
            if method is not None and method not in out:
                out.append(method)
        return out

    def fn_words(self, fn: Function) -> frozenset:
        found = self._words.get(fn.uid)
        if found is not None:
            return found
        self._words[fn.uid] = frozenset()        # a call cycle ends here
        words = set(self._words_of(fn.node.body, fn))
        words.discard("exit")
        words.discard("wrap")
        self._words[fn.uid] = frozenset(words)
        return self._words[fn.uid]


def _returned_classes(project, fn) -> list:
    """The project classes a function returns instances of, built in its return statements
    (``return YoloTrainer(args)``) or bound to the name it returns; none for anything but a function."""
    if not isinstance(fn, Function):
        return []
    cache = project.__dict__.setdefault("_returned_classes", {})     # (read once per function)
    if fn.uid in cache:
        return cache[fn.uid]
    out = []
    returned = set()        # ``model = SRModel(opt)`` (in each branch) then ``return model``
    made, calls = [], []
    for node in _walk_no_defs(fn.node):
        if isinstance(node, ast.Return):
            calls.append(node.value)
            if isinstance(node.value, ast.Name):
                returned.add(node.value.id)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            made.append((node.targets[0].id, node.value))
    calls += [value for name, value in made if name in returned]
    cache[fn.uid] = out
    for call in calls:
        if isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute)):
            sym = project.resolve_expr(fn.module, call.func)
            if isinstance(sym, Class) and sym not in out:
                out.append(sym)
    return out


def _callables(project, sym) -> list:
    if isinstance(sym, Function):
        return [sym]
    if isinstance(sym, Class):
        init = project.attribute(sym, "__init__")
        return [init] if isinstance(init, Function) else []
    return []


_MODEL_ATTRIBUTE = re.compile(r"model|^net$|_net$|^module$|critic|actor|encoder|decoder|generator|discriminator|"
                              r"backbone|unet|transformer", re.I)


def _names_model(node) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "model" in name.lower()


_STEPS_AN_OPTIMIZER = re.compile(r"\.step\(\s*self\.\w*optim\w*\s*\)|self\.\w*optim\w*\.step\(")


def _receiver_is_scheduler(node) -> bool:
    text = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    text = text.lower()
    return "sched" in text or text in ("lr", "warmup", "ema") or text.endswith("_lr")


_walk_no_defs = walk_no_defs
