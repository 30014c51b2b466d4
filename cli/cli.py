"""The `synccheck` command: a thin dispatcher.

Each sub-command lives with the part it belongs to and is imported only when it is asked for, so
`synccheck lint` never pays for the profiler's imports (and never imports torch).
"""
from __future__ import annotations

import importlib
import os
import sys

from synccheck import __version__

# name -> (module, function, one-line help). The function takes argv (without the command name)
# and returns the exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "lint": ("synccheck.analyzer.cli", "lint_main", "check scripts for gradient-sync misuse (static, never runs them)"),
    "rule": ("synccheck.analyzer.cli", "rule_main", "print a rule's documentation (`synccheck rule SC101`, `--all`)"),
    "profile": ("synccheck.profiler.cli", "profile_main",
                "run a training command and count gradient all-reduces per optimizer step in every rank"),
    "report": ("synccheck.profiler.cli", "report_main",
               "report again on the records of `synccheck profile --out DIR` (several nodes: merged)"),
    "demo": ("synccheck.demo", "demo_main",
             "lint, profile and time five versions of a gradient-accumulation loop on this machine (CPU)"),
}

USAGE = """usage: synccheck <command> [options]

Find and fix gradient-synchronization misuse in PyTorch data-parallel training.

commands:
{commands}

`synccheck <command> --help` describes a command's options.
"""


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {helptext}" for name, (_, _, helptext) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"synccheck {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"synccheck: unknown command {name!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except KeyboardInterrupt:
        print("synccheck: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `synccheck lint . | head`: the reader went away; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # an internal error is one line, never a traceback, unless asked for
        if os.environ.get("SYNCCHECK_DEBUG"):
            raise
        print(f"synccheck: internal error: {type(exc).__name__}: {exc} (set SYNCCHECK_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 2
