"""Lint speed on the installed torch package's own .py files, against ruff in the same run.

    python benchmarks/bench_lint.py [--path DIR] [--repeat 3]

Prints a markdown table: files, lines, seconds (median wall, and CPU), files/s, peak memory (each command's
own, its worker processes included: `wait4`). synccheck is
timed cold (no cache), warm (cache filled by the cold run) and on one file that needs no parse; ruff
(`ruff check --isolated --no-cache`) is the baseline. Not a test: numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def torch_dir() -> str:
    spec = importlib.util.find_spec("torch")     # located, not imported
    if spec is None or not spec.origin:
        sys.exit("bench_lint: torch is not installed; pass --path DIR")
    return os.path.dirname(spec.origin)


def count(path: str) -> tuple:
    files = lines = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            if name.endswith(".py"):
                files += 1
                with open(os.path.join(dirpath, name), "rb") as fh:
                    lines += fh.read().count(b"\n")
    return files, lines


def compile_synccheck() -> int:
    """Write synccheck's .pyc files, as pip does when it installs a wheel. An editable install only
    gets them when an import may write them, which PYTHONDONTWRITEBYTECODE=1 forbids: then every run
    (and every worker) compiles the analyzer anew, ~0.1 s of CPU that no installed copy pays."""
    import compileall

    count = 0
    for name in ("synccheck", "synccheck.analyzer", "synccheck.analyzer.rules"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(folder, maxlevels=0, quiet=2)
            count += sum(1 for f in os.listdir(folder) if f.endswith(".py"))
    return count


def timed(cmd: list, repeat: int, env=None, setup=None) -> tuple:
    """(median wall seconds, median CPU seconds, peak RSS MB) over ``repeat`` runs.

    CPU and peak memory are the command's own (``wait4`` on its process), not the maximum over every
    child this benchmark has started so far.
    """
    walls, cpus, peak = [], [], 0.0
    for _ in range(repeat):
        if setup:
            setup()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stderr.close()
        walls.append(time.perf_counter() - start)
        cpus.append(usage.ru_utime + usage.ru_stime)
        peak = max(peak, usage.ru_maxrss / 1024)
        if proc.returncode not in (0, 1):
            sys.exit(f"bench_lint: {' '.join(cmd)} failed: {stderr.decode()[-500:]}")
    return statistics.median(walls), statistics.median(cpus), peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="folder to lint (default: the installed torch package)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the measurements as JSON (for benchmarks/run.py)")
    args = parser.parse_args()
    path = args.path or torch_dir()
    files, lines = count(path)
    # the command users type (its console script), so start-up is measured as they see it
    script = os.path.join(os.path.dirname(sys.executable), "synccheck")
    synccheck = ([script] if os.path.exists(script) else [sys.executable, "-m", "synccheck"]) + \
        ["lint", "--format", "json"]
    compiled = compile_synccheck()
    cache_dir = tempfile.mkdtemp(prefix="synccheck-bench-")
    env = {**os.environ, "SYNCCHECK_CACHE_DIR": cache_dir}
    rows = []

    def clear_cache():
        shutil.rmtree(cache_dir, ignore_errors=True)

    wall, cpu, peak = timed(synccheck + ["--no-cache", path], args.repeat, env)
    rows.append(("synccheck (cold, no cache)", wall, cpu, peak))
    help_text = subprocess.run(synccheck[:4] + ["--help"], capture_output=True, text=True).stdout
    if "--no-cache" in help_text:
        timed(synccheck + [path], 1, env, setup=clear_cache)   # fill the cache
        wall, cpu, peak = timed(synccheck + [path], args.repeat, env)
        rows.append(("synccheck (warm cache)", wall, cpu, peak))
    with tempfile.TemporaryDirectory() as tmp:
        one = os.path.join(tmp, "utils.py")
        with open(one, "w") as fh:
            fh.write("def add(a, b):\n    return a + b\n" * 200)
        wall1, cpu1, peak1 = timed(synccheck + ["--no-cache", one] if "--no-cache" in help_text
                                   else synccheck + [one], args.repeat)
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.exists(ruff):
        wall, cpu, peak = timed([ruff, "check", "--isolated", "--no-cache", "--exit-zero", "-q", path], args.repeat)
        rows.append(("ruff (baseline)", wall, cpu, peak))
    shutil.rmtree(cache_dir, ignore_errors=True)

    from synccheck.analyzer.engine import _usable_cpus   # the worker count synccheck itself uses
    cores = _usable_cpus()
    print(f"Machine: {platform.machine()}, {cores} cores, Python {platform.python_version()}; "
          f"median of {args.repeat} runs")
    print(f"Corpus: {path} ({files} .py files, {lines:,} lines)")
    print(f"synccheck's bytecode compiled first, as `pip install` does ({compiled} modules): an editable "
          f"install under PYTHONDONTWRITEBYTECODE=1 would otherwise compile them in every run\n")
    print("| tool | files | lines | wall s | CPU s | files/s | peak MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, wall, cpu, peak in rows:
        print(f"| {name} | {files} | {lines:,} | {wall:.2f} | {cpu:.2f} | {files / wall:,.0f} | {peak:.0f} |")
    print(f"| synccheck, one file needing no parse | 1 | 400 | {wall1:.3f} | {cpu1:.3f} | - | {peak1:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"path": path, "files": files, "lines": lines, "repeat": args.repeat,
                       "ruff": bool(os.path.exists(ruff)),
                       "rows": [{"tool": name, "wall_s": wall, "cpu_s": cpu, "peak_mb": peak}
                                for name, wall, cpu, peak in rows],
                       "one_file": {"wall_s": wall1, "cpu_s": cpu1, "peak_mb": peak1}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
