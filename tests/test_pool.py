"""Work done in other processes gives what it gives in this one, in the same order."""
import os

import pytest

from synccheck.analyzer import pool
from synccheck.analyzer.engine import _read_files, _no_key, lint
from synccheck.analyzer.imports import imported_names
from synccheck.analyzer.rules import ALL_RULES

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")


def _square(x):
    return x * x


def _fail(x):
    if x == 2:
        raise ValueError(f"no {x}")
    return x


@needs_fork
def test_run_forked_keeps_the_order_and_raises_what_the_child_raised():
    assert pool.run_forked(_square, list(range(7)), 2, warm=False) == [x * x for x in range(7)]
    with pytest.raises(ValueError, match="no 2"):
        pool.run_forked(_fail, [1, 2, 3], 2, warm=False)


@needs_fork
def test_reading_in_several_processes_reads_what_one_reads(tmp_path, monkeypatch):
    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(f"import os\nfrom .m{i + 1} import f\nrank = {i}\n" if i % 3 else "x = 1\n")
    files = [(str(p), False) for p in sorted(tmp_path.glob("*.py"))]
    context = (_no_key, imported_names, list(ALL_RULES))
    one = [(e.path, e.gated, e.imports, e.text, e.eager) for e, _ in pool._Pool(1).read_all(_read_files, files, context)]
    monkeypatch.setattr(pool, "READ_APART_MIN_FILES", 1)
    two = [(e.path, e.gated, e.imports, e.text, e.eager) for e, _ in pool._Pool(3).read_all(_read_files, files, context)]
    assert one == two


@needs_fork
def test_a_large_component_alone_in_a_child_finds_what_it_finds_here(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(net)\nfor i, batch in enumerate(loader):\n    loss = model(batch)\n    loss.backward()\n"
        "    if (i + 1) % 4 == 0:\n        opt.step()\n        opt.zero_grad()\n")
    here = [(f.code, f.line) for f in lint([str(tmp_path)], jobs=1).findings]
    monkeypatch.setattr(pool, "APART_MIN_TEXT", 1)
    apart = [(f.code, f.line) for f in lint([str(tmp_path)], jobs=2).findings]
    assert here == apart and here
