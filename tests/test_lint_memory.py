"""The analysis leaves nothing for the cyclic garbage collector.

engine._analyse_component keeps the collector off while a component is analysed (its trees are all
alive until then, so collections would scan them for nothing) and relies on reference counting to
free the trees once it is done: the project, its modules and functions, the values and the flows
point at each other while the analysis runs, and Program.close() breaks those references. A cycle
left behind would keep every tree until the collector ran, and make that run scan them.
"""
import gc
import pathlib
import textwrap

import pytest

from synccheck.analyzer.engine import _analyse_component
from synccheck.analyzer.project.index import Function, Module
from synccheck.analyzer.rules import ALL_RULES

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CODES = tuple(r.code for r in ALL_RULES)
# A rank branch that runs a collective through a helper (SC301), and a trainer whose loop spans methods.
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


def _left_for_the_collector(name: str, text: str):
    """(files parsed, what the collector finds unreachable after one analysis and nothing else ran)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        findings, errors, parsed, deps = _analyse_component(([(name, text, None, True, True, None)], CODES))
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
    parsed, garbage = _left_for_the_collector(name, text)
    assert parsed == 1
    held = [o for o in garbage if isinstance(o, (Module, Function)) or type(o).__module__ == "ast"]
    assert not held, f"{name}: {len(held)} tree or model objects held in reference cycles, " \
                     f"e.g. {sorted({type(o).__name__ for o in held})[:5]}"


def test_collector_state_is_restored():
    assert gc.isenabled()
    _analyse_component(([("a.py", RANK_BRANCH, None, True, True, None)], CODES))
    assert gc.isenabled()
    gc.disable()
    try:
        _analyse_component(([("a.py", RANK_BRANCH, None, True, True, None)], CODES))
        assert not gc.isenabled()
    finally:
        gc.enable()
