"""Stage 3a: narrow a file to the code the rules can use, before libcst sees it.

libcst is the right tree for analysis and fixes, but it costs ~50 us a line to build, and the files that
mention ``backward`` are often the biggest in a code base (torch's own distributed test suite is 10k
lines). CPython's ``ast`` parses ten times faster. So we parse with ``ast`` first -- which also gives
syntax errors in CPython's own words -- and keep only:

* every function or method that contains an *anchor* word of an active rule (``backward``, ``no_sync``,
  a collective, ...) or a *fact* word (a wrapper being built: ``DistributedDataParallel``,
  ``prepare``, ...), and every same-file function those call, transitively;
* module- and class-level statements that are short or mention such a word (a script's body);
* imports.

Everything else is replaced by ``...``, and the lines it took are dropped (libcst turns every blank
line into an object, so keeping them cost as much as the code). Kept lines keep their columns; a line
map gives each narrowed line's number in the original, so findings point at the user's real lines.
"""
from __future__ import annotations

import ast
import re

# A call of a bare name, ``self.name(`` or ``cls.name(``. Where Python has possessive quantifiers
# (3.11+), they and a leading ``\b`` give the same matches in two thirds of the time: a shorter word or
# fewer spaces can never be followed by ``(``, so backtracking into them is wasted work.
try:
    CALL = re.compile(r"\b(?<![\w.])(?:self\.|cls\.)?+(\w++)\s*+\(")
except re.error:
    CALL = re.compile(r"(?<![\w.])(?:self\.|cls\.)?(\w+)\s*\(")

# Where wrapped models, accelerators and samplers are made: facts every rule may need. Call forms,
# so that a 20k-line table that merely mentions "setup" is not kept.
FACT_WORDS = ("DistributedDataParallel(", "FullyShardedDataParallel(", "fully_shard(", ".prepare(", "prepare_model(",
              ".setup(", "setup_module(", "deepspeed.initialize(", "Accelerator(", "Fabric(", "DistributedSampler(",
              "no_sync", "require_backward_grad_sync", "set_requires_gradient_sync", "gradient_accumulation_steps")
# names whose import aliases are fact words too: ``DistributedDataParallel as DDP`` makes "DDP(" one
ALIASED = ("DistributedDataParallel", "FullyShardedDataParallel", "fully_shard", "Accelerator", "Fabric",
           "DistributedSampler")

SHORT = 3   # module-level statements up to this many lines are kept: a script's assignments are its state


