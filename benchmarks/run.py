"""Every synccheck benchmark in one run, summarised as one markdown table.

    python benchmarks/run.py --quick                 # about a minute on 2 CPU cores
    python benchmarks/run.py --out benchmarks.md     # the full runs: several minutes
    python benchmarks/run.py --only lint,accumulate  # a subset

Runs, each in its own process so one cannot slow or break another:

- ``lint``: ``bench_lint.py``, synccheck on the installed torch package (cold and warm cache) against
  ruff in the same run (``pip install ruff`` first; without it the ruff row says so);
- ``overhead``: ``bench_profiler_overhead.py``, step time of a 2-rank gloo job under ``synccheck
  profile`` against plain, in interleaved pairs and as an A/B inside one job;
- ``accumulate``: ``bench_accumulate.py``, seconds per optimizer step of DDP gradient accumulation
  syncing every micro-step, hand-written ``no_sync``, ``GradientAccumulator`` and ``LocalSGD``.

The markdown (stdout, and ``--out FILE``) states the machine and the command, then the summary table,
then each benchmark's own output. Exit code 1 when a benchmark failed (its row says why).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (script, quick arguments, full arguments)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "lint": ("bench_lint.py", ["--repeat", "1"], ["--repeat", "3"]),
    "overhead": ("bench_profiler_overhead.py",
                 ["--pairs", "1", "--steps", "15", "--rounds", "40"], ["--comm-hook"]),
    "accumulate": ("bench_accumulate.py", ["--rounds", "3", "--steps", "3"], []),
}


def machine() -> str:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at start"
    return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{load}; Python "
            f"{platform.python_version()}, torch {version('torch')}, synccheck {version('synccheck')}, "
            f"ruff {version('ruff')}")


def run_benchmark(name: str, quick: bool, tmp: str) -> dict:
    script, quick_args, full_args = BENCHMARKS[name]
    json_path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, str(HERE / script), *(quick_args if quick else full_args), "--json", json_path]
    # the benchmarks find `ruff` next to the interpreter or on PATH; keep the venv's bin first
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    result = {"name": name, "command": " ".join(["python", f"benchmarks/{script}", *cmd[2:-2]]),
              "seconds": time.perf_counter() - start, "output": proc.stdout.strip(), "data": None, "error": None}
    if proc.returncode == 0 and os.path.exists(json_path):
        with open(json_path) as fh:
            result["data"] = json.load(fh)
    else:
        lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
        result["error"] = f"exit code {proc.returncode}: {lines[-1] if lines else 'no output'}"
    return result


def lint_rows(data: dict) -> list[tuple[str, str, str]]:
    corpus = f"{os.path.basename(data['path'].rstrip(os.sep))}, {data['files']:,} files, {data['lines']:,} lines"
    rows = []
    for row in data["rows"]:
        speed = data["files"] / row["wall_s"]
        rows.append((f"lint speed ({corpus})", row["tool"],
                     (f"{row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s CPU, {speed:,.0f} files/s, "
                      f"{row['peak_mb']:.0f} MB peak")))
    if not data.get("ruff"):
        rows.append((f"lint speed ({corpus})", "ruff (baseline)",
                     "not measured: ruff is not installed (`pip install ruff`)"))
    one = data["one_file"]
    rows.append(("lint start-up", "synccheck on one 400-line file that needs no parse",
                 f"{one['wall_s']:.3f} s wall"))
    return rows


def overhead_rows(data: dict) -> list[tuple[str, str, str]]:
    what = "profiler overhead (2-rank gloo job, target <= 1.02)"

    def ratio(r: dict, times: bool = True) -> str:
        ms = f"; {r['plain_s'] * 1e3:.1f} vs {r['profiled_s'] * 1e3:.1f} ms/step" if times else ""
        return f"{r['ratio']:.3f} (95% CI {r['ci'][0]:.3f}-{r['ci'][1]:.3f}{ms})"

    rows = [(what, f"step time profiled / plain, median of {len(data['pairs'])} interleaved job pair(s)",
             f"{data['median_ratio']:.3f} (95% CI {data['median_ci'][0]:.3f}-{data['median_ci'][1]:.3f})")]
    if data.get("in_job"):
        rows.append((what, f"same, A/B inside one job (median of {data['in_job']['rounds']} rounds of one step "
                           "a side)", ratio(data["in_job"])))
    if data.get("in_job_aa"):
        rows.append((what, "same harness, A/A: both models plain (its own bias and noise)",
                     ratio(data["in_job_aa"], times=False)))
    if data.get("in_job_comm_hook"):
        rows.append((what, "same, with `--comm-hook` (every bucket through a Python comm hook)",
                     ratio(data["in_job_comm_hook"])))
    return rows


def accumulate_rows(data: dict) -> list[tuple[str, str, str]]:
    seconds = data["seconds"]
    if "wall" in seconds:            # {"wall": {mode: [...]}, "cpu": {...}}: the rows are wall time
        seconds = seconds["wall"]
    args = data["args"]
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    rounds = len(next(iter(seconds.values())))
    what = (f"accumulation, 2 ranks gloo, {args['layers']} x Linear({args['width']}), N={args['micro_steps']}, "
            f"LocalSGD K={args['every']}, median of {rounds} rounds")
    rows = [(what, f"{mode}: seconds per optimizer step", f"{median[mode]:.4f}") for mode in seconds]
    rows += [
        (what, "speedup of GradientAccumulator over syncing every micro-step",
         f"{median['sync every micro-step'] / median['GradientAccumulator']:.2f}x"),
        (what, "GradientAccumulator / hand-written no_sync (time ratio, 1 = same)",
         f"{median['GradientAccumulator'] / median['hand-written no_sync']:.3f}"),
        (what, "speedup of LocalSGD over GradientAccumulator",
         f"{median['GradientAccumulator'] / median['LocalSGD']:.2f}x"),
    ]
    if "bookkeeping_s_per_micro_step" in data:
        rows.append((what, "GradientAccumulator bookkeeping per micro-step",
                     f"{data['bookkeeping_s_per_micro_step'] * 1e6:.1f} us"))
    return rows


SUMMARIES = {"lint": lint_rows, "overhead": overhead_rows, "accumulate": accumulate_rows}


def markdown(results: list[dict], command: str, started: str, machine_line: str) -> str:
    lines = [
        "# synccheck benchmarks",
        "",
        f"Machine: {machine_line}.  ",
        f"Run: {started}, `{command}`.",
        "",
        "| benchmark | measure | result |",
        "|---|---|---|",
    ]
    for result in results:
        if result["error"]:
            lines.append(f"| {result['name']} | `{result['command']}` | FAILED: {result['error']} |")
            continue
        try:
            rows = SUMMARIES[result["name"]](result["data"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration) as exc:
            rows = [(result["name"], "summary", f"unreadable results ({type(exc).__name__}: {exc})")]
        previous = None
        for benchmark, measure, value in rows:
            lines.append(f"| {benchmark if benchmark != previous else ''} | {measure} | {value} |")
            previous = benchmark
    lines += ["", "## Each benchmark's own output", ""]
    for result in results:
        lines += [f"### {result['name']} ({result['seconds']:.0f} s)", "", f"`{result['command']}`", "",
                  "```", result["output"] or "(no output)", "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="benchmarks: " + ", ".join(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and rounds: about a minute")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", metavar="FILE", help="also write the markdown here")
    args = parser.parse_args(argv)
    names = list(BENCHMARKS)
    if args.only:
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in names if name not in BENCHMARKS]
        if unknown or not names:
            parser.error(f"unknown benchmark(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(BENCHMARKS)}")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: no such folder")
    command = shlex.join(["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])])
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine_line = machine()
    if shutil.which("ruff", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is None:
        print("run.py: ruff is not installed: the lint benchmark will have no baseline (pip install ruff)",
              file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="synccheck-benchmarks-") as tmp:
        for name in names:
            print(f"run.py: {name} ...", file=sys.stderr, flush=True)
            results.append(run_benchmark(name, args.quick, tmp))
            status = "FAILED: " + results[-1]["error"] if results[-1]["error"] else "done"
            print(f"run.py: {name} {status} in {results[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    text = markdown(results, command, started, machine_line)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 1 if any(result["error"] for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
