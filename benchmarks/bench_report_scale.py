"""`synccheck report` at cluster scale: write R ranks x S optimizer steps of records, time the report.

    python benchmarks/bench_report_scale.py --ranks 1024 --steps 1000
    python benchmarks/bench_report_scale.py --ranks 16 --steps 2000 --baseline main
    python benchmarks/bench_report_scale.py --ranks 64 --steps 500 --out /tmp/records   # only write them

The records are written by the profiler's own writer (recorder.Recorder, fed the events its hooks feed
it: the same bytes a real run writes), for a DDP job with gradient accumulation on 8 ranks per node:
4 micro-steps per optimizer step (2 in the last, partial window of each epoch), a 350 MB model in 15
gradient buckets that DDP rebuilds into 14 after the first synced backward, parameter checksums when the
profiler takes them, an evaluation every 200 steps (a metric all_reduce and a barrier), one straggler
rank whose all-reduces take three times as long, and one rank killed at 90% of the run mid-write (its
file ends in a partial line). `--mode every` syncs every micro-step (SC101) instead of once per step.

Then `synccheck report DIR --json FILE` runs as a subprocess; its wall time and peak memory (the sum of
the resident sizes of its process tree, sampled every 10 ms, and the largest single process as the kernel
counts it) are printed, with the CPU seconds of the report and its pool (on a shared machine the wall time
depends on the load, printed first). `--baseline REF` also writes the same run with the writer of git REF (e.g. `main`)
into a second folder and times that REF's `synccheck report` on it, in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

RANKS_PER_NODE = 8
MICRO, EPOCH_STEPS, EVAL_EVERY = 4, 250, 200
LAYOUT_FIRST = [25_000_000] * 13 + [20_000_000, 5_000_000]       # 15 buckets before the rebuild
LAYOUT = [25_000_000] * 14                                         # 14 after
STEP_US, BUCKET_US = 400_000, 9_000
SCRIPT = "/home/user/project/train.py"


def rank_events(rank: int, world: int, steps: int, mode: str, t0: int):
    """The events a profiled rank's hooks hand the recorder, one optimizer step at a time (lists)."""
    straggler = world * 3 // 4 + 1 if world > 2 else -1
    bucket_us = BUCKET_US * (3 if rank == straggler else 1)
    t = t0
    yield [["model", t, "ddp0", "ddp", 87_500_000, 350_000_000, SCRIPT, 88]]
    synced_backwards = 0
    start = t
    for n in range(1, steps + 1):
        evs = []
        micro = 2 if n % EPOCH_STEPS == 0 else MICRO
        step_start = t
        for i in range(micro):
            synced = mode == "every" or i == micro - 1
            t += STEP_US // (MICRO + 1)
            evs.append(["fwd", t, "ddp0", 1 if synced else 0, SCRIPT, 131])
            if synced:
                synced_backwards += 1
                layout = LAYOUT_FIRST if synced_backwards <= 2 else LAYOUT
                start = t + 20_000
                for size in layout:
                    evs.append(["bkt", start, bucket_us, "ddp0", size, 1])
                    start += bucket_us
        if n % EVAL_EVERY == 0:
            evs.append(["coll", t + 30_000, 800, "all_reduce", 8, "other", SCRIPT, 160])
            evs.append(["coll", t + 31_000, 2_000, "barrier", 0, "other", SCRIPT, 161])
        # the step ends after the last all-reduce (a straggler's make its steps longer)
        t = max(step_start + STEP_US, start + 1_000) + (rank % 7) * 100
        checksum = -123456789 if (n & (n - 1)) == 0 or n % 1024 == 0 else None
        evs.append(["step", t, n, 0, SCRIPT, 140, checksum])
        yield evs


def _meta(rank: int, world: int, host: str, t0: int, version: int) -> dict:
    return {"version": version, "session": "bench", "run_id": "bench", "rank": rank, "world_size": world,
            "local_rank": rank % RANKS_PER_NODE, "node_rank": rank // RANKS_PER_NODE, "host": host,
            "pid": 10_000 + rank, "ppid": 1, "argv": [SCRIPT, "--config", "big.yaml"], "backend": "nccl",
            "frameworks": [], "t0": t0}


def write_rank(args) -> int:
    """One rank's file with the recorder of the synccheck package on sys.path. Returns its size."""
    out_dir, rank, world, steps, mode = args
    from synccheck.profiler import recorder as R
    host = f"node{rank // RANKS_PER_NODE:03d}"
    t0 = 1_800_000_000_000_000
    rec = R.Recorder()
    rec.out_dir = out_dir
    path = os.path.join(out_dir, f"rank-{rank:05d}.{host}.{10_000 + rank}.jsonl")
    # The writer as a rank opens it (Recorder._open), without its background thread and with this
    # rank's host: one process writes every rank here.
    rec._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    rec.rank, rec.world_size, rec.active = rank, world, True
    rec._buf.append([R.META, _meta(rank, world, host, t0, R.FORMAT_VERSION)])
    killed_at = int(steps * 0.9) if rank == world - 1 and world > 1 else None
    for n, evs in enumerate(rank_events(rank, world, steps, mode, t0)):
        for ev in evs:
            rec.event(ev)
        rec.flush()                 # the optimizer-step hook flushes after its step event
        if killed_at is not None and n >= killed_at:
            break
    os.close(rec._fd)
    rec._fd, rec.active = None, False     # (a fork later must not close that number again)
    if killed_at is not None:
        # killed mid-write: the last line is cut in half
        os.truncate(path, os.path.getsize(path) - 20)
    return os.path.getsize(path)


