"""The pipeline, one stage a module:

find files (files.py) -> read and filter by words (source.py, gate.py) -> parse (parse.py) -> index the project
(project/index.py, definitions.py, resolution.py) -> abstract values (project/values.py, value_*.py) -> the
sync dataflow of every training loop (project/syncflow.py, flow_state.py, loops.py, branches.py; events.py,
event_calls.py, inlining.py, event_methods.py, micro_step.py, sync_control.py) -> facts (project/facts.py,
micro_step_facts.py, gradient_cache.py, static.py, unwrapped.py, rank_branches.py, collective_calls.py,
literal_arguments.py, samplers.py, sampler_loops.py) -> rules (rules/) -> report.

``check_source`` runs it on one text; ``lint`` on files and folders, as one project: a loop in
``engine.py`` sees the DDP model ``main.py`` built, and findings are reported in the file where the
bug is. The code is parsed with the standard library's ``ast`` and never imported or run.
"""
from __future__ import annotations

import ast
import gc
import os
from typing import Iterable, Optional, Sequence

from synccheck.analyzer.files import discover
from synccheck.analyzer.ftypes import FileError, Finding, LintResult
# which files are wanted (gate.py) and the process pool (pool.py): their names stay importable from here
from synccheck.analyzer.gate import (DRIVER_CALL, DRIVER_WORDS, LOOP_WORDS, PROJECT_WORDS, _driver_call,  # noqa: F401
                                     _Entry, _no_key, _read, eager)
from synccheck.analyzer.pool import POOL_MIN_COMPONENTS, _Pool, _usable_cpus  # noqa: F401
from synccheck.analyzer.rules import ALL_RULES, BY_CODE
from synccheck.analyzer.source import decode_source, read_bytes
from synccheck.analyzer.suppress import ALL, SUPPRESS, SUPPRESS_FILE, file_ignores, ignored, suppressed

__all__ = ["check_source", "lint", "select_rules", "wanted_rules", "SUPPRESS", "SUPPRESS_FILE"]

class RuleContext:
    """What a rule sees: the whole-program model, and how to report."""

    def __init__(self, program) -> None:
        self.program = program
        self.raw: list = []

    @property
    def flows(self) -> list:
        return self.program.flows()

    def report(self, rule, module, node, message: str, fix: str = "", autofix=None) -> None:
        """``autofix``: a callable returning the fix (analyzer/fix/), called only for a finding that is
        reported, after its module is known to be linted."""
        if module is not None and module.linted and node is not None:
            self.raw.append((rule, module, node, message, fix, autofix))

    def node(self, flow, site):
        """(module, node) recorded for a site."""
        return flow.records.nodes.get(site, (None, None))

    def model_name(self, model) -> str:
        """The name a wrapper was bound to where it was made (``model``, ``self.model``)."""
        from synccheck.analyzer.project.static import _binding
        if not hasattr(model, "site"):
            return "the model"
        name = _binding(self.program, model)
        return "the model" if name == "the wrapper" else name

    def control_text(self, flow, site) -> str:
        """How a sync control was written (``model.no_sync()``), from the site that turned sync off."""
        if site is None:
            return "no_sync"
        module, node = self.node(flow, site)
        if node is None:
            return "no_sync"
        if isinstance(node, (ast.With, ast.AsyncWith)):
            node = node.items[0].context_expr
        text = self.text(module, node)
        return text.splitlines()[0] if text else "no_sync"

    @staticmethod
    def text(module, node) -> str:
        return (module.segment(node) or ast.unparse(node)).strip()


def select_rules(select: Optional[Sequence[str]] = None, ignore: Optional[Sequence[str]] = None) -> list:
    """Rules chosen by code prefixes, ruff style: ``SC1`` selects SC101..SC106."""
    chosen = [r for r in ALL_RULES if not select or any(r.code.startswith(p) for p in select)]
    return [r for r in chosen if not ignore or not any(r.code.startswith(p) for p in ignore)]


def wanted_rules(text: str, rules: Sequence) -> list:
    """The rules whose words the text holds (for a single text; a project runs every selected rule)."""
    return [r for r in rules if r.code != "SC000" and r.wants(text)]


# ---------------------------------------------------------------------------------------------------

def analyse(project, rules: Sequence, keep: Optional[list] = None, skip=frozenset(), edits: bool = True) -> dict:
    """Findings per path for every linted module of a project. ``keep``: filled with the modules the
    analysis parsed on demand (not in ``skip``), before the project is torn down. ``edits=False``: a
    finding's fix says whether there is one, without its edits (see fix/plan.build)."""
    from synccheck.analyzer.project.program import Program

    program = Program(project)
    ctx = RuleContext(program)
    try:
        for rule in rules:
            if rule.code != "SC000":
                rule().check(ctx)
        raw = ctx.raw
        ctx.raw = []
        if keep is not None:
            keep.extend(m for m in project.modules() if os.path.abspath(m.path) not in skip)
        return _positioned(raw, edits)
    finally:
        program.close()


