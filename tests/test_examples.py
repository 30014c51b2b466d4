"""The bundled examples are what the README and `synccheck demo` show: each is linted as it claims."""
from pathlib import Path

import pytest

from synccheck.analyzer.engine import check_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXPECTED = {
    "baseline.py": ["SC101"],
    "no_sync_backward_only.py": ["SC102"],
    "no_sync.py": [],
    "accumulate.py": [],
    "local_sgd.py": [],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_lints_as_documented(name):
    path = EXAMPLES / name
    codes = [f.code for f in check_source(path.read_text(), str(path))]
    assert codes == EXPECTED[name]
