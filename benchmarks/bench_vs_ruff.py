"""Cold lint of code bases by synccheck and by ruff, one after the other in the same run.

    python benchmarks/bench_vs_ruff.py DIR [DIR ...]

Prints, per folder, wall time and the CPU time of the linter's processes (children included), and
the CPU ratio. Not a test: the numbers depend on the machine and its load; compare rows of one run.
"""
import argparse
import resource
import shutil
import subprocess
import sys
import time


def timed(cmd: list) -> tuple:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args(argv)
    if shutil.which("ruff") is None or shutil.which("synccheck") is None:
        print("bench_vs_ruff: needs `ruff` and `synccheck` on PATH", file=sys.stderr)
        return 2
    for folder in args.folders:
        ours = timed(["synccheck", "lint", "--isolated", "--no-cache", "-q", folder])
        ruff = timed(["ruff", "check", "--isolated", "--no-cache", "-q", folder])
        name = folder.rstrip("/").split("/")[-1]
        print(f"{name:45s} synccheck {ours[0]:6.1f} s wall {ours[1]:6.1f} s CPU | "
              f"ruff {ruff[0]:5.2f} s wall {ruff[1]:5.2f} s CPU | {ours[1] / max(ruff[1], 1e-3):5.1f}x CPU",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
