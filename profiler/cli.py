"""`synccheck profile [options] -- CMD` and `synccheck report DIR`.

Importing this module must not import torch: the launcher only runs the command and reads records.
"""
from __future__ import annotations

import argparse
import os
import sys

PROFILE_USAGE = "synccheck profile [options] -- CMD [ARGS...]"
PROFILE_EPILOG = """examples:
  synccheck profile -- torchrun --nproc_per_node=2 train.py
  synccheck profile --json report.json --trace trace.json -- python train.py   (mp.spawn)
  synccheck profile --out /shared/prof -- torchrun --nnodes=2 ... train.py     (then: synccheck report /shared/prof)

records: with --out DIR, kept in DIR. Without it, in a new $TMPDIR/synccheck-profile-* folder (TMPDIR
  defaults to /tmp), removed after the report when the command succeeded; when it failed, was
  interrupted (Ctrl-C) or hung, the folder is kept and named in the last line, and only the 5 latest
  kept folders stay (the newest: ls -td ${TMPDIR:-/tmp}/synccheck-profile-* | head -1).

exit code: the command's own (127 when it does not exist); --strict: 1 when it succeeded but findings exist.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        raise _UsageExit(f"{self.prog}: {message} (see `{self.prog} --help`)")


class _UsageExit(Exception):
    pass


def _profile_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="synccheck profile", usage=PROFILE_USAGE, epilog=PROFILE_EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Run a data-parallel PyTorch job unchanged and count, per rank and per optimizer "
                            "step, the micro-steps, the ones that synchronized gradients, and the bytes "
                            "all-reduced; then judge them with the linter's codes (SC101, SC102, SC103).")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the per-rank records, kept after the run; share it between nodes, then "
                        "`synccheck report DIR` (without --out: see 'records' below)")
    p.add_argument("--json", metavar="PATH", dest="json_path", help="write the report as JSON")
    p.add_argument("--trace", metavar="PATH", dest="trace_path",
                   help="write a Chrome trace (open it in https://ui.perfetto.dev)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the command succeeded but findings exist")
    p.add_argument("--hang-timeout", metavar="SECONDS", type=float,
                   help="when no rank makes progress for this long, dump every worker's stack with py-spy, "
                        "name the collectives the ranks are blocked in, and stop the job")
    p.add_argument("--hang-grace", metavar="SECONDS", type=float, default=5.0,
                   help="after a hang, seconds between SIGTERM and SIGKILL (default 5)")
    p.add_argument("--comm-hook", action="store_true",
                   help="count every DDP gradient bucket through a Python comm hook, which also times each "
                        "all-reduce (a Python call and an extra pass over each bucket; by default buckets are "
                        "counted from DDP's bucket layout after each synced backward, and DDP keeps its own "
                        "C++ all-reduce)")
    p.add_argument("--sample", metavar="PATH", dest="sample_path",
                   help="record every worker with py-spy into PATH and report the share of samples spent in "
                        "communication per rank")
    p.add_argument("--sample-format", choices=("speedscope", "raw"), default="speedscope",
                   help="format of the --sample file (default speedscope)")
    p.add_argument("--sample-rate", type=int, default=100, metavar="HZ", help="py-spy samples per second")
    return p


def _err(message: str) -> None:
    print(f"synccheck profile: {message}", file=sys.stderr)


def profile_main(argv: list[str]) -> int:
    argv = list(argv)
    options_part = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in options_part):
        _profile_parser().print_help()
        return 0
    if "--" not in argv:
        _err("put the command after `--`, e.g. `synccheck profile -- torchrun --nproc_per_node=2 train.py`")
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    try:
        ns = _profile_parser().parse_args(options)
    except _UsageExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if ns.hang_timeout is not None and ns.hang_timeout <= 0:
        _err("--hang-timeout must be a positive number of seconds")
        return 2
    if ns.sample_rate <= 0:
        _err("--sample-rate must be a positive number of samples per second")
        return 2
    from synccheck.profiler.launcher import ProfileOptions, UsageError, run

    opts = ProfileOptions(command=command, out_dir=ns.out, json_path=ns.json_path, trace_path=ns.trace_path,
                          strict=ns.strict, hang_timeout=ns.hang_timeout, hang_grace=ns.hang_grace,
                          sample_path=ns.sample_path, sample_format=ns.sample_format,
                          sample_rate=ns.sample_rate, comm_hook=ns.comm_hook)
    try:
        result = run(opts)
    except UsageError as exc:
        _err(str(exc))
        return exc.code
    try:
        code = _report_run(opts, result)
    except BaseException:
        # a second Ctrl-C or an internal error while reporting: the records are all there is, say where
        if result.temporary:
            _err(f"the records are in {result.out_dir} (`synccheck report {result.out_dir}` reads them)")
        raise
    _finish_records(result)
    return code


def _finish_records(result) -> None:
    """Without --out: a run that went well leaves nothing behind; a failed, interrupted or hung one keeps
    its records and says where (see launcher.finish_records)."""
    from synccheck.profiler.launcher import KEPT_RUNS, finish_records, records_worth_keeping

    if result.temporary and records_worth_keeping(result):
        why = ("the job hung" if result.hang else f"the command was interrupted ({result.interrupted})"
               if result.interrupted else f"the command exited with code {result.exit_code}")
        _err(f"{why}: records kept in {result.out_dir} (`synccheck report DIR` reads them again; without "
             f"--out only the {KEPT_RUNS} latest such runs are kept)")
    finish_records(result)


def _report_run(opts, result) -> int:
    from synccheck.profiler import records, render, verdict
    from synccheck.profiler.launcher import records_worth_keeping

    ranks, notes = records.load_ranks(result.out_dir, session=result.session)
    headline = []
    if result.interrupted:
        headline.append(f"the command was interrupted ({result.interrupted} forwarded); records up to each "
                        "rank's last optimizer step are kept")
    if not ranks:
        markers = records.load_process_markers(result.out_dir, session=result.session)
        workers = [m for m in markers if m.get("role") != "agent"]
        if workers:
            notes.append(f"the command never initialized torch.distributed: {len(workers)} Python process(es) "
                         "imported torch but none called init_process_group, so there is nothing to profile")
        elif markers:
            notes.append("only a launcher process (torchrun/accelerate) imported torch; no worker started")
        else:
            notes.append("no process of the command imported torch (not a Python command, or Python started "
                         "with -I/-E/-S, which skips the profiler's bootstrap): nothing to profile")
    notes.extend(result.notes)
    report = verdict.analyse(ranks, notes)
    console = _console()
    if result.hang is not None:
        from synccheck.profiler.hang import print_hang
        print_hang(result.hang, console)
    if result.sample is not None:
        from synccheck.profiler.sample import print_sample
        print_sample(result.sample, console)
    # a temporary folder is named only where it outlives the report (the line after it)
    render.print_report(report, console, exit_code=result.exit_code,
                        out_dir=None if result.temporary else result.out_dir, headline_notes=headline,
                        hang=result.hang)
    extra = {"hang": result.hang, "sample": result.sample, "interrupted": result.interrupted,
             "session": result.session}
    # The job has run: a report that cannot be written now is said in one line, and the command's own
    # exit code still comes back (the records stay in out_dir for `synccheck report`).
    if opts.json_path:
        try:
            kept = records_worth_keeping(result)
            render.write_json(opts.json_path, render.to_json(report, exit_code=result.exit_code,
                                                             command=opts.command,
                                                             out_dir=result.out_dir if kept else None,
                                                             extra=extra))
        except OSError as exc:
            _err(f"cannot write --json {opts.json_path}: {exc.strerror or exc}")
    if opts.trace_path:
        from synccheck.profiler.trace import write_trace
        try:
            write_trace(opts.trace_path, ranks)
        except OSError as exc:
            _err(f"cannot write --trace {opts.trace_path}: {exc.strerror or exc}")
    if opts.strict and result.exit_code == 0 and report.findings:
        return 1
    return result.exit_code


def _console():
    from rich.console import Console
    # The report goes to stderr: the command's own stdout stays clean for pipes.
    return Console(stderr=True, highlight=False)


def _report_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="synccheck report", usage="synccheck report [options] DIR",
                description="Merge the per-rank records in DIR (written by one or more `synccheck profile "
                            "--out DIR` runs, e.g. one per node, or the folder a failed, interrupted or hung "
                            "`synccheck profile` run kept) and print the report.")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--json", metavar="PATH", dest="json_path", help="write the report as JSON")
    p.add_argument("--trace", metavar="PATH", dest="trace_path", help="write a Chrome trace")
    p.add_argument("--strict", action="store_true", help="exit 1 when findings exist")
    return p


def report_main(argv: list[str]) -> int:
    try:
        ns = _report_parser().parse_args(list(argv))
    except _UsageExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:
        return int(exc.code or 0)
    from synccheck.profiler import records, render, verdict
    from synccheck.profiler.launcher import UsageError, check_output_path

    if not os.path.isdir(ns.dir):
        print(f"synccheck report: no such folder: {ns.dir}", file=sys.stderr)
        return 2
    try:
        check_output_path(ns.json_path, "--json")
        check_output_path(ns.trace_path, "--trace")
    except UsageError as exc:
        print(f"synccheck report: {exc}", file=sys.stderr)
        return exc.code
    ranks, notes = records.load_ranks(ns.dir)
    if not ranks:
        why = f": {notes[0]}" if notes else " (written by `synccheck profile --out DIR`)"
        print(f"synccheck report: no rank records in {ns.dir} that this synccheck can read{why}"
              if notes else f"synccheck report: no rank records in {ns.dir}{why}", file=sys.stderr)
        return 2
    launchers = records.load_launcher_results(ns.dir)
    codes = [l.get("exit_code") for l in launchers if isinstance(l.get("exit_code"), int)]
    exit_code = next((c for c in codes if c != 0), codes[0] if codes else None)
    if len(launchers) > 1:
        notes.append("merged the records of " + ", ".join(
            f"{l.get('host', '?')} (exit {l.get('exit_code')})" for l in launchers))
    report = verdict.analyse(ranks, notes)
    render.print_report(report, _console(), exit_code=exit_code, out_dir=os.path.abspath(ns.dir))
    if ns.json_path:
        render.write_json(ns.json_path, render.to_json(report, exit_code=exit_code, out_dir=os.path.abspath(ns.dir),
                                                       extra={"launchers": launchers}))
    if ns.trace_path:
        from synccheck.profiler.trace import write_trace
        write_trace(ns.trace_path, ranks)
    return 1 if ns.strict and report.findings else 0
