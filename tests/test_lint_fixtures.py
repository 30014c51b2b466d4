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


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_positions_match_whole_file_measure(path):
    """Findings are positioned per function (fast); the whole-file measure must agree, columns too."""
    source = path.read_text()
    fast = [(f.code, f.line, f.column, f.end_line, f.end_column) for f in check_source(source, str(path))]
    slow = [(f.code, f.line, f.column, f.end_line, f.end_column)
            for f in check_source(source, str(path), measure_whole_file=True)]
    assert fast == slow
