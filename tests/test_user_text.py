"""What a user reads never cites the project's internal source documents ("seed 004", "seed 001's K",
"the seeds' experiment"): users have no seeds. Sources are cited by name and link instead."""
from __future__ import annotations

import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# "seed 004", "seeds 000/001/004", "Seed-004", "seed002", "(seeds 001, 004)", "the seeds' table",
# "from the seeds (002's ...)". Not "DistributedSampler seeds its shuffle" or `set_seed(42)`.
SEED_CITATION = re.compile(r"\bseeds?[\s_(-]*0\d\d\b|\bseeds['\u2019]|\bthe seeds\b", re.IGNORECASE)


def citations(text: str) -> list[str]:
    return [text[max(0, m.start() - 40):m.end() + 20].replace("\n", " ") for m in SEED_CITATION.finditer(text)]


def test_the_pattern_finds_seed_citations_and_nothing_else():
    for cited in ("measured on two nodes (seed 004)", "seed 001's K-batch SGD", "seeds 000/001/004",
                  "Seed-004 style", "the seeds' experiment", "from the seeds (002's loop)", "(seeds 001, 004)"):
        assert citations(cited), cited
    for fine in ("`DistributedSampler` seeds its shuffle with the epoch", "torch.manual_seed(0)", "set_seed(42)",
                 "seed_everything(42)", "random seeds differ per rank"):
        assert not citations(fine), fine


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    # shipped in the wheel: the demo's scripts (`synccheck demo --where`) and the runtime's docstrings
    files += sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "runtime").glob("*.py"))
    files += sorted((ROOT / "cli").glob("*.py"))
    return files


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_examples_and_cli_sources_cite_no_seed(path):
    assert citations(path.read_text(encoding="utf-8")) == [], path


def test_rule_documentation_and_fixes_cite_no_seed():
    import importlib

    from synccheck.analyzer.rules import ALL_RULES

    for rule in ALL_RULES:
        assert citations(rule.documentation()) == [], rule.code
        assert citations(rule.summary) == [], rule.code
        # the module's other texts: FIX and help strings that findings print
        module = importlib.import_module(rule.__module__)
        for name, value in vars(module).items():
            if isinstance(value, str):
                assert citations(value) == [], (rule.code, name)


@pytest.mark.parametrize("argv", [["--help"], ["lint", "--help"], ["rule", "--all"], ["rule", "--help"],
                                  ["profile", "--help"], ["report", "--help"], ["demo", "--help"]])
def test_cli_output_cites_no_seed(argv):
    proc = subprocess.run([sys.executable, "-m", "synccheck", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert citations(proc.stdout + proc.stderr) == []


def test_demo_legend_cites_no_seed():
    from rich.console import Console

    from synccheck import demo

    rows = []
    for name, script, _ in demo.VARIANTS:
        row = demo.Row(variant=name, script=script, synced_micro_steps_per_optimizer_step=1.0,
                       allreduce_mb_per_optimizer_step=1.0, seconds_per_optimizer_step=0.1, speedup=1.0)
        rows.append(row)
    rows[1].error = "exit code 1: RuntimeError: boom"
    console = Console(record=True, width=100)
    demo.render_table(rows, Namespace(ranks=2, steps=6, width=128), console)
    text = console.export_text()
    assert "local_sgd all-reduces no gradients" in text     # the legend that used to cite a seed
    assert citations(text) == []
