"""How much `synccheck lint --fix` fixes, and what it costs.

    python benchmarks/bench_fix.py [--repeat N] [--target DIR]

1. Coverage: every script of examples/ and tests/fixtures/ is copied alone into a temporary folder,
   linted, fixed with `--fix --unsafe-fixes` and linted again. Prints the findings, how many offered a
   fix, how many were fixed, and how many files lint clean afterwards.
2. Cost: `synccheck lint --no-cache` against `synccheck lint --no-cache --diff --unsafe-fixes` (which
   builds, checks and prints every fix but writes nothing) on DIR (default: the installed torch
   package), median of N runs each, interleaved.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def synccheck(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", *args], capture_output=True,
                          text=True, cwd=cwd)


def coverage() -> dict:
    scripts = sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests" / "fixtures").rglob("*.py"))
    totals = {"files": 0, "findings": 0, "offered": 0, "fixed": 0, "clean_after": 0, "files_with_findings": 0}
    for script in scripts:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / script.name
            shutil.copy(script, target)
            for helper in ("common.py", "fixlib.py"):
                if (script.parent / helper).exists() and helper != script.name:
                    shutil.copy(script.parent / helper, Path(tmp) / helper)
            found = json.loads(synccheck("--format", "json", script.name, cwd=tmp).stdout)["findings"]
            totals["files"] += 1
            if not found:
                continue
            totals["files_with_findings"] += 1
            totals["findings"] += len(found)
            totals["offered"] += sum(1 for f in found if f["fix"]["edits"] or "hidden" in f["fix"]["message"])
            synccheck("--fix", "--unsafe-fixes", script.name, cwd=tmp)
            after = json.loads(synccheck("--format", "json", script.name, cwd=tmp).stdout)["findings"]
            totals["fixed"] += max(0, len(found) - len(after))
            totals["clean_after"] += not after
    return totals


def offered_fixes() -> int:
    """Findings whose fix has edits (safe or unsafe), over the same scripts, linted in place."""
    data = json.loads(synccheck("--format", "json", "examples", "tests/fixtures", cwd=ROOT).stdout)
    return sum(1 for f in data["findings"] if f["fix"]["edits"])


def cost(target: str, repeat: int) -> dict:
    lint, fix = [], []
    for _ in range(repeat):
        for args, into in ((("-q", target), lint), (("--diff", "--unsafe-fixes", "-q", target), fix)):
            start = time.perf_counter()
            synccheck(*args)
            into.append(time.perf_counter() - start)
    return {"lint_s": statistics.median(lint), "diff_s": statistics.median(fix)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--target", default=None)
    args = parser.parse_args()
    target = args.target
    if target is None:
        import importlib.util
        target = str(Path(importlib.util.find_spec("torch").origin).parent)
    cov = coverage()
    cov["offered_in_place"] = offered_fixes()
    print(json.dumps(cov))
    print(json.dumps(cost(target, args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
