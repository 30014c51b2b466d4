"""The pipeline, one stage a module: find files -> filter -> parse -> model -> rules -> report.

``check_source`` runs stages 2-5 on one text; ``lint`` runs the whole pipeline over paths, in a process
pool when enough files need parsing to pay for one.
"""
from __future__ import annotations

import gc
import os
from typing import Iterable, Optional, Sequence

from synccheck.analyzer.files import discover
from synccheck.analyzer.ftypes import Finding, LintResult
from synccheck.analyzer.rules import ALL_RULES, BY_CODE
from synccheck.analyzer.source import decode_source, read_bytes
from synccheck.analyzer.suppress import ALL, SUPPRESS, SUPPRESS_FILE, file_ignores, ignored, suppressed

__all__ = ["check_source", "lint", "select_rules", "wanted_rules", "SUPPRESS", "SUPPRESS_FILE"]
# Parsing is ~20 ms a file; a pool costs ~50 ms to start on 2 cores.
POOL_MIN_FILES = 8


class RuleContext:
    """What a rule sees of one module, and how it reports."""

    def __init__(self, model, path: str) -> None:
        self.model = model
        self.path = path
        self.raw: list = []
        self._loops = None
        self._unsynced: dict = {}

    @property
    def loops(self) -> list:
        if self._loops is None:
            from synccheck.analyzer.paths import accumulation_loops
            self._loops = accumulation_loops(self.model)
        return self._loops

    def report(self, rule, node, message: str, fix: str = "") -> None:
        self.raw.append((rule, node, message, fix))

    def unsynced_step(self, acc) -> list:
        """Boundary micro-steps whose gradients are never all-reduced, grouped by gate literals."""
        key = id(acc)
        if key not in self._unsynced:
            self._unsynced[key] = [] if acc.too_complex else acc.all_groups(True, acc.unsynced)
        return self._unsynced[key]

    def describe(self, acc, lits) -> str:
        from synccheck.analyzer.paths import describe_lits
        return describe_lits(acc, lits)

    def grads_rescaled(self, acc) -> bool:
        """The loop rescales gradients itself before stepping (fairseq's ``optimizer.multiply_grads``)."""
        text = self.model.code(acc.function.node) if acc.function.name != "<module>" else self.model.source
        return any(w in text for w in ("multiply_grads", ".grad.div_", ".grad.mul_", "scale_grads", "grad /=",
                                       "grad *="))

    def step_text(self, acc, backward) -> str:
        """How the step that follows this backward is spelled (``scaler.step(opt)``)."""
        for path in acc.paths:
            for r in path.records[path.records.index(backward) + 1:] if backward in path.records else ():
                if type(r).__name__ == "Step" and acc.steps_model(r, backward.model):
                    return self.model.code(r.node).strip()
        return "optimizer.step()"

    @staticmethod
    def model_name(key: Optional[str]) -> str:
        if not key:
            return "the model"
        key = key.split(":", 1)[-1]          # local to a function: the name as written
        if key.startswith("@"):
            return "self." + key.split(".", 1)[1]
        return key


def select_rules(select: Optional[Sequence[str]] = None, ignore: Optional[Sequence[str]] = None) -> list:
    """Rules chosen by code prefixes, ruff style: ``SC1`` selects SC101..SC106."""
    chosen = [r for r in ALL_RULES if not select or any(r.code.startswith(p) for p in select)]
    return [r for r in chosen if not ignore or not any(r.code.startswith(p) for p in ignore)]


def wanted_rules(text: str, rules: Sequence) -> list:
    """Stage 2b: the cheap filter. Rules whose words the text lacks cannot fire; skip them."""
    return [r for r in rules if r.code != "SC000" and r.wants(text)]


