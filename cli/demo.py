"""`synccheck demo`: the gradient-accumulation experiment, live on this machine.

For each bundled example (the four setups timed in the Hugging Face Accelerate guide "Gradient
synchronization": no sync control, `no_sync` around the backward only, correct `no_sync`, and here
`GradientAccumulator` for `accumulate`; plus K-batch synchronous SGD as `LocalSGD`), the linter reads its
source, the profiler runs it on
gloo ranks and counts what was all-reduced, and the example itself reports its seconds per optimizer
step. One table puts the three side by side.

Importing this module must not import torch: the parent only lints, launches and reads JSON; torch
runs in the child processes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# (variant, example file, what it does): the order of the Accelerate guide's timing table, then local SGD.
VARIANTS: list[tuple[str, str, str]] = [
    ("baseline", "baseline.py", "no sync control: every micro-step all-reduces"),
    ("no_sync_backward_only", "no_sync_backward_only.py", "no_sync() around backward only: too late"),
    ("no_sync", "no_sync.py", "no_sync() around forward and backward"),
    ("accumulate", "accumulate.py", "synccheck.runtime.GradientAccumulator"),
    ("local_sgd", "local_sgd.py", "synccheck.runtime.LocalSGD: average parameters every K steps"),
    ("baseline_fixed", "baseline.py", "baseline.py as `synccheck lint --fix` rewrites it"),
]
FIXED = {"baseline_fixed"}     # variants run from a copy of their script that `--fix` rewrote
ACCUM = 4          # micro-steps per optimizer step (the examples' default; the Accelerate guide accumulates 4)
EVERY = 4          # local SGD: optimizer steps between parameter averagings (K of K-batch synchronous SGD)
RESULT_PREFIX = "EXAMPLE_RESULT "
VARIANT_TIMEOUT_S = 600

USAGE = "synccheck demo [--json PATH] [--ranks N] [--steps N] [--width W] [--where]"
DESCRIPTION = """\
Run a gradient-accumulation experiment on this machine, on CPU (gloo): six versions of one training
loop, each linted, run under `synccheck profile` and timed. Shows the sync misuse the linter finds in
the source, what the profiler counts at run time, and what it costs. The first four are the setups
timed in the Hugging Face Accelerate guide "Gradient synchronization"
(https://huggingface.co/docs/accelerate/concept_guides/gradient_synchronization).

variants (their scripts are in the examples folder: `synccheck demo --where`):
""" + "\n".join(f"  {name:<22} {what}" for name, _, what in VARIANTS)
EPILOG = """\
exit code: 0 every variant ran, 1 a variant failed (its row says why), 2 usage error or no PyTorch.
"""


class _UsageExit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        raise _UsageExit(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="synccheck demo", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", dest="json_path", help="also write the rows as a JSON list")
    p.add_argument("--ranks", type=_positive, default=2, metavar="N", help="gloo ranks per variant (default 2)")
    p.add_argument("--steps", type=_positive, default=16, metavar="N",
                   help="optimizer steps per variant (default 16; the first 2 are warm-up and not timed)")
    p.add_argument("--width", type=_positive, default=2048, metavar="W",
                   help="hidden width of the model: one W x W layer, 16 MB of gradients at 2048 (default)")
    p.add_argument("--where", action="store_true", help="print the folder of the example scripts and exit")
    return p


@dataclass
class Row:
    variant: str
    script: str
    lint_codes: list[str] = field(default_factory=list)
    profile_codes: list[str] = field(default_factory=list)
    synced_micro_steps_per_optimizer_step: float | None = None
    allreduce_mb_per_optimizer_step: float | None = None
    seconds_per_optimizer_step: float | None = None
    speedup: float | None = None
    param_averages: int | None = None
    final_loss: float | None = None
    ranks_agree: bool | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "variant": self.variant,
            "lint_codes": self.lint_codes,
            "profile_codes": self.profile_codes,
            "synced_micro_steps_per_optimizer_step": self.synced_micro_steps_per_optimizer_step,
            "allreduce_mb_per_optimizer_step": self.allreduce_mb_per_optimizer_step,
            "seconds_per_optimizer_step": self.seconds_per_optimizer_step,
            "speedup": self.speedup,
            "param_averages": self.param_averages,
            "final_loss": self.final_loss,
            "ranks_agree": self.ranks_agree,
            "error": self.error,
            "notes": self.notes,
        }


def examples_dir() -> Path | None:
    """The bundled example scripts: package data of an installed synccheck, or a source checkout's folder."""
    try:
        spec = importlib.util.find_spec("synccheck.examples")
    except (ImportError, ValueError):
        spec = None
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(Path(__file__).resolve().parent.parent / "examples")   # running from the source tree
    for folder in candidates:
        if all((folder / script).is_file() for _, script, _ in VARIANTS) and (folder / "common.py").is_file():
            return folder
    return None


def torch_available() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):    # sys.modules["torch"] is None: torch is blocked
        return False


