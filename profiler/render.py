"""The terminal report (rich) and the JSON report of a profiled run."""
from __future__ import annotations

import json
import os

from synccheck.profiler import groups as G
from synccheck.profiler.verdict import Report

# Up to this many ranks the table has a row per rank; above it, a row per group of ranks that behave alike.
PER_RANK_ROWS = 8
GROUP_ROWS = 12
NODE_LINES = 16

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
        "groups": [g.to_json() for g in G.groups(report.summaries)],
        "stragglers": G.stragglers(report.summaries),
        "nodes": G.nodes(report.summaries) if len({s.host for s in report.summaries}) > 1 else [],
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
    mb = n / 1e6
    return f"{mb:.2f}" if mb < 1000 else f"{mb:.0f}"


def _secs(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.4g}"


def _span(low: float, high: float) -> str:
    return _secs(low) if _secs(low) == _secs(high) else f"{_secs(low)}-{_secs(high)}"


def _per_step_text(per_step):
    from rich.text import Text
    if per_step is None:
        return Text("-")
    style = "green" if abs(per_step - 1) < 1e-9 else ("red" if per_step < 1 else "yellow")
    return Text(f"{per_step:.3g}", style=style)


def _print_table(report: Report, console) -> None:
    from rich import box
    from rich.table import Table

    summaries = report.summaries
    several_hosts = len({s.host for s in summaries}) > 1
    per_rank = len(summaries) <= PER_RANK_ROWS
    title = ("synccheck profile: gradient synchronization per rank" if per_rank else
             f"synccheck profile: gradient synchronization, {len(summaries)} ranks (ranks with the same counts "
             "share a row)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    table.add_column("rank" if per_rank else "ranks", justify="right", no_wrap=True)
    if several_hosts and per_rank:
        table.add_column("host")
    for name in ("steps", "micro", "synced", "synced/step", "all-reduces", "MB", "s"):
        table.add_column(name, justify="right", no_wrap=True)
    if per_rank:
        for s in summaries:
            row = [str(s.rank)] + ([s.host] if several_hosts else [])
            row += [str(s.optimizer_steps), str(s.micro_steps), str(s.synced_micro_steps),
                    _per_step_text(s.synced_per_step), str(s.grad_allreduces), _mb(s.grad_allreduce_bytes),
                    f"{s.allreduce_time_s:.3f}"]
            table.add_row(*row)
    else:
        found = G.groups(summaries)
        shown = found if len(found) <= GROUP_ROWS else found[:GROUP_ROWS - 1]
        for g in shown:
            s, (low, high) = g.first, g.times()
            label = G.rank_ranges(g.ranks)
            if len(label) > 40:
                label = f"{len(g.members)} ranks: {label[:30]}..."
            label += " (cut)" if s.truncated else ""
            table.add_row(label, str(s.optimizer_steps), str(s.micro_steps), str(s.synced_micro_steps),
                          _per_step_text(s.synced_per_step), str(s.grad_allreduces), _mb(s.grad_allreduce_bytes),
                          _span(low, high))
        if len(shown) < len(found):
            rest = found[len(shown):]
            table.add_row(f"{sum(len(g.members) for g in rest)} ranks in {len(rest)} more groups (see --json)",
                          *[""] * 7)
    console.print(table)
    others = {s.rank: ", ".join(f"{name} {n}" for name, n in sorted(s.other_collectives.items()))
              for s in summaries}
    if any(others.values()):
        texts: dict = {}
        for rank, text in others.items():
            texts.setdefault(text, []).append(rank)
        if len(texts) == 1:
            console.print(f"other collectives, every rank: {next(iter(texts))}")
        else:
            for text, ranks in sorted(texts.items(), key=lambda item: item[1][0]):
                which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {G.rank_ranges(ranks)}"
                console.print(f"other collectives, {which}: {text or '-'}")
    slow = G.stragglers(summaries)
    if slow:
        console.print("stragglers, most time in all-reduce: " + ", ".join(
            f"rank {x['rank']} ({x['host']}) {x['allreduce_time_s']:.3f} s, {x['ratio']:.2g}x the median rank's "
            f"{x['median_s']:.3f} s" for x in slow))
    if several_hosts:
        _print_nodes(G.nodes(summaries), summaries, console)


def _print_nodes(per_node: list, summaries, console) -> None:
    """A line per node; with many nodes, the ones that stand out (a straggler, a rank that stopped early) and
    one line for the rest."""
    hidden: list = []
    if len(per_node) > NODE_LINES:
        import statistics
        median = statistics.median(s.allreduce_time_s for s in summaries)
        most = max(s.optimizer_steps for s in summaries)
        odd = [n for n in per_node if n["optimizer_steps"]["min"] < most
               or n["allreduce_time_s"]["max"] >= G.STRAGGLER_RATIO * median > 0]
        shown = odd[:NODE_LINES - 1]
        hidden = [n for n in per_node if n not in shown]
        per_node = shown
    for n in per_node:
        steps = n["optimizer_steps"]
        steps_text = str(steps["min"]) if steps["min"] == steps["max"] else f"{steps['min']}-{steps['max']}"
        t = n["allreduce_time_s"]
        console.print(f"node {n['host']}: ranks {n['ranks']}, {steps_text} optimizer steps, all-reduce "
                      f"{_span(t['min'], t['max'])} s (slowest rank {n['slowest_rank']})")
    if hidden:
        low = min(n["optimizer_steps"]["min"] for n in hidden)
        high = max(n["optimizer_steps"]["max"] for n in hidden)
        steps_text = str(low) if low == high else f"{low}-{high}"
        t_low = min(n["allreduce_time_s"]["min"] for n in hidden)
        t_high = max(n["allreduce_time_s"]["max"] for n in hidden)
        console.print(f"{'other nodes' if per_node else 'nodes'} ({len(hidden)}, "
                      f"{sum(n['count'] for n in hidden)} ranks): {steps_text} optimizer steps, all-reduce "
                      f"{_span(t_low, t_high)} s per rank (each node in --json)")


def print_report(report: Report, console, *, exit_code=None, out_dir=None, headline_notes=(), hang=None) -> None:
    from rich.text import Text

    for note in headline_notes:
        console.print(Text(f"synccheck: {note}", style="yellow"))
    if report.summaries:
        _print_table(report, console)
        console.print(Text("steps: optimizer steps; synced: micro-steps whose backward all-reduced gradients; "
                           "all-reduces, MB, s: gradient all-reduce count, volume and time. Ideal: 1 synced micro-step per optimizer step (the first "
                           "step is left out: DDP rebuilds its buckets after it).", style="dim"))
    for f in report.findings:
        style = "bold red" if f.severity == "error" else "bold yellow"
        where = display_path(f.path)
        loc = f"{where}:{f.line}" if where else "(run)"
        ranks = f" [ranks {G.rank_ranges(f.ranks)}]" if f.ranks else ""
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