def check_source(text: str, path: str = "<string>", rules: Optional[Sequence] = None,
                 filtered: bool = True, measure_whole_file: bool = False) -> list:
    """Findings for one source text (no file system, no cache).

    ``measure_whole_file``: position findings with libcst's metadata over the whole file, the slow
    reference the tests compare the per-function positions against.
    """
    rules = list(ALL_RULES) if rules is None else list(rules)
    off = file_ignores(text)
    if off == ALL:
        return []
    active = wanted_rules(text, rules) if filtered else [r for r in rules if r.code != "SC000"]
    active = [r for r in active if not ignored(r.code, off)]
    if not active:
        return []
    from synccheck.analyzer.narrow import narrow
    from synccheck.analyzer.parse import parse

    anchors = tuple(sorted({w for r in active for w in r.anchors}))
    loop_anchors = tuple(sorted({w for r in active for w in r.loop_anchors}))
    branch_anchors = tuple(sorted({pair for r in active for pair in r.branch_anchors}))
    loop_rules = [r for r in active if r.loop_anchors]
    companions = () if any(not r.loop_companions for r in loop_rules) else \
        tuple(sorted({w for r in loop_rules for w in r.loop_companions}))
    narrowed, tree, error, line_map = narrow(text, anchors, loop_anchors, branch_anchors, companions)
    module = None
    if narrowed is not None:
        module, error = parse(narrowed)
        if error is not None and line_map:
            error = (line_map[min(error[0], len(line_map)) - 1],) + tuple(error[1:])
    if module is None:
        if any(r.code == "SC000" for r in rules):
            line, column, message = error
            rule = BY_CODE["SC000"]
            return suppressed(text, [Finding(rule.code, rule.name, rule.severity, path, line, column, line,
                                              column, f"cannot parse: {message}",
                                              "fix the syntax error; nothing else in this file was checked")])
        return []
    from synccheck.analyzer.model import ModuleModel
    ctx = RuleContext(ModuleModel(module, path, source=narrowed), path)
    for rule in active:
        rule().check(ctx)
    positioned = _positioned(ctx.model, None if measure_whole_file else tree, path, ctx.raw, line_map)
    return suppressed(text, positioned, tree)


def _positioned(model, tree, path: str, raw: list, line_map=None) -> list:
    """Positions for reported nodes only.

    libcst's PositionProvider re-generates the code it measures (~10x the cost of the parse), so it
    runs on the function (or top-level statement) that holds each finding, and the stdlib-ast twin of
    that statement says where it starts in the file.
    """
    if not raw:
        return []
    from synccheck.analyzer.positions import locate

    out: dict = {}
    for (rule, node, message, fix), pos in zip(raw, locate(model, tree, [r[1] for r in raw], line_map)):
        if pos is None:
            continue
        (line, column), (end_line, end_column) = pos
        finding = Finding(rule.code, rule.name, rule.severity, path, line, column, end_line, end_column,
                          message, fix)
        out.setdefault((finding.code, finding.line, finding.column), finding)
    return sorted(out.values(), key=lambda f: (f.line, f.column, f.code))


def lint(paths: Iterable[str], rules: Optional[Sequence] = None, jobs: Optional[int] = None,
         is_excluded=lambda path: False, cache_dir: Optional[str] = None,
         ignored_codes=lambda path: ()) -> LintResult:
    """The whole pipeline over files and folders. ``cache_dir=None``: no cache.

    ``is_excluded(path)`` and ``ignored_codes(path)`` (code prefixes not reported for that file) come
    from the configuration; the cache holds results before ``ignored_codes``, so it stays valid when
    they change.
    """
    rules = list(ALL_RULES) if rules is None else list(rules)
    codes = tuple(r.code for r in rules)
    gates = tuple({g.encode() for r in rules for g in r.gate()})
    paths = list(paths)
    jobs = jobs if jobs is not None else _usable_cpus()
    cache = None
    if cache_dir is not None:
        from synccheck.analyzer.cache import Cache
        cache = Cache(cache_dir, codes)
    pool = _Pool(jobs)
    if not (cache and cache.by_path) and any(os.path.isdir(p) for p in paths) \
            and all(os.path.exists(p) for p in paths):
        # A cold folder walk: start the workers now, so that they import libcst and the rules (~0.3 s)
        # while this process finds, reads and gates the files.
        pool.start()
    try:
        return _lint(paths, codes, gates, pool, is_excluded, cache, ignored_codes)
    finally:
        pool.close()


def _usable_cpus() -> int:
    """The CPUs this process may run on: under ``taskset`` or a container's CPU set, os.cpu_count()
    counts the whole machine, and a worker per core there would only take turns on the few allowed."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):     # not on Linux
        return os.cpu_count() or 1


class _Pool:
    """A process pool started on demand: before the walk for a cold run over folders, else at the first
    file that needs parsing, and only where enough of them (or a warm pool) make it pay."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.executor = None

    def start(self) -> None:
        if self.executor is None and self.jobs > 1:
            self.executor = _start_pool(self.jobs)

    def map(self, fn, work: list) -> list:
        if self.executor is None and self.jobs > 1 and len(work) >= POOL_MIN_FILES:
            self.start()
        if self.executor is None or not work:
            return list(map(fn, work))
        return list(self.executor.map(fn, work, chunksize=1))

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def _start_pool(jobs: int):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("fork") if hasattr(os, "fork") else None
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_warm_up)
    pool.submit(int)     # with fork, the first task starts every worker
    return pool