def fixed_copies(folder: Path, into: Path, scripts: set) -> Path:
    """``scripts`` copied into ``into`` (with the examples' common.py) and fixed as `synccheck lint --fix`
    would (the safe fixes, checked before they are written)."""
    import shutil

    from synccheck.analyzer.fix.apply import FixOptions, fix_text
    from synccheck.analyzer.rules import ALL_RULES

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "common.py", into / "common.py")
    for name in scripts:
        text = (folder / name).read_text()
        new, _, _ = fix_text(str(into / name), text, list(ALL_RULES), FixOptions())
        (into / name).write_text(new)
    return into


def lint_codes(path: Path) -> list[str]:
    from synccheck.analyzer.engine import check_source

    return [finding.code for finding in check_source(path.read_text(encoding="utf-8"), str(path))]


def profile_command(script: Path, report: Path, args) -> list[str]:
    return [sys.executable, "-m", "synccheck", "profile", "--json", str(report), "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
            str(script), "--steps", str(args.steps), "--accum", str(ACCUM), "--width", str(args.width),
            "--every", str(EVERY)]


def _run(cmd: list[str], cwd: str, timeout: float) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group; on timeout or Ctrl-C stop the whole group (torchrun's workers too).
    Its temp directory is ``cwd``: torchrun leaves a torchelastic_* folder in it per run, which then goes
    with the demo's own temporary folder instead of piling up in /tmp."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True, env={**os.environ, "TMPDIR": cwd})
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        return None, out, err
    except BaseException:
        _stop(proc)
        proc.communicate()
        raise


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def _failure_reason(stderr: str) -> str:
    """The workers' own exception line (`RuntimeError: ...`), else the last line of output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        match = _EXCEPTION_LINE.match(line)
        if match and "ChildFailedError" not in line:
            return match.group(1)[:300]
    return lines[-1][:300] if lines else "no output"


def run_variant(row: Row, script: Path, args, tmp: str) -> None:
    report_path = Path(tmp) / f"{row.variant}.profile.json"
    returncode, out, err = _run(profile_command(script, report_path, args), cwd=tmp, timeout=VARIANT_TIMEOUT_S)
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                parsed = json.loads(line[len(RESULT_PREFIX):])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                result = parsed
    if returncode is None:
        row.error = f"timed out after {VARIANT_TIMEOUT_S} s"
        return
    if result is None:
        row.error = f"exit code {returncode}: {_failure_reason(err or out)}"
        return
    if returncode != 0:
        # torch 2.13's gloo can abort in interpreter teardown after a clean run; the result was printed.
        row.notes.append(f"exited with code {returncode} after printing its result "
                         "(torch 2.13 + gloo can abort at interpreter teardown)")
    seconds = result.get("seconds_per_optimizer_step")
    if isinstance(seconds, (int, float)) and math.isfinite(seconds):
        row.seconds_per_optimizer_step = float(seconds)
    else:
        row.notes.append("too few optimizer steps to time (the first 2 are warm-up): pass --steps 3 or more")
    row.ranks_agree = result.get("ranks_agree")
    loss = result.get("final_loss")
    if isinstance(loss, (int, float)):
        row.final_loss = float(loss) if math.isfinite(loss) else None
        if not math.isfinite(loss):
            row.notes.append(f"the training diverged (final loss {loss}); try a smaller --width")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        row.error = f"no profiler report ({type(exc).__name__}): {_failure_reason(err)}"
        return
    ranks = report.get("ranks") or []
    rank0 = next((r for r in ranks if r.get("rank") == 0), None)
    if rank0 is None or not rank0.get("optimizer_steps"):
        row.error = "the profiler recorded no optimizer step"
        return
    row.synced_micro_steps_per_optimizer_step = rank0.get("synced_micro_steps_per_step")
    row.allreduce_mb_per_optimizer_step = rank0.get("grad_allreduce_bytes", 0) / rank0["optimizer_steps"] / 1e6
    row.param_averages = rank0.get("param_averages", 0)
    row.profile_codes = sorted({f["code"] for f in report.get("findings") or []})
    if row.variant == "local_sgd" and args.steps <= EVERY:
        row.notes.append(f"with --steps {args.steps} the first parameter averaging comes after the last optimizer "
                         f"step, where the profiler has stopped recording: pass --steps {EVERY + 1} or more")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(rows: list[Row], args, console) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    title = (f"synccheck demo: {args.ranks} gloo ranks, {args.steps} optimizer steps of {ACCUM} micro-steps, "
             f"width {args.width}")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    table.add_column("variant", no_wrap=True)
    table.add_column("lint", no_wrap=True)
    table.add_column("profile", no_wrap=True)
    table.add_column("synced/step", justify="right", no_wrap=True)
    table.add_column("MB/step", justify="right", no_wrap=True)
    table.add_column("s/step", justify="right", no_wrap=True)
    table.add_column("speedup", justify="right", no_wrap=True)
    for row in rows:
        codes_style = "yellow" if row.lint_codes else "green"
        synced = row.synced_micro_steps_per_optimizer_step
        cells = [
            Text(row.variant),
            Text(", ".join(row.lint_codes) or "clean", style=codes_style),
        ]
        if row.error:
            cells += [Text("failed", style="red"), "-", "-", "-", "-"]
            table.add_row(*cells)
            continue
        cells += [
            Text(", ".join(row.profile_codes) or "clean", style="yellow" if row.profile_codes else "green"),
            _fmt(synced, ".3g"),
            _fmt(row.allreduce_mb_per_optimizer_step, ".1f"),
            _fmt(row.seconds_per_optimizer_step, ".3f"),
            Text(_fmt(row.speedup, ".2f") + ("x" if row.speedup is not None else ""),
                 style="bold green" if (row.speedup or 0) >= 1.2 else ""),
        ]
        table.add_row(*cells)
    console.print(table)
    console.print("lint: `synccheck lint` on the script; profile: `synccheck profile`'s verdict on the run; "
                  "synced/step: micro-steps whose backward all-reduced gradients, per optimizer step (ideal 1); "
                  "MB/step: gradient bytes all-reduced per optimizer step; s/step: seconds per optimizer step, the "
                  f"fastest run of {EVERY} consecutive steps after 2 warm-up steps (other load on the machine only "
                  "adds time); speedup: against baseline.", style="dim", highlight=False)
    for row in rows:
        if row.variant == "local_sgd" and not row.error:
            console.print(f"local_sgd all-reduces no gradients: it averages the parameters every {EVERY} "
                          "optimizer steps instead (K-batch synchronous SGD, as Accelerate's local SGD: "
                          "https://huggingface.co/docs/accelerate/usage_guides/local_sgd).",
                          style="dim", highlight=False)
        if row.error:
            console.print(f"{row.variant} failed: {row.error}", style="red", highlight=False)
        for note in row.notes:
            console.print(f"note: {row.variant}: {note}", style="yellow", highlight=False)
        if row.ranks_agree is False:
            console.print(f"note: {row.variant}: the ranks ended with different weights", style="red",
                          highlight=False)


def demo_main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except _UsageExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    folder = examples_dir()
    if folder is None:
        print("synccheck demo: the bundled example scripts are missing from this installation; "
              "reinstall synccheck", file=sys.stderr)
        return 2
    if args.where:
        print(folder)
        return 0
    if args.json_path:
        from synccheck.profiler.launcher import UsageError, check_output_path

        try:
            check_output_path(args.json_path, "--json")     # said now, not after a minute of training
        except UsageError as exc:
            print(f"synccheck demo: {exc}", file=sys.stderr)
            return 2
    if not torch_available():
        print("synccheck demo: needs PyTorch, which is not installed here: pip install 'synccheck[torch]'",
              file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    rows = [Row(variant=name, script=script) for name, script, _ in VARIANTS]
    started = time.perf_counter()
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress, tempfile.TemporaryDirectory(prefix="synccheck-demo-") as tmp:
        task = progress.add_task("linting the examples", total=len(rows))
        fixed = fixed_copies(folder, Path(tmp) / "fixed", {r.script for r in rows if r.variant in FIXED})
        for row in rows:
            row.lint_codes = lint_codes((fixed if row.variant in FIXED else folder) / row.script)
        for row in rows:
            progress.update(task, description=f"{row.variant}: profiling on {args.ranks} gloo ranks")
            run_variant(row, (fixed if row.variant in FIXED else folder) / row.script, args, tmp)
            progress.advance(task)
    baseline = rows[0].seconds_per_optimizer_step
    for row in rows:
        if baseline and row.seconds_per_optimizer_step:
            row.speedup = baseline / row.seconds_per_optimizer_step

    console = Console(highlight=False)
    render_table(rows, args, console)
    console.print(f"ran in {time.perf_counter() - started:.0f} s; the scripts: {folder}", style="dim")
    if args.json_path:
        try:
            with open(args.json_path, "w", encoding="utf-8") as fh:
                json.dump([row.to_json() for row in rows], fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            print(f"synccheck demo: cannot write {args.json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 1 if any(row.error for row in rows) else 0
