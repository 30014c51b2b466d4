"""Session-wide test set-up."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_temp_dir(tmp_path_factory):
    """Every process the tests start gets its temp directory under pytest's own (which pytest prunes to
    its last 3 runs), so nothing lands in /tmp: `synccheck profile` runs without --out that keep their
    records (failed, interrupted or hung commands), torchrun's torchelastic_* folders, the demo's."""
    folder = tmp_path_factory.mktemp("TMPDIR")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
