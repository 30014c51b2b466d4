"""Big files: the code that matters is found among hundreds of unrelated functions, at its real lines."""
import textwrap

import pytest

from synccheck.analyzer.engine import check_source

FILLER = "".join(textwrap.dedent(f"""
    @register(op_{i})
    def unrelated_{i}(x, y=[
        1, 2, 3,
    ]):
        '''Docstring that mentions nothing relevant.'''
        return x + y * {i}
    """) for i in range(60))

TRAINER = textwrap.dedent("""
    class Trainer:
        def __init__(self, model):
            self.model = DDP(model)

        def helper_a(self):
            return 1

        def helper_b(self):
            return [
                2,
                3,
            ]

        def fit(self, loader, optimizer):
            for i, (x, y) in enumerate(loader):
                loss = self.model(x).sum() / 4
                loss.backward()  # SC101
                if (i + 1) % 4 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
""")


def big_source():
    head = "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    return head + FILLER + TRAINER + FILLER


def test_big_file_findings_keep_their_lines_and_columns():
    source = big_source()
    assert source.count("\n") > 600
    lines = source.splitlines()
    expected = next(n for n, line in enumerate(lines, 1) if "# SC101" in line)
    found = [(f.code, f.line, f.column, f.end_line, f.end_column) for f in check_source(source, "big.py")]
    assert found == [("SC101", expected, 13, expected, 28)]


def test_syntax_error_in_a_big_file_points_at_the_original_line():
    source = big_source() + "\ndef broken(:\n    loss.backward()\n"
    (finding,) = check_source(source, "big.py")
    assert finding.code == "SC000" and finding.line == source.count("\n") - 1


def test_words_in_docstrings_and_comments_are_not_code():
    # torch's own docstrings are full of training-loop examples; they are not code to analyse
    documented = textwrap.dedent('''
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)

        def step(self, closure=None):
            """Performs a single optimization step.

            Example:
                >>> for i, (x, y) in enumerate(loader):
                ...     loss_fn(model(x), y).backward()
                ...     if (i + 1) % 4 == 0:
                ...         optimizer.step()
            """
            # model.no_sync() is not used here: loss.backward() runs elsewhere
            for group in self.param_groups:
                group["lr"] *= 0.5
        ''')
    assert check_source(FILLER + documented + FILLER, "s.py") == []


def _corpus():
    """Every fixture script and every rule example: each holds findings, or is a must-stay-silent case."""
    from pathlib import Path

    from synccheck.analyzer.rules import ALL_RULES

    root = Path(__file__).parent / "fixtures"
    out = [(p.stem, p.read_text()) for p in sorted(root.glob("*/*.py"))]
    out += [(f"{r.code}-{kind}-{i}", textwrap.dedent(src).lstrip("\n")) for r in ALL_RULES
            for kind, examples in (("valid", r.VALID), ("invalid", r.INVALID)) for i, src in enumerate(examples)]
    return out


CORPUS = _corpus()


@pytest.mark.parametrize("where", ["after", "before"])
@pytest.mark.parametrize("name,source", CORPUS, ids=[n for n, _ in CORPUS])
def test_a_big_file_keeps_every_finding(name, source, where):
    """The same code alone and among hundreds of unrelated functions gives the same findings, on the
    same lines and columns (filler before shifts them by its own length only)."""
    if where == "before" and "from __future__" in source:
        pytest.skip("a __future__ import must come first")
    whole = [(f.code, f.line, f.column, f.message) for f in check_source(source, "s.py")]
    padded = source + "\n" + FILLER if where == "after" else FILLER + source
    shift = 0 if where == "after" else FILLER.count("\n")
    assert padded.count("\n") >= 200
    got = [(f.code, f.line - shift, f.column, f.message) for f in check_source(padded, "s.py")]
    assert got == whole
