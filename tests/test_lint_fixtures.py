"""Fixture scripts for every pattern the analyzer must find or must leave alone.

Each file in fixtures/lint says what it expects on the line itself (flake8-bugbear's style): a line that
must be reported ends with ``# SCxxx``; a file without such comments must produce no finding at all.
"""
from pathlib import Path

import pytest

from synccheck.analyzer.engine import check_source
from synccheck.analyzer.rules import Rule

# lint/: one pattern a file; realistic/: whole scripts modelled on nanoGPT, the accelerate and
# transformers examples, the PyTorch DDP tutorial, torchtitan, fairseq, DCGAN, ...
FIXTURES = sorted((Path(__file__).parent / "fixtures" / "lint").glob("*.py")) + \
    sorted((Path(__file__).parent / "fixtures" / "realistic").glob("*.py"))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture(path):
    source = path.read_text()
    expected = Rule.expected_lines(source)
    found = check_source(source, str(path))
    got = {(f.line, f.code) for f in found}
    detail = "\n".join(f"  {f.line}:{f.column} {f.code} {f.message}" for f in found)
    assert got == expected, f"{path.name}: expected {sorted(expected)}, got:\n{detail}"


def test_columns_count_characters_not_bytes():
    # ast's col_offset counts UTF-8 bytes; users (and ruff) count characters
    source = "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)\n" \
             "for i, (x, y) in enumerate(loader):\n" \
             "    loss = model(x).sum() / 4\n" \
             "    é = 1; loss.backward()  # é before the call: 2 bytes, 1 character\n" \
             "    if (i + 1) % 4 == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n"
    (finding,) = check_source(source, "s.py")
    line = source.splitlines()[finding.line - 1]
    assert line[finding.column - 1:finding.end_column - 1] == "loss.backward()"
