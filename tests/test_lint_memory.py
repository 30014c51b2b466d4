"""The analysis of one file leaves nothing for the cyclic garbage collector.

engine._analyse keeps the collector off while a file is analysed (its trees are all alive until then,
so collections would scan them for nothing) and relies on reference counting to free the trees once
the file is done. A reference cycle that reaches them (a recursive closure that holds the model is
the usual one) would keep a big file's trees until the collector ran, and make that run scan them.
"""
import gc
import pathlib
import textwrap

import libcst
import pytest

from synccheck.analyzer.engine import _analyse
from synccheck.analyzer.model import ModuleModel
from synccheck.analyzer.rules import ALL_RULES

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CODES = tuple(r.code for r in ALL_RULES)
# A rank branch that runs a collective through a same-file helper (SC301's walk), padded past the size
# at which narrowing drops what no rule needs (narrow.py's own walk, positions measured per function).
RANK_BRANCH = textwrap.dedent("""
    import torch.distributed as dist

    def sync(t):
        dist.all_reduce(t)

    def save(model, t):
        if dist.get_rank() == 0:
            sync(t)
    """) + "".join(f"\ndef unrelated_{i}(x):\n    return x + {i}\n" for i in range(80))


def _sources():
    yield "rank_branch.py", RANK_BRANCH
    for path in sorted(FIXTURES.glob("*/*.py")):
        yield path.name, path.read_text()


def _left_for_the_collector(text: str):
    """(parsed?, what the collector finds unreachable after one file's analysis and nothing else ran)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        findings, errors, parsed = _analyse(("<memory>.py", text.encode(), CODES))
        del findings, errors
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        if enabled:
            gc.enable()
    garbage = list(gc.garbage)
    gc.garbage.clear()
    return parsed, garbage


SOURCES = list(_sources())


@pytest.mark.parametrize("name,text", SOURCES, ids=[name for name, _ in SOURCES])
def test_analysis_leaves_no_trees_in_cycles(name, text):
    parsed, garbage = _left_for_the_collector(text)
    if not parsed:
        pytest.skip("no rule needs this file's tree")
    held = [o for o in garbage if isinstance(o, (libcst.CSTNode, ModuleModel)) or type(o).__module__ == "ast"]
    assert not held, f"{name}: {len(held)} tree or model objects held in reference cycles, " \
                     f"e.g. {sorted({type(o).__name__ for o in held})[:5]}"


def test_collector_state_is_restored():
    assert gc.isenabled()
    _analyse(("a.py", RANK_BRANCH.encode(), CODES))
    assert gc.isenabled()
    gc.disable()
    try:
        _analyse(("a.py", RANK_BRANCH.encode(), CODES))
        assert not gc.isenabled()
    finally:
        gc.enable()
