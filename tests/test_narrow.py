"""Narrowing keeps only what rules can use, drops the rest, and findings still point at the real lines."""
import textwrap

from synccheck.analyzer.engine import check_source
from synccheck.analyzer.narrow import narrow

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


def test_big_file_is_narrowed_and_findings_keep_their_lines():
    source = big_source()
    assert source.count("\n") > 600
    narrowed, tree, error, line_map = narrow(source, (), ("backward(",))
    assert error is None and line_map is not None
    assert narrowed.count("\n") < source.count("\n") // 4          # most of the file is dropped
    assert "def fit" in narrowed and "def unrelated_7" not in narrowed
    lines = source.splitlines()
    for i, line in enumerate(narrowed.splitlines()):   # kept lines are the original lines, columns too
        if line.strip() != "...":
            assert lines[line_map[i] - 1] == line
    expected = next(n for n, line in enumerate(lines, 1) if "# SC101" in line)
    fast = [(f.code, f.line, f.column, f.end_line, f.end_column) for f in check_source(source, "big.py")]
    slow = [(f.code, f.line, f.column, f.end_line, f.end_column)
            for f in check_source(source, "big.py", measure_whole_file=True)]
    assert fast == slow == [("SC101", expected, 13, expected, 28)]


def test_syntax_error_in_a_big_file_points_at_the_original_line():
    source = big_source() + "\ndef broken(:\n    loss.backward()\n"
    (finding,) = check_source(source, "big.py")
    assert finding.code == "SC000" and finding.line == source.count("\n") - 1


def test_words_in_docstrings_and_comments_do_not_keep_a_function():
    # torch's own docstrings are full of training-loop examples; they are not code to analyse
    documented = textwrap.dedent('''
        def step(self, closure=None):
            """Performs a single optimization step.

            Example:
                >>> for x, y in loader:
                ...     loss_fn(model(x), y).backward()
                ...     optimizer.step()
            """
            # model.no_sync() is not used here: loss.backward() runs elsewhere
            for group in self.param_groups:
                group["lr"] *= 0.5
        ''')
    source = "import torch\n" + FILLER + documented + FILLER
    narrowed, _, error, _ = narrow(source, ("no_sync",), ("backward(",))
    assert error is None
    assert "def step" not in narrowed
    coded = documented.replace('group["lr"] *= 0.5', "loss_fn(model(x), y).backward()")
    narrowed, _, _, _ = narrow("import torch\n" + FILLER + coded + FILLER, ("no_sync",), ("backward(",))
    assert "def step" in narrowed
