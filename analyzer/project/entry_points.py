"""Micro-steps whose loop is not in view: a trainer's ``train_step(batch)`` that runs a backward on every
call and steps the optimizer only when its own counter says so (``if self.n_iter % accum == 0``). The
loop that calls it is in a script we were not given (or in a framework), so the function is analysed
as the body of a loop: ``for _ in <calls>: <body>``.

Only a function nobody in the linted files calls is such an entry point (a caller in view makes the
caller's loop the root), and only when a counter test decides its step: a plain ``train_step`` that
steps on every call accumulates nothing and is left alone.
"""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.imports import training_script_name
from synccheck.analyzer.project.traversal import children, walk

_CALL_WORD = re.compile(r"([A-Za-z_]\w*)\s*\(")
MAX_DEPTH = 2          # how deep into the functions it calls the counter test is looked for


def called_in_view(program, name: str) -> bool:
    """Is ``name`` called anywhere in the linted files or their context (``self.optimize(loss)``; a
    ``def`` is not a call)?"""
    needle, definition = name + "(", "def " + name + "("
    for module in program.project.modules():
        if module.linted or module.context:
            text = module.text
            for match in re.finditer(re.escape(needle), text):
                start = match.start()
                if start and (text[start - 1].isalnum() or text[start - 1] == "_"):
                    continue                       # ``my_optimize(`` is another name
                if text.startswith(definition, start - 4):
                    continue
                if "#" in text[text.rfind("\n", 0, start) + 1:start]:
                    continue                       # ``# ... agent.train_step()`` in a comment
                receiver = _RECEIVER.search(text, max(0, start - 80), start)
                if receiver is not None and _NOT_THE_METHOD.search(receiver.group(1)):
                    continue                       # ``self.optimizer.step()``: an optimizer's, not this ``step``
                return True
    return False


_RECEIVER = re.compile(r"(\w+)\s*\.\s*\Z")
# what an optimizer, a scheduler or a scaler is called: their ``step()`` is not a project method's call
_NOT_THE_METHOD = re.compile(r"optim|sched|scaler|(?:^|_)lr(?:$|_)|^opt(?:_\w+)?$|warmup|ema", re.IGNORECASE)


def per_call_step(program, fn) -> bool:
    """Is ``fn`` a micro-step run by a loop out of view? (See the module's text.)"""
    if fn.node.name.startswith("__"):
        return False
    # cheap first: it, or a function it calls by name, holds a counter test next to a step
    if not _gates_itself(program, fn) and not _calls_gated(program, fn):
        return False
    words = program.fn_words(fn)
    if "backward" not in words or "step" not in words or \
            called_in_view(program, fn.node.name) and not _called_past_the_flow(program, fn):
        return False
    return _counter_gates_step(program, fn, MAX_DEPTH, set())


def _called_past_the_flow(program, fn) -> bool:
    """Is the method ``fn`` called in view only where the flow cannot follow the call to it: on an
    object known only as a parameter (``def train(m, loader): m.optimize(x)``), or through a
    dispatch over more classes than a call is followed into (KAIR's ``model = define_Model(opt)``,
    a dozen model classes, then ``model.optimize_parameters(step)``)? Then nothing analyses it in
    place, and it is a micro-step of a loop out of view."""
    from synccheck.analyzer.project.event_calls import MAX_FANOUT
    from synccheck.analyzer.project.values import Inst, Obj, Unknown
    if fn.cls is None:
        return False
    calls = program.values.calls(fn.node.name)
    if not calls:
        return False
    for scope, call in calls:
        if not isinstance(call.func, ast.Attribute):
            return False
        held = program.values.expr(call.func.value, scope)
        if held and all(isinstance(v, (Unknown, Obj)) for v in held):
            continue
        classes = {v.cls.uid for v in held if isinstance(v, Inst)}
        if len(classes) <= MAX_FANOUT or not any(fn.cls in program.project.mro(v.cls) for v in held
                                                  if isinstance(v, Inst)):
            return False
    return True


