"""The terminal report (rich) and the JSON report of a profiled run."""
from __future__ import annotations

import json
import os

from synccheck.profiler.verdict import Report

JSON_VERSION = 1


def display_path(path: str | None, base: str | None = None) -> str | None:
    if not path:
        return path
    base = base or os.getcwd()
    try:
        rel = os.path.relpath(path, base)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def to_json(report: Report, *, exit_code, command=None, out_dir=None, extra: dict | None = None) -> dict:
    findings = []
    for f in report.findings:
        d = f.to_json()
        d["path"] = display_path(d["path"])
        findings.append(d)
    data = {
        "version": JSON_VERSION,
        "exit_code": exit_code,
        "command": command,
        "out_dir": out_dir,
        "world_size": report.world_size,
        "ranks": [s.to_json() for s in report.summaries],
        "findings": findings,
        "divergence": report.divergence,
        "param_averaging": report.averaging_seen,
        "notes": list(report.notes),
    }
    if extra:
        data.update(extra)
    return data


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def print_report(report: Report, console, *, exit_code=None, out_dir=None, headline_notes=(), hang=None) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    for note in headline_notes:
        console.print(Text(f"synccheck: {note}", style="yellow"))
    if report.summaries:
        several_hosts = len({s.host for s in report.summaries}) > 1
        table = Table(title="synccheck profile: gradient synchronization per rank", title_justify="left",
                      box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
        table.add_column("rank", justify="right", no_wrap=True)
        if several_hosts:
            table.add_column("host")
        for name in ("steps", "micro", "synced", "synced/step", "all-reduces", "MB", "s"):
            table.add_column(name, justify="right", no_wrap=True)
        for s in report.summaries:
            steady = s.steady_windows()
            per_step = (sum(w.synced_micro_steps for w in steady) / len(steady)) if steady else None
            if per_step is None:
                per_step_text = Text("-")
            else:
                style = "green" if abs(per_step - 1) < 1e-9 else ("red" if per_step < 1 else "yellow")
                per_step_text = Text(f"{per_step:.3g}", style=style)
            row = [str(s.rank)] + ([s.host] if several_hosts else [])
            row += [str(s.optimizer_steps), str(s.micro_steps), str(s.synced_micro_steps), per_step_text,
                    str(s.grad_allreduces), _mb(s.grad_allreduce_bytes), f"{s.allreduce_time_s:.3f}"]
            table.add_row(*row)
        console.print(table)
        others = {s.rank: ", ".join(f"{name} {n}" for name, n in sorted(s.other_collectives.items()))
                  for s in report.summaries}
        if any(others.values()):
            if len(set(others.values())) == 1:
                console.print(f"other collectives, every rank: {next(iter(others.values()))}")
            else:
                for rank, text in others.items():
                    console.print(f"other collectives, rank {rank}: {text or '-'}")
        console.print(Text("steps: optimizer steps; synced: micro-steps whose backward all-reduced gradients; "
                           "all-reduces, MB, s: gradient all-reduce count, volume and time. Ideal: 1 synced micro-step per optimizer step (the first "
                           "step is left out: DDP rebuilds its buckets after it).", style="dim"))
    for f in report.findings:
        style = "bold red" if f.severity == "error" else "bold yellow"
        where = display_path(f.path)
        loc = f"{where}:{f.line}" if where else "(run)"
        ranks = f" [ranks {','.join(map(str, f.ranks))}]" if f.ranks else ""
        line = Text()
        line.append(f"{f.code} {f.severity}", style=style)
        line.append(f" {loc}{ranks}: ", style="bold")
        line.append(f.message)
        console.print(line)
    if report.divergence is not None and not report.findings:
        d = report.divergence
        if not d["diverged"]:
            console.print(Text(f"parameter checksums agree across ranks after optimizer step {d['step']}",
                               style="dim"))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="cyan"))
    if hang is not None:
        # The hang is the finding: the counts above only cover what ran before it.
        what = "in mismatched collectives" if hang.get("mismatch") else "(no rank made progress)"
        extra = f"; before it, {len(report.findings)} finding(s) above" if report.findings else ""
        stopped = " and was stopped" if hang.get("stopped") else ""
        console.print(Text(f"verdict: the job hung {what}{stopped}: see the stacks above{extra}",
                           style="bold red"))
    elif report.summaries:
        if not report.findings:
            console.print(Text("verdict: no gradient-synchronization misuse found", style="bold green"))
        else:
            n_err = sum(1 for f in report.findings if f.severity == "error")
            n_warn = len(report.findings) - n_err
            console.print(Text(f"verdict: {n_err} error(s), {n_warn} warning(s)",
                               style="bold red" if n_err else "bold yellow"))
    tail = []
    if exit_code is not None:
        tail.append(f"command exit code {exit_code}")
    if out_dir:
        tail.append(f"records in {out_dir}")
    if tail:
        console.print(Text("; ".join(tail), style="dim"))