def narrow(text: str, anchors: tuple = (), loop_anchors: tuple = (), branch_anchors: tuple = (),
           loop_companions: tuple = ()):
    """(narrowed text, ast tree, None, line map) or (None, None, (line, column, message), None).

    The line map lists, for each line of the narrowed text, its 1-based number in ``text`` (None when
    nothing was dropped).

    ``loop_anchors``: words that matter only inside a loop (``backward``: an accumulation loop), or in
    a function such a loop calls. ``anchors``: words that matter anywhere. ``branch_anchors``: pairs
    of regexes (test, body): an ``if`` whose test matches the first and whose branches match the
    second, or call a function that does (a collective under ``if rank == 0:``).
    ``loop_companions``: when given, a loop anchor counts only in a function where one of these words
    is near: in the function, in what it calls or what calls it (transitively), or in code outside
    every function. An accumulation loop can be reported only if it steps somewhere (``step(``) or
    turns sync off (``no_sync``): a test suite's hundreds of step-less ``backward()`` loops are not
    worth a parse.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        return None, None, (err.lineno or 1, max(err.offset or 1, 1), err.msg or "invalid syntax"), None
    except (ValueError, RecursionError, MemoryError) as exc:
        return None, None, (1, 1, str(exc) or type(exc).__name__), None
    lines = text.splitlines(keepends=True)
    if len(lines) < 200:
        return text, tree, None, None       # small files: narrowing costs more than it saves

    def segment(node) -> str:
        return "".join(lines[first_line(node) - 1:node.end_lineno])

    def code_of(d) -> str:
        """A function's lines without its docstring and full-line comments: the words that decide
        what is kept must be code (torch's docstrings are full of ``loss.backward()`` examples)."""
        first = first_line(d) - 1
        skip = range(0)
        doc = d.body[0] if d.body else None
        if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            skip = range(doc.lineno - 1, doc.end_lineno)
        return "".join(line for i, line in enumerate(lines[first:d.end_lineno], first)
                       if i not in skip and not line.lstrip().startswith("#"))

    facts = FACT_WORDS + tuple(f"{alias.asname}(" for node in tree.body if isinstance(node, ast.ImportFrom)
                               for alias in node.names if alias.asname and alias.name in ALIASED)
    self_fact = re.compile(r"self\.\w+\s*(?::[^=]*)?=[^=].*(?:" + "|".join(re.escape(f) for f in facts) + ")")
    all_defs = list(_defs(tree.body))
    texts = {id(d): code_of(d) for d in all_defs}
    calls = {id(d): set(CALL.findall(texts[id(d)])) for d in all_defs}
    by_name: dict = {}
    for d in all_defs:
        by_name.setdefault(d.name, []).append(d)

    def reaching(names: set) -> set:
        """``names`` and the functions that call one of them, transitively."""
        grown = True
        while grown:
            grown = False
            for d in all_defs:
                if d.name not in names and calls[id(d)] & names:
                    names.add(d.name)
                    grown = True
        return names

    # functions that run a loop anchor, themselves or through what they call
    reaches = reaching({d.name for d in all_defs if any(w in texts[id(d)] for w in loop_anchors)})
    seeds = {id(d) for d in all_defs if any(w in texts[id(d)] for w in anchors)}
    looped = [d for d in all_defs if id(d) not in seeds and loop_anchors
              and any(w in texts[id(d)] for w in ("for ", "while "))
              and any(_loop_reaches(loop, lines, loop_anchors, reaches) for loop in _loops(d.body))]
    if looped and loop_companions and not any(w in _outside(lines, all_defs) for w in loop_companions):
        # near a companion: a function that holds one, calls one (transitively) or is called by one
        holders = {d.name for d in all_defs if any(w in texts[id(d)] for w in loop_companions)}
        near = reaching(set(holders)) | _called_from(holders, calls, by_name)
        looped = [d for d in looped if d.name in near]
    seeds.update(id(d) for d in looped)
    for test_pattern, body_pattern in branch_anchors:
        test_re, body_re = re.compile(test_pattern), re.compile(body_pattern)
        runs = reaching({d.name for d in all_defs if body_re.search(texts[id(d)])})
        for d in all_defs:
            if id(d) in seeds or not test_re.search(texts[id(d)]):
                continue
            for branch in _ifs(d.body):
                test = "".join(lines[branch.test.lineno - 1:branch.test.end_lineno])
                if test_re.search(test):
                    inner = "".join(lines[branch.lineno - 1:branch.end_lineno])
                    if body_re.search(inner) or set(CALL.findall(inner)) & runs:
                        seeds.add(id(d))
                        break
    keep = set(seeds)
    # callers of the seeds: where the model they train was wrapped
    grown = True
    while grown:
        grown = False
        kept_names = {d.name for d in all_defs if id(d) in keep}
        for d in all_defs:
            if id(d) not in keep and calls[id(d)] & kept_names:
                keep.add(id(d))
                grown = True
    # what the seeds call: helpers are inlined at their call sites. A script's own body is a caller
    # too: what its training loop or its rank branch calls is inlined there.
    todo = [d for d in all_defs if id(d) in seeds]
    tests = [re.compile(test) for test, _ in branch_anchors]
    for node in _statements(tree.body):
        text = "".join(lines[node.lineno - 1:node.end_lineno])
        if any(w in text for w in anchors + loop_anchors) or any(t.search(text) for t in tests):
            for x in (x for name in CALL.findall(text) for x in by_name.get(name, ())):
                if id(x) not in keep:
                    keep.add(id(x))
                    todo.append(x)
    while todo:
        for name in calls[id(todo.pop())]:
            for x in by_name.get(name, ()):
                if id(x) not in keep:
                    keep.add(id(x))
                    todo.append(x)
    # methods that bind a wrapper to ``self.x``: every method of the class sees it
    keep |= {id(d) for d in all_defs if self_fact.search(texts[id(d)])}
    # where a loop anchor matters, so does how the loop steps: ``optimizer.step()`` after a script's loop
    words = tuple(anchors) + tuple(loop_anchors) + facts + \
        ((("step(", "zero_grad(") + tuple(loop_companions)) if loop_anchors else ())
    kept_names = {d.name for d in all_defs if id(d) in keep}
    out = list(lines)

    placeholders: dict = {}     # line index of a ``...`` -> its column

    def blank(first: int, last: int, col: int) -> None:
        """Lines first..last (1-based) become one ``...`` at ``col``; the others are dropped."""
        out[first - 1] = " " * col + "...\n"
        placeholders[first - 1] = col
        for i in range(first, last):
            out[i] = None

    def own_lines(node) -> bool:
        """The statement starts its first line and ends its last: safe to replace whole lines."""
        first, last = lines[first_line(node) - 1], lines[node.end_lineno - 1]
        tail = last[node.end_col_offset:].strip() if node.end_col_offset is not None else ""
        return not first[:node.col_offset].strip() and (not tail or tail.startswith("#"))

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if id(node) not in keep and own_lines(node):
                    blank(first_line(node), node.end_lineno, node.col_offset)   # decorators and all
                continue
            if isinstance(node, ast.ClassDef):
                visit(node.body)
                continue
            text = segment(node)
            if not own_lines(node) or any(w in text for w in words) or not kept_names.isdisjoint(CALL.findall(text)):
                continue     # ``main()``, ``train(model, opt)``: calls of kept functions bind their arguments
            # Short assignments are a script's state (``accum = 4``); long statements, and bare
            # expressions (``register(...)``, docstrings) that mention nothing relevant, are not.
            if isinstance(node, (ast.Expr, ast.Pass)) or node.end_lineno - node.lineno + 1 > SHORT:
                blank(first_line(node), node.end_lineno, node.col_offset)

    visit(tree.body)
    del visit    # a recursive closure's cycle through its own cell (see engine._analyse)
    # Siblings dropped one after another need one ``...`` between them, not one each with blank lines.
    previous = None
    for i, line in enumerate(out):
        if line is None:
            continue
        if i in placeholders:
            if previous is not None and placeholders[previous] == placeholders[i]:
                for j in range(previous + 1, i + 1):
                    out[j] = None
                continue
            previous = i
        elif line.strip():
            previous = None
    line_map = [i + 1 for i, line in enumerate(out) if line is not None]
    return "".join(line for line in out if line is not None), tree, None, line_map


def _outside(lines: list, all_defs: list) -> str:
    """The lines outside every function: a script's body, class attributes."""
    covered = bytearray(len(lines) + 1)
    for d in all_defs:
        covered[first_line(d) - 1:d.end_lineno] = b"\1" * (d.end_lineno - first_line(d) + 1)
    return "".join(line for i, line in enumerate(lines) if not covered[i])


def _called_from(names: set, calls: dict, by_name: dict) -> set:
    """The names of the functions that functions named ``names`` call, transitively."""
    found: set = set()
    todo = [d for name in names for d in by_name.get(name, ())]
    while todo:
        for name in calls[id(todo.pop())]:
            if name in by_name and name not in found:
                found.add(name)
                todo.extend(by_name[name])
    return found


def _defs(body):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _defs(node.body)


def _statements(body):
    """The statements outside every function (classes entered), docstrings and imports left out."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _statements(node.body)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Import, ast.ImportFrom)) and \
                not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            yield node


def first_line(node) -> int:
    """ast puts a decorated definition at its ``def`` line; its first line is the first decorator's."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])


def _loops(body):
    """Loops among the statements (expressions are never entered: that is where ast.walk spends)."""
    for node in body:
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            yield node
        for name in ("body", "orelse", "finalbody"):
            yield from _loops(getattr(node, name, ()) or ())
        for handler in getattr(node, "handlers", ()) or ():
            yield from _loops(handler.body)


def _ifs(body):
    for node in body:
        if isinstance(node, ast.If):
            yield node
        for name in ("body", "orelse", "finalbody"):
            yield from _ifs(getattr(node, name, ()) or ())
        for handler in getattr(node, "handlers", ()) or ():
            yield from _ifs(handler.body)


def _loop_reaches(loop, lines, words, reaches) -> bool:
    text = "".join(lines[loop.lineno - 1:loop.end_lineno])
    return any(w in text for w in words) or bool(set(CALL.findall(text)) & reaches)