MAX_DRIVERS = 8
MAX_DRIVEN_PROJECT = 400


def drivers_of(program, seen: set) -> list:
    """Parse (as files that may hold a finding) the linted files of the component, not parsed yet, that
    call by name a function of a parsed module that runs a backward and a step and that nothing parsed
    calls (roots): at most MAX_DRIVERS, the files with a loop only."""
    project = program.project
    if not project.catalog or len(project.catalog) + len(project.by_path) > MAX_DRIVEN_PROJECT:
        return []           # (a library's package, not a training project)
    program._calls_eventful("")              # (the names of the training functions parsed so far)
    names = sorted(n for n in program._eventful if not n.startswith("__"))
    if not names:
        return []
    calls = re.compile(r"(?<![\w])(" + "|".join(map(re.escape, names)) + r")\(")
    candidates = []         # (file, the training functions it calls)
    for apath in list(project.catalog):
        if apath in project._context_only:
            continue
        text = project.catalog_text(apath)
        # (a training script's name: a driver even when it has no loop of its own)
        if text and ("for " in text or "while " in text or training_script_name(apath)):
            called = set(calls.findall(text))
            if called:
                candidates.append((apath, called))
    orphans: dict = {}
    out = []
    for apath, called in candidates:
        for name in called - set(orphans):
            orphans[name] = "backward" in _words_named(program, name) and not called_in_view(program, name)
        if not any(orphans[n] for n in called) or apath not in project.catalog:
            continue
        module = project._from_catalog(apath)
        if module is not None and module.path not in seen:
            module.on_demand = False
            out.append(module)
            if len(out) >= MAX_DRIVERS:
                break
    return out


def _words_named(program, name: str) -> set:
    words: set = set()
    for fn in program._by_name.get(name, ()):
        words |= program.fn_words(fn)
    return words


def _gates_itself(program, fn) -> bool:
    """Syntax only: an ``if`` on a counter whose branches step (or leave) in ``fn``'s own body."""
    cache = program.__dict__.setdefault("_gates_itself", {})
    found = cache.get(fn.uid)
    if found is None:
        segment = fn.module.segment(fn.node)
        found = False
        if "step(" in segment and ("%" in segment or "+=" in segment or "accum" in segment):
            counters = _Counters(program, fn)
            for node in _walk(fn.node.body):
                if isinstance(node, ast.If) and _is_counter_test(node.test, counters) and \
                        any(_is_step_or_exit(n) for part in (node.body, node.orelse) for n in _walk(part)):
                    found = True
                    break
        cache[fn.uid] = found
    return found


def _calls_gated(program, fn) -> bool:
    """Does ``fn`` call, by name, a function of a parsed module that gates its own step?"""
    gated = _gated_names(program)
    if not gated:
        return False
    segment = fn.module.segment(fn.node)
    return any(name + "(" in segment for name in gated) and \
        not gated.isdisjoint(_CALL_WORD.findall(segment))


def _gated_names(program) -> set:
    state = program.__dict__.setdefault("_gated_names", (set(), set()))
    scanned, names = state
    if len(scanned) == len(program.project.by_path):
        return names
    for module in program.project.modules():
        if module.path not in scanned:
            scanned.add(module.path)
            if "step(" in module.text:
                names.update(fn.node.name for fn in module.functions.values() if _gates_itself(program, fn))
    return names


def _is_step_or_exit(node) -> bool:
    if isinstance(node, (ast.Return, ast.Continue, ast.Break)):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"


