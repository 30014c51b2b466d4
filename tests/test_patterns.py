"""Patterns taken from real public training code, each reduced to a small project of our own writing
(tests/fixtures/patterns/NAME: the .py files, ``expected.txt`` with ``path:LINE CODE`` lines a
correct analyzer reports and nothing else, and a README naming the real file it stands for and why).

The cases synccheck does not get right yet stay here as strict expected failures: the day one is
fixed, its test says so and the mark must go."""
import shutil
from pathlib import Path

import pytest

from projectlib import found

PATTERNS = Path(__file__).parent / "fixtures" / "patterns"

# what real code does that the analyzer does not model yet (see each folder's README.md)
KNOWN_GAPS = {
    "28_forward_through_unwrapped_module_after_prepare": "a generator's variable is not bound per element "
                                                         "(only direct.py's `net = model.module` is found)",
    "404_step_gate_after_many_guards_in_one_turn": "ten tests per flow: the plain guards read first take every "
                                                   "place before the step's gate (keeping a place for counting "
                                                   "tests cost three corpus false alarms)",
}


def _cases():
    for folder in sorted(p for p in PATTERNS.iterdir() if (p / "expected.txt").is_file()):
        marks = [pytest.mark.xfail(reason=KNOWN_GAPS[folder.name], strict=True)] if folder.name in KNOWN_GAPS else []
        yield pytest.param(folder, id=folder.name, marks=marks)


def _expected(folder: Path) -> set:
    out = set()
    for line in (folder / "expected.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            where, code = line.split()
            path, lineno = where.rsplit(":", 1)
            out.add((path, int(lineno), code))
    return out


@pytest.mark.parametrize("folder", list(_cases()))
def test_real_world_pattern(tmp_path, folder):
    root = tmp_path / "project"
    shutil.copytree(folder, root)
    got = found(root)
    want = _expected(folder)
    assert got == want, f"expected {sorted(want)}, got {sorted(got)}"


def test_every_known_gap_is_a_folder():
    names = {p.name for p in PATTERNS.iterdir()}
    assert set(KNOWN_GAPS) <= names


def test_a_model_left_out_of_accumulate_is_told_to_join_it(tmp_path):
    # pattern 51: the fix names the context to widen; an accelerate loop with no accumulate() at all
    # keeps the general advice (use accumulate)
    from synccheck.analyzer.engine import lint

    root = tmp_path / "project"
    shutil.copytree(PATTERNS / "51_accumulate_names_one_model_of_two", root)
    (root / "manual.py").write_text(
        "from accelerate import Accelerator\n\n"
        "def train(model, opt, loader, n):\n"
        "    accelerator = Accelerator()\n"
        "    model, opt, loader = accelerator.prepare(model, opt, loader)\n"
        "    for i, batch in enumerate(loader):\n"
        "        accelerator.backward(model(batch).mean() / n)\n"
        "        if (i + 1) % n == 0:\n"
        "            opt.step()\n"
        "            opt.zero_grad()\n")
    fixes = {Path(f.path).name: f.fix for f in lint([str(root)], jobs=1).findings if f.code == "SC101"}
    assert "accelerator.accumulate(generator, discriminator)" in fixes["gan.py"]
    assert "accelerator.accumulate(model)" in fixes["manual.py"] and "several models" not in fixes["manual.py"]