def _positioned(raw: list, edits: bool = True) -> dict:
    if not edits and any(r[5] is not None for r in raw):
        from synccheck.analyzer import fix as fix_settings
        fix_settings.EDITS = False
        try:
            return _positioned(raw)
        finally:
            fix_settings.EDITS = True
    out: dict = {}
    seen = set()
    for rule, module, node, message, fix, autofix in raw:
        (line, column), (end_line, end_column) = position(module, node)
        key = (module.path, rule.code, line, column)
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(module.path, []).append(Finding(rule.code, rule.name, rule.severity, module.path, line, column,
                                                       end_line, end_column, message, fix,
                                                       autofix=autofix() if autofix is not None else None))
    for findings in out.values():
        findings.sort(key=lambda f: (f.line, f.column, f.code))
    return out


def position(module, node) -> tuple:
    """1-based (line, column), (end line, end column) in characters (ast counts UTF-8 bytes)."""
    lines = getattr(module, "_lines", None)
    if lines is None:
        lines = module._lines = module.text.splitlines()
    line, col = node.lineno, node.col_offset
    end_line, end_col = getattr(node, "end_lineno", None) or line, getattr(node, "end_col_offset", None) or col
    return (line, _chars(lines, line, col) + 1), (end_line, _chars(lines, end_line, end_col) + 1)


def _chars(lines: list, line: int, offset: int) -> int:
    if not 0 < line <= len(lines):
        return offset
    text = lines[line - 1]
    if text.isascii():
        return offset
    return len(text.encode("utf-8")[:offset].decode("utf-8", errors="ignore"))


def _parse_error(path: str, error) -> Finding:
    rule = BY_CODE["SC000"]
    line, column, message = error
    return Finding(rule.code, rule.name, rule.severity, path, line, column, line, column,
                   f"cannot parse: {message}", "fix the syntax error; nothing else in this file was checked")


def check_source(text: str, path: str = "<string>", rules: Optional[Sequence] = None,
                 filtered: bool = True) -> list:
    """Findings for one source text on its own (no other file is read)."""
    from synccheck.analyzer.parse import parse
    from synccheck.analyzer.project.index import Project

    rules = list(ALL_RULES) if rules is None else list(rules)
    off = file_ignores(text)
    if off == ALL:
        return []
    active = wanted_rules(text, rules) if filtered else [r for r in rules if r.code != "SC000"]
    active = [r for r in active if not ignored(r.code, off)]
    if not active:
        return []
    tree, error = parse(text, path)
    if tree is None:
        if any(r.code == "SC000" for r in rules):
            return suppressed(text, [_parse_error(path, error)])
        return []
    project = Project(filesystem=False)
    project.add(path, text, tree)
    findings = analyse(project, active).get(path, [])
    return suppressed(text, findings, tree)


def lint(paths: Iterable[str], rules: Optional[Sequence] = None, jobs: Optional[int] = None,
         is_excluded=lambda path: False, cache_dir: Optional[str] = None,
         ignored_codes=lambda path: (), edits: bool = True) -> LintResult:
    """The whole pipeline over files and folders. ``cache_dir=None``: no cache.

    Files are analysed in components (the files that import one another, see imports.py), each one
    project; components run in a process pool when there are enough of them to pay for one.
    ``is_excluded(path)`` and ``ignored_codes(path)`` (code prefixes not reported for that file) come
    from the configuration; the cache holds results before ``ignored_codes``. ``edits=False``: the
    findings' fixes say whether one exists (and its applicability) but carry no edits -- all a report
    other than JSON shows; building the edits (a libcst rewrite per fix) is most of the fix cost.
    """
    rules = list(ALL_RULES) if rules is None else list(rules)
    paths = list(paths)
    jobs = jobs if jobs is not None else _usable_cpus()
    codes = tuple(r.code for r in rules)
    cache = None
    if cache_dir is not None:
        from synccheck.analyzer.cache import Cache
        cache = Cache(cache_dir, codes, edits)
    pool = _Pool(jobs)
    try:
        result = _lint(paths, codes, pool, is_excluded, cache, edits)
    finally:
        pool.close()
    if cache is not None:
        cache.save()
    result.findings = [f for f in result.findings if not ignored(f.code, ignored_codes(f.path))]
    result.findings.sort(key=lambda f: (f.path, f.cell or 0, f.line, f.column, f.code))
    return result