def _counter_gates_step(program, fn, depth: int, seen: set) -> bool:
    if fn.uid in seen:
        return False
    seen.add(fn.uid)
    counters = _Counters(program, fn)
    for node in _walk(fn.node.body, loops=False):
        if isinstance(node, ast.If) and _is_counter_test(node.test, counters):
            body, orelse = program.words(node.body, fn), program.words(node.orelse, fn)
            if ("step" in body) != ("step" in orelse) or \
                    (("exit" in body or "exit" in orelse) and "step" in program.fn_words(fn)):
                return True
        elif isinstance(node, ast.Call) and depth > 0:
            for target in program.syntactic_targets(node, fn) or ():
                if "step" in program.fn_words(target) and _counter_gates_step(program, target, depth - 1, seen):
                    return True
    return False


def _is_counter_test(test, counters: "_Counters") -> bool:
    """``x % n == 0`` in any form, or a comparison on a counter the class or function increments; or
    a name the function set to such a test (``do_step = self.n % self.period == 0``, ``if do_step:``)."""
    bare = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else test
    if isinstance(bare, (ast.Name, ast.Attribute)):
        value = counters.flags().get(_dotted(bare))
        return value is not None and _is_counter_test(value, counters)
    compared = []
    for node in walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
        if isinstance(node, ast.Compare):
            compared.extend(_dotted(part) for part in [node.left] + list(node.comparators))
    return any(name and name in counters for name in compared)


class _Counters:
    """Names and ``self.x`` attributes incremented (``+= 1``) in a function or anywhere in its class,
    collected on the first question (once per class)."""

    def __init__(self, program, fn) -> None:
        self.scope = fn.cls.node if fn.cls is not None else fn.node
        self.known = program.__dict__.setdefault("_counters", {})
        self.fn = fn
        self._flags = None

    def flags(self) -> dict:
        """Names (and ``self.x`` attributes) the function binds once to a test: name -> the test (a name
        bound twice is left out). ``self.update = (self.count + 1) % self.n == 0 or update`` (KAIR)."""
        if self._flags is None:
            seen: dict = {}
            for node in walk(self.fn.node):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and _dotted(node.targets[0]):
                    name = _dotted(node.targets[0])
                    seen[name] = None if name in seen else node.value
            self._flags = {k: v for k, v in seen.items() if isinstance(v, (ast.Compare, ast.BoolOp))}
        return self._flags

    def __contains__(self, name: str) -> bool:
        names = self.known.get(id(self.scope))
        if names is None:
            names = self.known[id(self.scope)] = set()
            for node in walk(self.scope):
                if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
                    names.add(_dotted(node.target))
                elif isinstance(node, ast.Assign) and len(node.targets) == 1 and _wraps_around(node.value):
                    names.add(_dotted(node.targets[0]))    # ``self.n = (self.n + 1) % self.update_freq``
        return name in names


def _wraps_around(value) -> bool:
    """``(x + 1) % n``: a counter that goes round."""
    return isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mod) and isinstance(value.left, ast.BinOp) and \
        isinstance(value.left.op, ast.Add)


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


_SKIPPED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_SKIPPED_AND_LOOPS = _SKIPPED + (ast.For, ast.AsyncFor, ast.While)


