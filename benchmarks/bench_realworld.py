"""Recall and precision of `synccheck lint` on real public training scripts.

`benchmarks/realworld/manifest.json` lists scripts from public repositories: repo, path, the commit
the labels were read at, and the codes a correct analyzer must report on that file (with why, from
reading the code), or none (a correct script). The scripts are not in this repository: this script
reads them from mirrored repositories (bare git dirs, e.g. made by a `git clone --mirror`) and
extracts each repository's Python files at the labelled commit.

    python benchmarks/bench_realworld.py --mirror DIR [--mode repo|file] [--json PATH] [--only REPO]
    python benchmarks/bench_realworld.py --mirror DIR --list-repos   # the order to mirror them in

DIR holds one bare git dir per repository: `DIR/owner+name/repo` (or `DIR/owner+name` itself, or
`DIR/owner/name.git`). `--mode repo` (default) lints the whole repository and keeps the findings in
the labelled file, as `synccheck lint .` in a checkout would; `--mode file` lints the file alone, as
a pre-commit hook that passes only that file would (the files beside it that import it are read as
context). It prints per-file misses and false alarms, then recall and precision over (file, code)
pairs.

Where only some repositories can be mirrored (a session's fetch budget is 500), `--list-repos` prints
them in the order to mirror them: those with expected findings first. An entry whose repository is
not mirrored is skipped and said; once a commit is extracted under `--work`, its mirror is no longer
read and may be deleted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "realworld" / "manifest.json"


def git_dir(mirror: Path, repo: str) -> Path:
    owner, name = repo.split("/", 1)
    for candidate in (mirror / f"{owner}+{name}" / "repo", mirror / f"{owner}+{name}", mirror / owner / f"{name}.git",
                      mirror / owner / name):
        if (candidate / "HEAD").exists():
            return candidate
        if (candidate / ".git" / "HEAD").exists():     # a mirror that came as an ordinary clone
            return candidate / ".git"
    raise FileNotFoundError(f"no mirror of {repo} under {mirror}")


def extract(mirror: Path, repo: str, commit: str, work: Path) -> Path:
    """The repository's Python files at ``commit``, extracted once into ``work``."""
    dest = work / f"{repo.replace('/', '+')}@{commit[:12]}"
    done = dest / ".extracted"
    if done.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    gd = git_dir(mirror, repo)
    # write the wanted blobs one by one from `git ls-tree`, so a mirror whose
    # large binary blobs are absent (a partial snapshot: `git archive` fails on it) still extracts
    names = subprocess.run(["git", f"--git-dir={gd}", "ls-tree", "-r", "-z", commit],
                           capture_output=True, check=True).stdout.decode("utf-8", "replace").split("\0")
    keep = []
    for rec in names:
        if not rec or "\t" not in rec:
            continue
        meta, path = rec.split("\t", 1)
        mode, kind, sha = meta.split()
        base = path.rsplit("/", 1)[-1]
        if kind == "blob" and mode != "120000" and (base.endswith(".py") or base in ("pyproject.toml", "setup.py", "setup.cfg")):
            keep.append((path, sha))
    proc = subprocess.Popen(["git", f"--git-dir={gd}", "cat-file", "--batch"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    def feed():
        proc.stdin.write("".join(sha + "\n" for _, sha in keep).encode())
        proc.stdin.close()
    feeder = threading.Thread(target=feed)
    feeder.start()
    for path, sha in keep:
        header = proc.stdout.readline().decode()
        if header.endswith("missing\n"):
            continue
        size = int(header.split()[2])
        data = proc.stdout.read(size)
        proc.stdout.read(1)
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    feeder.join()
    proc.wait()
    done.write_text(commit)
    return dest


def lint(target: Path, cwd: Path) -> tuple:
    """(findings by path, seconds) from `synccheck lint --format json` run as a user would."""
    start = time.perf_counter()
    # (-P: the script's folder is not put first on sys.path, so a `json.py` or `typing.py` of the repository
    # linted cannot shadow the standard library synccheck imports)
    proc = subprocess.run([sys.executable, "-P", "-m", "synccheck", "lint", "--isolated", "--no-cache", "--exit-zero",
                           "--format", "json", str(target)], capture_output=True, text=True, cwd=str(cwd))
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"synccheck failed on {target}: {proc.stderr.strip()[-400:]}")
    data = json.loads(proc.stdout)
    for error in data.get("errors", ()):
        # a file the linter could not check (an internal error costs its component's findings): said,
        # so that a drop in recall is not mistaken for the analysis missing the bug
        print(f"  [error] {error['path']}: {error['message']}", flush=True)
    out: dict = {}
    for f in data["findings"]:
        out.setdefault(os.path.realpath(os.path.join(cwd, f["path"])), []).append(f)
    return out, seconds


def load_manifest(path: Path) -> list:
    entries = json.loads(path.read_text())
    merged: dict = {}
    for e in entries:
        key = (e["repo"], e["path"], e["commit"])
        if key in merged:
            merged[key]["expected"].extend(e["expected"])
        else:
            merged[key] = dict(e, expected=list(e["expected"]))
    return list(merged.values())


def repos_by_priority(entries: list) -> list:
    """Repositories with expected findings first (most first), then the others (most entries first)."""
    found: dict = {}
    count: dict = {}
    for e in entries:
        found[e["repo"]] = found.get(e["repo"], 0) + len(e["expected"])
        count[e["repo"]] = count.get(e["repo"], 0) + 1
    return sorted(found, key=lambda r: (not found[r], -found[r], -count[r], r))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", required=True, type=Path, help="folder of bare git mirrors (owner+name/repo)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--mode", choices=("repo", "file"), default="repo")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "synccheck-realworld",
                        help="where repositories are extracted (reused between runs)")
    parser.add_argument("--only", default=None, help="only entries whose repo contains this text")
    parser.add_argument("--json", type=Path, default=None, help="write per-entry results here")
    parser.add_argument("--list-repos", action="store_true",
                        help="print the manifest's repositories, those with the most expected findings first "
                             "(the order to mirror them in when only some can be), and exit")
    args = parser.parse_args(argv)
    if args.list_repos:
        try:
            sys.stdout.write("".join(repo + "\n" for repo in repos_by_priority(load_manifest(args.manifest))))
            sys.stdout.flush()
        except BrokenPipeError:     # (``| head``)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    entries = [e for e in load_manifest(args.manifest) if not args.only or args.only in e["repo"]]
    repo_cache: dict = {}
    rows = []
    tp = fn = fp = 0
    missing = []
    crashed = []
    per_repo: dict = {}
    seconds = 0.0
    for e in entries:
        try:
            root = extract(args.mirror, e["repo"], e["commit"], args.work)
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            missing.append(f"{e['repo']}:{e['path']} ({exc})")
            continue
        target = root / e["path"]
        if not target.exists():
            missing.append(f"{e['repo']}:{e['path']} (not in the tree at {e['commit'][:12]})")
            continue
        try:
            if args.mode == "repo":
                key = str(root)
                if key not in repo_cache:
                    repo_cache[key] = lint(root, root)
                    seconds += repo_cache[key][1]
                    per_repo[key] = repo_cache[key][1]
                    print(f"  [time] lint {root.name}: {repo_cache[key][1]:.1f} s", flush=True)
                by_path = repo_cache[key][0]
                took = repo_cache[key][1]
            else:
                by_path, took = lint(target, target.parent)
                seconds += took
                per_repo[str(root)] = per_repo.get(str(root), 0.0) + took
                print(f"  [time] lint {e['path']}: {took:.1f} s", flush=True)
        except RuntimeError as exc:  # a crash of synccheck on one repo is recorded, not fatal
            crashed.append(f"{e['repo']}:{e['path']} ({str(exc)[-300:]})")
            print(f"CRASH {e['repo']}:{e['path']}: {str(exc)[-300:]}", flush=True)
            continue
        got = by_path.get(os.path.realpath(target), [])
        want = {x["code"] for x in e["expected"]}
        have = {f["code"] for f in got}
        hits, misses, alarms = want & have, want - have, have - want
        tp, fn, fp = tp + len(hits), fn + len(misses), fp + len(alarms)
        rows.append({"repo": e["repo"], "path": e["path"], "commit": e["commit"], "expected": sorted(want),
                     "found": sorted(have), "missed": sorted(misses), "false_alarms": sorted(alarms),
                     "findings": [{"code": f["code"], "line": f["line"], "message": f["message"]} for f in got],
                     "lint_seconds": took})
        status = "ok  " if not misses and not alarms else "MISS" if misses and not alarms else \
            "FA  " if alarms and not misses else "BOTH"
        detail = ""
        if misses:
            detail += " missed " + ",".join(sorted(misses))
        if alarms:
            detail += " false " + ",".join(f"{f['code']}@{f['line']}" for f in got if f["code"] in alarms)
        print(f"{status} {e['repo']}:{e['path']} expected {sorted(want) or '-'}{detail}")
    recall = tp / (tp + fn) if tp + fn else 1.0
    precision = tp / (tp + fp) if tp + fp else 1.0
    repos = len({r["repo"] for r in rows})
    print(f"\n{len(rows)} files from {repos} repositories ({args.mode} mode), {tp + fn} expected findings, "
          f"{sum(1 for r in rows if not r['expected'])} clean files")
    print(f"recall {recall:.2f} ({tp}/{tp + fn}), precision {precision:.2f} ({tp}/{tp + fp}), "
          f"lint time {seconds:.1f} s")
    for m in missing:
        print(f"skipped: {m}")
    for m in crashed:
        print(f"crashed: {m}")
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "recall": recall, "precision": precision, "tp": tp,
                                         "fn": fn, "fp": fp, "rows": rows,
                                         "per_repo_seconds": per_repo, "crashed": crashed, "skipped": missing}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