def _lint(paths, codes, pool, is_excluded, cache, edits: bool = True) -> LintResult:
    rules = [BY_CODE[c] for c in codes]
    from synccheck.analyzer.cache import component_key, content_key as hashed_key
    # the content keys only ever key the cache: without one, no hashing
    content_key = hashed_key if cache is not None else _no_key
    from synccheck.analyzer.imports import (Components, entry_methods, imported_names, importers_beside,
                                           method_callers_beside, read_imports, driver_script)

    files = discover(paths, is_excluded)
    result = LintResult(files=len(files))
    explicit = {os.path.abspath(p) for p in paths if os.path.isfile(p)}
    entries: dict = {}
    fresh_files = 0
    known = {}
    for path in files:
        found = cache.fresh(path) if cache is not None and not path.endswith(".ipynb") else None
        if found is not None:
            known[path] = found
    # a file named on the command line is analysed even without our words: its loop may run
    # a backward through a helper in another file (a pre-commit hook passes such files)
    reads = pool.read_all(_read_files, [(path, os.path.abspath(path) in explicit) for path in files
                                        if path not in known], (content_key, imported_names, rules))
    for path in files:
        apath = os.path.abspath(path)
        if path in known:
            key, gated, imports, is_eager = known[path]
            entries[apath] = _Entry(path, key, gated or apath in explicit, imports,
                                    eager=is_eager or apath in explicit)
            fresh_files += 1
            continue
        entry, error = next(reads)
        if error is not None:
            result.errors.append(error)
            continue
        entries[apath] = entry
        if cache is not None and not path.endswith(".ipynb"):
            cache.note(path, entry.key, entry.gated, entry.imports, entry.eager)
    candidates = {p: e for p, e in entries.items() if e.gated}
    # only files named (a pre-commit hook): the project modules they use are not in the lint set, and
    # the files beside them that import them are context
    single_files = all(os.path.isfile(p) for p in paths)
    links = []          # (file, a file calling its training methods on an object made out of view)
    if candidates and single_files:
        linted = set(candidates)
        for apath in list(candidates):
            others = importers_beside(apath, linted)
            data, _ = read_bytes(apath)
            methods = entry_methods(data) if data else ()
            if methods:
                callers = method_callers_beside(apath, methods, linted)
                links += [(apath, os.path.abspath(c)) for c in callers]
                others += callers
            for other in dict.fromkeys(others):
                if os.path.abspath(other) in candidates:
                    continue
                entry, error = _read(other, content_key, imported_names, rules)
                driver = entry is not None and not entry.gated and driver_script(other)
                if driver:
                    # a training script that drives the file without any word of ours (``model, opt =
                    # setup(...)``; ``conduct_train(model, opt, ...)``): context all the same
                    entry, error = _read(other, content_key, imported_names, rules, force=True)
                if entry is not None and (entry.gated or driver):
                    entry.linted = False
                    candidates[os.path.abspath(other)] = entry
    components = Components(paths)
    groups = components.build({p: e.imports for p, e in candidates.items()}, read_imports)
    groups = components.join(groups, {p: e.imports for p, e in entries.items() if not e.gated and e.imports})
    if links:
        groups = _linked(groups, [(a, b) for a, b in links if b in candidates])
    work = []
    for group in groups:
        members = []
        if not any(candidates[p].eager for p in group if p in candidates):
            continue                # nothing here can hold a finding
        for p in group:
            entry = candidates.get(p)
            if entry is None and p in entries:
                # a linted file without any word of ours that a candidate imports (engine.py called
                # by main.py): it is part of the project and its findings are reported
                entry, error = _read(entries[p].path, content_key, imported_names, rules, force=True)
                if entry is None:
                    continue
            if entry is not None:
                members.append(entry)
        key = component_key([(e.path, e.key, e.linted) for e in members])
        hit = cache.component(key) if cache is not None else None
        if hit is not None:
            result.findings.extend(hit[0])
            result.errors.extend(hit[1])
            continue
        work.append((key, members))
    result.cached = fresh_files if not work else fresh_files - sum(
        1 for _, members in work for e in members if e.text is None)
    if len(work) >= POOL_MIN_COMPONENTS:
        pool.start()
    sizes = [sum(len(e.text or "") + 1 for e in members) for _, members in work]
    order = sorted(range(len(work)), key=lambda i: -sizes[i])
    # the files that may hold a finding travel with their text; the others are read if needed
    # the folders named on the command line are where absolute imports may start too (``from
    # common.trainer import train`` in vqa/function/train.py, run from the repository's top)
    lint_roots = tuple(r for r in components.roots if os.path.isdir(r))
    jobs_in = [([(e.path, e.text if e.eager else None, e.notebook, e.linted, e.eager, e.imports)
                 for e in work[i][1]], codes, edits, lint_roots, single_files) for i in order]
    results = pool.map(_analyse_component, jobs_in, [sizes[i] for i in order])
    for i, (findings, errors, parsed, deps) in zip(order, results):
        key, members = work[i]
        result.findings.extend(findings)
        result.errors.extend(errors)
        result.parsed += parsed
        if cache is not None and not any(e.message.startswith("not checked") for e in errors):
            cache.put(key, findings, errors, deps)      # (an internal error is not kept: the next run tries again)
    return result