def write_folder(out_dir: str, ranks: int, steps: int, mode: str, pythonpath: str | None = None) -> int:
    """Every rank's file, written in a pool (2 processes by default). Returns the bytes written."""
    os.makedirs(out_dir, exist_ok=True)
    code = ("import sys, json, multiprocessing as mp\n"
            f"sys.path.insert(0, {str(HERE.parent)!r})\n"
            "import bench_report_scale as b\n"
            "jobs = [(sys.argv[1], r, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]) for r in range(int(sys.argv[2]))]\n"
            "with mp.get_context('fork').Pool() as pool:\n"
            "    print(sum(pool.imap_unordered(b.write_rank, jobs, chunksize=4)))\n")
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", code, out_dir, str(ranks), str(steps), mode], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _tree_rss_kb(pid: int) -> int:
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return total


def time_report(folder: str, pythonpath: str | None = None) -> dict:
    """`synccheck report FOLDER --json ...` in a fresh process: wall seconds and peak memory."""
    json_path = os.path.join(tempfile.mkdtemp(prefix="bench-report-"), "report.json")
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # A wrapper process of its own, so that its children's peak RSS is the report's alone.
    code = ("import resource, subprocess, sys, time, json\n"
            f"sys.path.insert(0, {str(HERE.parent)!r})\n"
            "import bench_report_scale as b\n"
            "t = time.perf_counter()\n"
            "p = subprocess.Popen([sys.executable, '-m', 'synccheck', 'report', sys.argv[1], '--json', sys.argv[2]],"
            " stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
            "peak = 0\n"
            "while p.poll() is None:\n"
            "    peak = max(peak, b._tree_rss_kb(p.pid))\n"
            "    time.sleep(0.01)\n"
            "wall = time.perf_counter() - t\n"
            "err = p.stderr.read().decode()\n"
            "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(json.dumps({'seconds': wall, 'returncode': p.returncode, 'tree_peak_mb': peak / 1024,"
            " 'max_process_mb': ru.ru_maxrss / 1024, 'cpu_s': ru.ru_utime + ru.ru_stime, 'stderr': err}))\n")
    proc = subprocess.run([sys.executable, "-c", code, folder, json_path], env=env, capture_output=True, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["report"] = json.loads(Path(json_path).read_text()) if os.path.exists(json_path) else None
    shutil.rmtree(os.path.dirname(json_path), ignore_errors=True)
    return result


def checkout(ref: str) -> str:
    """The synccheck package of git REF, laid out as installed (cli/ -> synccheck/, profiler/ ->
    synccheck/profiler/, ...), in a temporary folder for PYTHONPATH."""
    root = tempfile.mkdtemp(prefix=f"synccheck-{ref}-")
    src = os.path.join(root, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "cli", "profiler", "analyzer", "runtime",
                              "examples"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    pkg = os.path.join(root, "synccheck")
    shutil.copytree(os.path.join(src, "cli"), pkg)
    for part in ("profiler", "analyzer", "runtime", "examples"):
        shutil.copytree(os.path.join(src, part), os.path.join(pkg, part))
    return root


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--mode", choices=("correct", "every"), default="correct")
    p.add_argument("--out", metavar="DIR", help="only write the records into DIR (then time the report yourself)")
    p.add_argument("--baseline", metavar="REF", help="also time the report of git REF on records its writer wrote")
    p.add_argument("--keep", action="store_true", help="keep the folders written")
    args = p.parse_args()
    if args.ranks < 1 or args.steps < 1:
        p.error("--ranks and --steps must be positive")
    if args.out:
        t = time.perf_counter()
        size = write_folder(args.out, args.ranks, args.steps, args.mode)
        print(f"wrote {args.ranks} ranks x {args.steps} steps into {args.out}: {size / 1e6:.1f} MB "
              f"({size / args.ranks / args.steps:.0f} bytes per step per rank) in {time.perf_counter() - t:.1f} s")
        return 0
    root = tempfile.mkdtemp(prefix="bench-report-scale-")
    runs = [("this tree", None)]
    if args.baseline:
        runs.append((f"git {args.baseline}", checkout(args.baseline)))
    print(f"Machine: {os.uname().machine}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"Python {sys.version.split()[0]}; {args.ranks} ranks x {args.steps} optimizer steps, mode {args.mode}")
    try:
        for name, pythonpath in runs:
            folder = os.path.join(root, "baseline" if pythonpath else "records")
            t = time.perf_counter()
            size = write_folder(folder, args.ranks, args.steps, args.mode, pythonpath)
            wrote = time.perf_counter() - t
            r = time_report(folder, pythonpath)
            report = r["report"] or {}
            print(f"{name}: records {size / 1e6:.1f} MB ({size / args.ranks / args.steps:.0f} bytes per step per "
                  f"rank, written in {wrote:.1f} s); report {r['seconds']:.2f} s ({r['cpu_s']:.2f} s CPU), peak RSS {r['tree_peak_mb']:.0f} MB "
                  f"(process tree), {r['max_process_mb']:.0f} MB (largest process); exit {r['returncode']}, "
                  f"{len(report.get('ranks', []))} ranks, findings {[f['code'] for f in report.get('findings', [])]}")
            if r["returncode"] not in (0, 1):
                print(r["stderr"][-2000:])
    finally:
        if args.keep:
            print(f"records kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        for _, pythonpath in runs:
            if pythonpath:
                shutil.rmtree(pythonpath, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
