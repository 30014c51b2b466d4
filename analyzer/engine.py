"""The pipeline, one stage a module: find files -> filter -> parse -> model -> rules -> report.

``check_source`` runs stages 2-5 on one text; ``lint`` runs the whole pipeline over paths, in a process
pool when enough files need parsing to pay for one.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

from synccheck.analyzer.files import discover
from synccheck.analyzer.ftypes import Finding, LintResult
from synccheck.analyzer.rules import ALL_RULES, BY_CODE
from synccheck.analyzer.source import read_source
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

    @staticmethod
    def model_name(key: Optional[str]) -> str:
        if not key:
            return "the model"
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
                 filtered: bool = True) -> list:
    """Findings for one source text (no file system, no cache)."""
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
    narrowed, tree, error = narrow(text, anchors, loop_anchors)
    module = None
    if narrowed is not None:
        module, error = parse(narrowed)
    if module is None:
        if any(r.code == "SC000" for r in rules):
            line, column, message = error
            rule = BY_CODE["SC000"]
            return suppressed(text, [Finding(rule.code, rule.name, rule.severity, path, line, column, line,
                                              column, f"cannot parse: {message}",
                                              "fix the syntax error; nothing else in this file was checked")])
        return []
    from synccheck.analyzer.model import ModuleModel
    ctx = RuleContext(ModuleModel(module, path), path)
    for rule in active:
        rule().check(ctx)
    return suppressed(text, _positioned(module, path, ctx.raw), tree)


def _positioned(module, path: str, raw: list) -> list:
    """Positions only for reported nodes: PositionProvider costs ~10x the parse, so only flagged files pay."""
    if not raw:
        return []
    from libcst.metadata import MetadataWrapper, PositionProvider

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    out: dict = {}
    for rule, node, message, fix in raw:
        pos = positions.get(node)
        if pos is None:
            continue
        finding = Finding(rule.code, rule.name, rule.severity, path, pos.start.line, pos.start.column + 1,
                          pos.end.line, pos.end.column + 1, message, fix)
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
    files = discover(paths, is_excluded)
    result = LintResult(files=len(files))
    cache = None
    if cache_dir is not None:
        from synccheck.analyzer.cache import Cache, content_key
        cache = Cache(cache_dir, codes)
    # Stage 2 in this process: reading and the word filter are cheap; only survivors go to workers.
    todo = []
    for path in files:
        if cache is not None:
            hit = cache.fresh(path)
            if hit is not None:
                result.findings.extend(hit[0])
                result.errors.extend(hit[1])
                result.cached += 1
                continue
        notebook = None
        if path.endswith(".ipynb"):
            from synccheck.analyzer.notebook import read_notebook
            notebook, error = read_notebook(path)
            text = notebook.text if notebook is not None else None
        else:
            text, error = read_source(path)
        key = None
        if cache is not None:
            try:
                with open(path, "rb") as fh:
                    key = content_key(fh.read())
            except OSError:
                key = None
            hit = cache.get(path, key) if key else None
            if hit is not None:
                result.findings.extend(hit[0])
                result.errors.extend(hit[1])
                result.cached += 1
                cache.put(path, key, *hit)
                continue
        if error is not None:
            result.errors.append(error)
            if cache is not None and key:
                cache.put(path, key, [], [error])
            continue
        if wanted_rules(text, rules) and file_ignores(text) != ALL:
            todo.append((path, text, key, notebook))
        elif cache is not None and key:
            cache.put(path, key, [], [])
    result.parsed = len(todo)
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if jobs > 1 and len(todo) >= POOL_MIN_FILES:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork") if hasattr(os, "fork") else None
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context) as pool:
            # biggest files first, so one large file does not start last and finish alone
            order = sorted(range(len(todo)), key=lambda i: -len(todo[i][1]))
            outputs = pool.map(_check_file, [(todo[i][1], todo[i][0], codes) for i in order], chunksize=1)
            found = dict(zip(order, outputs))
    else:
        found = {i: check_source(text, path, rules) for i, (path, text, _, _) in enumerate(todo)}
    for i, (path, _, key, notebook) in enumerate(todo):
        if notebook is not None:
            found[i] = notebook.map_findings(found[i])
        result.findings.extend(found[i])
        if cache is not None and key:
            cache.put(path, key, found[i], [])
    if cache is not None:
        cache.save()
    result.findings = [f for f in result.findings if not ignored(f.code, ignored_codes(f.path))]
    result.findings.sort(key=lambda f: (f.path, f.cell or 0, f.line, f.column, f.code))
    return result


def _check_file(args) -> list:
    text, path, codes = args
    return check_source(text, path, [BY_CODE[c] for c in codes])