def _linked(groups: list, links: list) -> list:
    """The groups, those that hold the two ends of a link merged."""
    where = {p: i for i, group in enumerate(groups) for p in group}
    parent = list(range(len(groups)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for a, b in links:
        if a in where and b in where:
            ra, rb = find(where[a]), find(where[b])
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    merged: dict = {}
    for i, group in enumerate(groups):
        merged.setdefault(find(i), []).extend(group)
    return list(merged.values())


def _read_files(args) -> list:
    """_read of each (path, named on the command line) of a list: [(entry, error)]."""
    files, (content_key, imported_names, rules) = args
    return [_read(path, content_key, imported_names, rules, force=force) for path, force in files]


def _analyse_component(args) -> tuple:
    """(findings, file errors, files parsed, modules read beyond the component) for one component.
    The cyclic garbage collector is off meanwhile: the trees stay alive until the component is done,
    so collections their allocations trigger would scan them and free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyse_files(*args)
    except Exception as exc:
        # a bug of ours in one component costs that component's findings, not the whole run's: the
        # other components are still reported, and this one is named as not checked
        if os.environ.get("SYNCCHECK_DEBUG"):
            raise
        members = args[0]
        path = next((m[0] for m in members if m[3] and m[4]), members[0][0] if members else "")
        others = f" and the {len(members) - 1} files analysed with it" if len(members) > 1 else ""
        return [], [FileError(path, f"not checked{others}: internal error {type(exc).__name__}: {exc} "
                                    f"(set SYNCCHECK_DEBUG=1 for a traceback)")], 0, []
    finally:
        if enabled:
            gc.enable()


def _analyse_files(members: list, codes: tuple, edits: bool = True, lint_roots: tuple = (),
                   single_files: bool = False) -> tuple:
    from synccheck.analyzer.parse import parse
    from synccheck.analyzer.project import launch_configs
    from synccheck.analyzer.project.index import Project

    launch_configs.reset()
    rules = [BY_CODE[c] for c in codes]
    findings: list = []
    errors: list = []
    parsed_files = []
    project = Project(roots=[os.path.dirname(os.path.abspath(p)) for p, *_ in members] + list(lint_roots))
    project.single_files = single_files
    parsed = 0
    for path, text, notebook, linted, is_eager, imports in members:
        if not is_eager:
            project.offer(path, text, imports, linted=linted)
            continue
        if text is None:
            data, error = read_bytes(path)
            if data is None:
                errors.append(error)
                continue
            text, error = decode_source(path, data)
            if error is not None:
                errors.append(error)
                continue
        off = file_ignores(text)
        if linted and off == ALL:
            continue
        tree, error = parse(text, path)
        parsed += 1
        if tree is None:
            if linted and "SC000" in codes and not ignored("SC000", off):
                findings.extend(_mapped([_parse_error(path, error)], notebook))
            continue
        module = project.add(path, text, tree, linted=linted)
        module.context = not linted
        if linted:
            parsed_files.append((path, text, notebook, tree, off))
    by_path: dict = {}
    eager_paths = {os.path.abspath(p) for p, *_ in parsed_files}
    lazily_parsed: list = []
    if parsed_files:
        try:
            by_path = analyse(project, rules, keep=lazily_parsed, skip=eager_paths, edits=edits)
        except RecursionError:
            errors.append(FileError(parsed_files[0][0], "too deeply nested to analyse"))
    parsed += sum(1 for m in lazily_parsed if m.linted)
    # files of the lint set the analysis parsed on demand are reported like the others
    known = {os.path.abspath(p) for p, *_ in parsed_files}  # noqa: the eager ones
    for module in lazily_parsed:
        if module.linted and os.path.abspath(module.path) not in known:
            parsed_files.append((module.path, module.text, None, module.tree, file_ignores(module.text)))
    for path, text, notebook, tree, off in parsed_files:
        mine = [f for f in by_path.get(path, []) if not ignored(f.code, off)]
        findings.extend(_mapped(suppressed(text, mine, tree), notebook))
    deps = [m.path for m in lazily_parsed if not m.linted]
    # (and the accelerate launch configurations read: a folder's listing, a YAML file)
    deps += launch_configs.consulted()
    return findings, errors, parsed, deps


def _mapped(findings: list, notebook) -> list:
    return notebook.map_findings(findings) if notebook is not None else findings