def _walk(body, loops: bool = True):
    """The nodes of a body, nested definitions left out; ``loops=False``: loops left out too (a step
    gated inside a loop of the function is that loop's business, not once per call)."""
    stack = [n for n in reversed(body) if loops or not isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
    while stack:
        node = stack.pop()
        yield node
        for child in children(node):
            if not isinstance(child, _SKIPPED if loops else _SKIPPED_AND_LOOPS):
                stack.append(child)


def per_call_loop(fn) -> ast.For:
    """``for __call__ in __calls__: <body>``: the loop out of view that calls ``fn`` once per micro-step."""
    node = fn.node
    target = ast.Name("__call__", ast.Store())
    iterated = ast.Name("__calls__", ast.Load())
    loop = ast.For(target=target, iter=iterated, body=node.body, orelse=[])
    for part in (loop, target, iterated):
        ast.copy_location(part, node)
        part.end_lineno, part.end_col_offset = node.end_lineno, node.end_col_offset
    return loop


# -- a chunked backward whose step is in a sibling method -------------------------------------------------
# ``trainer(batch)`` splits the batch and runs a backward per chunk; ``trainer.update()`` steps. Users
# call one after the other, in a loop we do not see (imagen-pytorch's ImagenTrainer).

OUT_OF_VIEW = "out of view"     # the step after the chunks is in a caller we were not given
# a module whose chunk loop may be followed by a step out of view says how it trains (a scheduler's
# ``.step(`` or "sub-optimal" does not)
_TRAINING_WORDS = re.compile(r"optimizer|optim\.|\bscaler\b|accumulat|zero_grad")


def sibling_step(program, fn):
    """What steps after ``fn``'s chunk loop, when ``fn`` is a function whose loop runs a backward per
    chunk, with no step or zero_grad of its own, that nobody in the linted files calls: the one public
    method of its class that steps, else OUT_OF_VIEW (SlowFast's ``contrastive_forward``: a backward per
    clip, the step in tools/train_net.py); None when ``fn`` is not such a function."""
    if fn.parent is not None or fn.node.name.startswith("test"):
        return None              # a unit test's loop over devices or dtypes runs one backward each
    if fn.cls is None and (not _says_training(program, fn.module) or _reads_grad(fn.node)):
        return None              # (the test below for a function with no class, before its words are read)
    words = program.fn_words(fn)
    if "backward" not in words or "step" in words or "zero_grad" in words:
        return None
    loops = [loop for loop in _loops(fn.node.body) if "backward" in program.words(loop.body, fn)]
    # a retry loop (``try: loss.backward(); break`` / ``except OutOfMemoryError``) runs one backward
    if not loops or any(isinstance(n, ast.Try) for loop in loops for n in _walk(loop.body)):
        return None
    steppers = [m for m in fn.cls.methods.values()
                if m is not fn and "step" in program.fn_words(m) and "backward" not in program.fn_words(m)
                and not m.node.name.startswith("_") and len(m.params) >= 1] if fn.cls is not None else []
    if len(steppers) > 1 or (not steppers and (not _says_training(program, fn.module) or _reads_grad(fn.node))):
        return None
    if fn.node.name not in ("__call__", "forward") and called_in_view(program, fn.node.name):
        return None
    return steppers[0] if steppers else OUT_OF_VIEW


def _says_training(program, module) -> bool:
    """Does the module's text say how it trains (_TRAINING_WORDS)? Read once per module."""
    known = program.__dict__.setdefault("_says_training", {})
    found = known.get(module.path)
    if found is None:
        found = known[module.path] = _TRAINING_WORDS.search(module.text) is not None
    return found


def _reads_grad(node) -> bool:
    """``image.grad`` read: a backward for the gradient of an input (guided sampling), not training."""
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.ctx, ast.Load)
               for n in walk(node))


def then_call(fn, method) -> list:
    """``fn``'s body, then ``self.<method>()`` (or a step of an unknown optimizer): the chunks, then
    the step."""
    node = fn.node
    if method == OUT_OF_VIEW:
        # ``__optimizer__.step()``: an optimizer we know nothing of, stepping every model
        call = ast.Call(ast.Attribute(ast.Name("__optimizer__", ast.Load()), "step", ast.Load()), [], [])
    else:
        call = ast.Call(ast.Attribute(ast.Name(fn.params[0], ast.Load()), method.node.name, ast.Load()), [], [])
    stmt = ast.Expr(call)
    for part in (stmt, call, call.func, call.func.value):
        part.lineno, part.col_offset = node.end_lineno, 0
        part.end_lineno, part.end_col_offset = node.end_lineno, 0
    body = list(node.body)
    if body and isinstance(body[-1], ast.Return):
        # ``return total``: the step comes after it (its value is computed; an early return inside a
        # branch still leaves without the step)
        last = body.pop()
        if last.value is not None:
            body.append(ast.copy_location(ast.Expr(last.value), last))
    return body + [stmt]


def _loops(body):
    for node in _walk(body):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            yield node
