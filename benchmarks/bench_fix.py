"""How much `synccheck lint --fix` fixes, and what it costs.

    python benchmarks/bench_fix.py [--repeat N] [--target DIR]
    python benchmarks/bench_fix.py --corpus MIRROR [--work DIR] [--only REPO] [--json PATH]

1. Coverage: every script of examples/ and tests/fixtures/ is copied alone into a temporary folder,
   linted, fixed with `--fix --unsafe-fixes` and linted again. Prints the findings, how many offered a
   fix, how many were fixed, and how many files lint clean afterwards.
2. Cost: `synccheck lint --no-cache` against `synccheck lint --no-cache --diff --unsafe-fixes` (which
   builds, checks and prints every fix but writes nothing) on DIR (default: the installed torch
   package), median of N runs each, interleaved.
3. Real code (``--corpus MIRROR``, instead of 1 and 2): every labelled file of
   benchmarks/realworld/manifest.json (read from the mirrors, as bench_realworld.py does) that has
   findings when linted alone (its file mode) is fixed with ``--fix --unsafe-fixes`` in a copy of its
   repository, then linted again from scratch. Prints the findings, how many offered a fix (safe,
   unsafe) and why the others did not, the fixes applied, the files that lint clean of the fixed codes
   afterwards, the files where a fix added a finding or left code that does not parse, and every "fix
   not applied" with its reason.
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


def _no_fix_reason(fix: dict) -> str:
    message = fix.get("message") or ""
    return message.split("(no automatic fix: ", 1)[1][:-1] if "(no automatic fix: " in message else "none offered"


def corpus(mirror: Path, work: Path, only, out_json) -> dict:
    """Fix the labelled real-world files that have findings; see the module's docstring (3)."""
    import ast
    import os
    from collections import Counter

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_realworld import MANIFEST, extract, lint as lint_json, load_manifest

    from synccheck.analyzer.engine import lint, select_rules
    from synccheck.analyzer.fix.apply import FixOptions, fix_result

    rules = select_rules()
    totals = Counter()
    no_fix, not_applied, rows = Counter(), [], []
    for e in load_manifest(MANIFEST):
        if only and only not in e["repo"]:
            continue
        try:
            root = extract(mirror, e["repo"], e["commit"], work)
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            print(f"skipped {e['repo']}:{e['path']} ({exc})")
            continue
        if not (root / e["path"]).exists():
            continue
        totals["labelled files"] += 1
        before = lint_json(root / e["path"], (root / e["path"]).parent)[0].get(os.path.realpath(root / e["path"]), [])
        if not before:
            continue
        totals["files with findings"] += 1
        totals["findings"] += len(before)
        for f in before:
            kind = f["fix"]["applicability"]
            totals[f"findings with a {kind} fix" if kind != "display-only" else "findings with no fix"] += 1
            if kind == "display-only":
                no_fix[f"{f['code']}: {_no_fix_reason(f['fix'])}"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / root.name
            # hard links: the extracted tree is shared, and --fix replaces a file (a new inode), never
            # writes into it; the labelled file is copied for real all the same
            subprocess.run(["cp", "-al", str(root), str(copy)], check=True)
            target = copy / e["path"]
            data = target.read_bytes()
            target.unlink()
            target.write_bytes(data)
            result = lint([str(target)], rules, jobs=1, cache_dir=None)
            outcomes = fix_result(result, rules, FixOptions(unsafe=True))
            fixed = [f for o in outcomes if o.error is None for f in o.fixed]
            for o in outcomes:
                if o.error:
                    not_applied.append(f"{e['repo']}:{e['path']}: {o.error}")
            for f in result.findings:
                reason = (f.autofix or {}).get("reason", "")
                if reason.startswith("fix not applied"):
                    not_applied.append(f"{e['repo']}:{e['path']}:{f.line} {f.code} {reason}")
                    totals["findings whose fix was not applied"] += 1
            totals["fixes applied"] += len(fixed)
            expected = {x["code"] for x in e["expected"]}
            totals["fixes applied to a labelled (true) finding"] += sum(1 for f in fixed if f.code in expected)
            row = {"repo": e["repo"], "path": e["path"], "before": [f["code"] for f in before],
                   "fixed": [f.code for f in fixed], "expected": sorted(expected)}
            if fixed:
                totals["files fixed"] += 1
                text = target.read_bytes()
                try:
                    ast.parse(text)
                except SyntaxError as exc:
                    totals["fixed files that do not parse"] += 1
                    row["parse_error"] = str(exc)
                after = lint_json(target, target.parent)[0].get(os.path.realpath(target), [])
                row["after"] = [f["code"] for f in after]
                codes = {f.code for f in fixed}
                if not any(f["code"] in codes for f in after):
                    totals["fixed files that lint clean of the fixed codes"] += 1
                if not after:
                    totals["fixed files that lint clean"] += 1
                was, now = Counter(row["before"]), Counter(row["after"])
                if any(now[c] > was[c] for c in now):
                    totals["fixed files where a fix added a finding"] += 1
                    row["added"] = sorted(c for c in now if now[c] > was[c])
                import difflib
                old_lines = data.decode("utf-8", "replace").splitlines()
                new_lines = text.decode("utf-8", "replace").splitlines()
                row["diff_lines"] = sum(1 for line in difflib.unified_diff(old_lines, new_lines, lineterm="", n=0)
                                        if line[:1] in "+-" and line[:3] not in ("+++", "---"))
            rows.append(row)
            print(f"{e['repo']}:{e['path']}: {row['before']} -> fixed {row['fixed']}"
                  + (f", after {row['after']}" if "after" in row else "")
                  + (f" ADDED {row['added']}" if "added" in row else "")
                  + (" DOES NOT PARSE" if "parse_error" in row else ""), flush=True)
    report = {"totals": dict(totals), "no_fix": dict(no_fix.most_common()), "not_applied": not_applied}
    print(json.dumps(report, indent=2))
    if out_json:
        Path(out_json).write_text(json.dumps(dict(report, rows=rows), indent=2))
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--target", default=None)
    parser.add_argument("--corpus", type=Path, default=None, metavar="MIRROR",
                        help="fix the labelled real-world files instead (folder of bare git mirrors)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "synccheck-realworld",
                        help="where --corpus extracts repositories (shared with bench_realworld.py)")
    parser.add_argument("--only", default=None, help="--corpus: only repositories whose name contains this")
    parser.add_argument("--json", default=None, help="--corpus: write per-file results here")
    args = parser.parse_args()
    if args.corpus is not None:
        corpus(args.corpus, args.work, args.only, args.json)
        return 0
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
