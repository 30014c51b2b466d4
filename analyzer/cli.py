"""``synccheck lint`` and ``synccheck rule``. Imports nothing heavy until it knows it needs to."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from synccheck.analyzer.files import UsageError
from synccheck.analyzer.source import replace_file


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line and exit 2, like ruff
        raise UsageError(message)


def _codes(value: str) -> list:
    return [c.strip().upper() for c in value.split(",") if c.strip()]


def _check_codes(codes, option: str) -> None:
    from synccheck.analyzer.config import known_code

    for code in codes or ():
        if not known_code(code):
            raise UsageError(f"{option}: unknown rule code or prefix {code!r} (see `synccheck rule --all`)")


def lint_main(argv: List[str]) -> int:
    parser = _Parser(prog="synccheck lint",
                     description="Check training scripts for gradient-synchronization misuse. "
                                 "The code is parsed, never imported or run.",
                     epilog="exit code: 0 no findings, 1 findings or unreadable files (0 with --exit-zero), "
                            "2 usage or configuration error. `synccheck rule CODE` explains a finding.")
    parser.add_argument("paths", nargs="*", default=["."], help="files or folders (default: .)")
    parser.add_argument("--format", "--output-format", dest="format", default="full",
                        choices=("full", "concise", "json", "sarif", "github"),
                        help="full (default: each finding with its source lines and fix), concise (one line "
                             "each), json, sarif (GitHub code scanning), github (workflow annotations)")
    parser.add_argument("--select", type=_codes, default=None, metavar="CODES",
                        help="only these rule codes or prefixes, comma-separated (SC1, SC101)")
    parser.add_argument("--ignore", type=_codes, default=None, metavar="CODES",
                        help="skip these rule codes or prefixes")
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="the pyproject.toml to read [tool.synccheck] from "
                             "(default: the nearest one above the current folder)")
    parser.add_argument("--isolated", action="store_true", help="ignore every configuration file")
    parser.add_argument("--statistics", action="store_true", help="print a count per rule code")
    parser.add_argument("--exit-zero", action="store_true", help="exit 0 even when there are findings")
    parser.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                        help="worker processes (default: the CPUs this process may use)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the results cache")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="where the cache lives (default: $SYNCCHECK_CACHE_DIR or .synccheck_cache)")
    parser.add_argument("--output-file", "-o", default=None, metavar="PATH",
                        help="write the report (any --format) to PATH instead of stdout; PATH is replaced only "
                             "once the report is complete")
    parser.add_argument("--quiet", "-q", action="count", default=0,
                        help="print the findings only: no summary, no \"All checks passed!\", no warnings "
                             "(-qq: as --silent)")
    parser.add_argument("--fix", action="store_true", default=None,
                        help="apply the safe fixes (checked before they are written), then report what is left")
    parser.add_argument("--no-fix", dest="fix", action="store_false", help="do not fix (overrides `fix = true`)")
    parser.add_argument("--unsafe-fixes", action="store_true", default=None,
                        help="also apply (or with --diff, show) the fixes that change what the training computes")
    parser.add_argument("--no-unsafe-fixes", dest="unsafe_fixes", action="store_false",
                        help="only safe fixes (overrides `unsafe-fixes = true`)")
    parser.add_argument("--diff", action="store_true",
                        help="print the fixes as a unified diff and write nothing (exit 1 when there is one)")
    parser.add_argument("--fix-only", action="store_true",
                        help="apply the fixes and report only how many (exit 0 unless a file could not be read)")
    parser.add_argument("--silent", "-s", action="store_true",
                        help="print nothing; the exit code still says whether there were findings "
                             "(--output-file still gets the findings)")
    try:
        args = parser.parse_args(argv)
        _check_codes(args.select, "--select")
        _check_codes(args.ignore, "--ignore")
        if args.output_file is not None:
            _check_output_file(args.output_file)
        from synccheck.analyzer.config import Config, load_config, resolve_rules
        from synccheck.analyzer.engine import lint
        from synccheck.analyzer.report import render

        config = Config() if args.isolated else load_config(args.config)
        cache_dir = None if args.no_cache else (args.cache_dir or os.environ.get("SYNCCHECK_CACHE_DIR")
                                                  or ".synccheck_cache")
        rules = resolve_rules(config, args.select, args.ignore)
        # only JSON shows a fix's edits; every other report needs to know only that there is one
        result = lint(args.paths, rules, jobs=args.jobs, cache_dir=cache_dir, is_excluded=config.is_excluded,
                      ignored_codes=config.ignored_codes, edits=args.format == "json")
    except UsageError as exc:
        print(f"synccheck lint: error: {exc}", file=sys.stderr)
        return 2
    silent = args.silent or args.quiet >= 2
    quiet = silent or args.quiet > 0
    fixing = _fix(args, config, rules, result, silent)
    if fixing is not None:
        return fixing
    if result.fixed:
        # a fix in one file can settle a finding in another (the epoch loop's set_epoch reseeds the
        # sampler a builder file makes): what is left is read again from the files as written
        again = lint(args.paths, rules, jobs=args.jobs, cache_dir=cache_dir, is_excluded=config.is_excluded,
                     ignored_codes=config.ignored_codes, edits=args.format == "json")
        known = {(e.path, e.message) for e in again.errors}
        again.errors += [e for e in result.errors if (e.path, e.message) not in known]
        # (a fix tried and refused keeps saying why)
        refused = {(f.path, f.code, f.message): f for f in result.findings
                   if isinstance(f.autofix, dict) and f.autofix.get("reason", "").startswith("fix not applied")}
        again.findings = [refused.get((f.path, f.code, f.message), f) for f in again.findings]
        again.fixed, again.fix_options = result.fixed, result.fix_options
        result = again
    if result.files == 0 and not result.errors and not quiet:
        # as ruff: not an error (an empty folder in a pre-commit run), but not silent either
        print("synccheck lint: warning: no Python files found under " + ", ".join(args.paths), file=sys.stderr)
    if args.output_file is not None:
        import io

        report = io.StringIO()
        # --statistics beside json/sarif writes its counts to stderr, which --silent keeps quiet
        render(result, args.format, report, statistics=args.statistics, quiet=quiet,
               err=io.StringIO() if silent else sys.stderr)
        try:
            replace_file(args.output_file, report.getvalue().encode("utf-8"))
        except OSError as exc:
            print(f"synccheck lint: error: cannot write --output-file {args.output_file}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
    elif not silent:
        render(result, args.format, sys.stdout, statistics=args.statistics, quiet=quiet)
    if args.exit_zero:
        return 0
    return 1 if (result.findings or result.errors) else 0


def _fix(args, config, rules, result, silent: bool) -> Optional[int]:
    """--fix (then report as usual), --diff and --fix-only (which report only the fixes: an exit code)."""
    from synccheck.analyzer.fix.apply import FixOptions, fix_result, unified_diff

    unsafe = args.unsafe_fixes if args.unsafe_fixes is not None else bool(config.unsafe_fixes)
    result.fix_options = FixOptions(unsafe, config.fixable, config.unfixable)
    fix = args.fix if args.fix is not None else bool(config.fix)
    if not (fix or args.diff or args.fix_only):
        return None
    outcomes = fix_result(result, rules, result.fix_options, write=not args.diff)
    if not (args.diff or args.fix_only):
        return None
    n = result.fixed
    for e in result.errors:
        if not silent:
            print(f"{e.path}: error: {e.message}", file=sys.stderr)
    if args.diff:
        if not silent:
            for o in outcomes:
                if o.fixed and not o.error:
                    sys.stdout.write(unified_diff(o))
            print(f"Would fix {n} problem{'s' if n != 1 else ''}." if n else "No problems would be fixed.",
                  file=sys.stderr)
        return 1 if (n or result.errors) else 0
    if not silent and not args.quiet:
        print(f"Fixed {n} problem{'s' if n != 1 else ''}." if n else "No problems fixed.")
    return 1 if result.errors and not args.exit_zero else 0


def _check_output_file(path: str) -> None:
    """Said before any file is read, not after the work: the folder exists, PATH is not one, and a
    file can really be created there (the profiler's check: mode bits alone do not tell)."""
    from synccheck.profiler.launcher import UsageError as OutputError, check_output_path

    try:
        check_output_path(path, "--output-file")
    except OutputError as exc:
        raise UsageError(str(exc)) from None


def rule_main(argv: List[str]) -> int:
    parser = _Parser(prog="synccheck rule", description="Print a rule's documentation.")
    parser.add_argument("code", nargs="?", help="a rule code (SC101) or name (sync-every-microstep)")
    parser.add_argument("--all", action="store_true", help="list every rule")
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"synccheck rule: error: {exc}", file=sys.stderr)
        return 2
    from synccheck.analyzer.rules import ALL_RULES, BY_CODE, BY_NAME

    if args.all or not args.code:
        if not args.all:
            print("synccheck rule: error: give a rule code (e.g. SC101) or --all", file=sys.stderr)
            return 2
        for r in ALL_RULES:
            print(f"{r.code}  {r.name:<28} {r.severity:<8} {r.summary}")
        return 0
    rule: Optional[type] = BY_CODE.get(args.code.upper()) or BY_NAME.get(args.code.lower())
    if rule is None:
        print(f"synccheck rule: error: unknown rule {args.code!r} (see `synccheck rule --all`)", file=sys.stderr)
        return 2
    print(rule.documentation())
    return 0