def _warm_up() -> None:
    """Run the whole analysis once on a small bad loop in each worker, before any file arrives: the
    imports and libcst's lazily built machinery (~0.3 s) are then paid while the parent walks."""
    try:
        import textwrap
        check_source(textwrap.dedent(BY_CODE["SC101"].INVALID[0]), "<warm-up>")
    except Exception:
        pass


def _lint(paths, codes, gates, pool, is_excluded, cache, ignored_codes) -> LintResult:
    files = discover(paths, is_excluded)
    result = LintResult(files=len(files))
    if cache is not None:
        from synccheck.analyzer.cache import content_key
    # Stage 2 in this process: reading, the cache and a one-word-per-rule gate on the raw bytes.
    todo = []
    for path in files:
        if cache is not None:
            hit = cache.fresh(path)
            if hit is not None:
                result.findings.extend(hit[0])
                result.errors.extend(hit[1])
                result.cached += 1
                continue
        data, error = read_bytes(path)
        key = content_key(data) if (cache is not None and data is not None) else None
        if key is not None:
            hit = cache.get(path, key)
            if hit is not None:
                result.findings.extend(hit[0])
                result.errors.extend(hit[1])
                result.cached += 1
                cache.put(path, key, *hit)
                continue
        if data is not None and not path.endswith(".ipynb") and not any(g in data for g in gates) \
                and b"\0" not in data[:8192]:
            # no rule can fire: not even decoded (most files of a code base end here)
            if key is not None:
                cache.put(path, key, [], [])
            continue
        if data is None:
            result.errors.append(error)
            continue
        if path.endswith(".ipynb"):
            from synccheck.analyzer.notebook import read_notebook
            notebook, error = read_notebook(path)
            if error is not None:
                result.errors.append(error)
                if key is not None:
                    cache.put(path, key, [], [error])
                continue
            todo.append((path, notebook.text, key, notebook))
        else:
            # decoding and the rules' word checks run in the workers, beside the parse
            todo.append((path, data, key, None))
            if len(todo) == POOL_MIN_FILES:
                pool.start()     # enough to pay for workers: they warm up while the walk goes on
    # biggest files first, so one large file does not start last and finish alone
    order = sorted(range(len(todo)), key=lambda i: -len(todo[i][1]))
    work = [(todo[i][0], todo[i][1], codes) for i in order]
    found = dict(zip(order, pool.map(_analyse, work)))
    for i, (path, _, key, notebook) in enumerate(todo):
        findings, errors, parsed = found[i]
        if notebook is not None:
            findings = notebook.map_findings(findings)
        result.findings.extend(findings)
        result.errors.extend(errors)
        result.parsed += parsed
        if cache is not None and key:
            cache.put(path, key, findings, errors)
    if cache is not None:
        cache.save()
    result.findings = [f for f in result.findings if not ignored(f.code, ignored_codes(f.path))]
    result.findings.sort(key=lambda f: (f.path, f.cell or 0, f.line, f.column, f.code))
    return result


def _analyse(args) -> tuple:
    """(findings, file errors, parsed?) for one file: raw bytes of a .py, or a notebook's joined text.

    The cyclic garbage collector is off while one file is analysed. Building the ast and libcst
    trees allocates hundreds of thousands of objects that all stay alive until the file is done, so
    every collection the allocations trigger (one per 700) scans them and frees nothing: ~20% of
    the time on torch's big files. The analysis must not leave its trees in reference cycles (a
    recursive closure that reaches the model is one: delete it after use), so that reference
    counting frees them as soon as the file is done; freeing torch's distributed_test.py through
    the collector instead took a tenth of its analysis. tests/test_lint_memory.py checks both.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyse_one(args)
    finally:
        if enabled:
            gc.enable()


def _analyse_one(args) -> tuple:
    path, payload, codes = args
    rules = [BY_CODE[c] for c in codes]
    if isinstance(payload, bytes):
        text, error = decode_source(path, payload)
        if error is not None:
            return [], [error], False
        active = wanted_rules(text, rules)
        if not active or file_ignores(text) == ALL:
            return [], [], False
        # the word checks are done: hand check_source the rules that passed (and SC000, if selected)
        rules = [r for r in rules if r.code == "SC000"] + active
        return check_source(text, path, rules, filtered=False), [], True
    return check_source(payload, path, rules), [], True
