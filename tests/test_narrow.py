"""Narrowing keeps only what rules can use, drops the rest, and findings still point at the real lines."""
import textwrap

import pytest

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
def test_narrowing_a_big_file_keeps_every_finding(name, source, where):
    """Small files are analysed whole; the same code in a big file is narrowed first. Both must give the
    same findings, on the same lines, so narrowing never drops what a rule needs (callers, callees, the
    step after a loop, sync contexts) and its placeholders never shift a position."""
    if where == "before" and "from __future__" in source:
        pytest.skip("a __future__ import must come first")
    whole = [(f.code, f.line, f.column, f.message) for f in check_source(source, "s.py")]
    padded = source + "\n" + FILLER if where == "after" else FILLER + source
    shift = 0 if where == "after" else FILLER.count("\n")
    assert padded.count("\n") >= 200
    narrowed, _, error, line_map = narrow(padded)
    assert line_map is not None or error is not None     # it is narrowed indeed (or a syntax error)
    got = [(f.code, f.line - shift, f.column, f.message) for f in check_source(padded, "s.py")]
    assert got == whole


STEPLESS = textwrap.dedent("""
    def test_grads_match(model, inputs):
        for x in inputs:                     # backward in a loop, but nothing ever steps
            model(x).sum().backward()
        return [p.grad for p in model.parameters()]
""")


def _narrowed(source: str) -> str:
    from synccheck.analyzer.engine import wanted_rules
    from synccheck.analyzer.rules import ALL_RULES

    active = wanted_rules(source, ALL_RULES)
    loop_rules = [r for r in active if r.loop_anchors]
    narrowed, _, error, _ = narrow(source, tuple({w for r in active for w in r.anchors}),
                                   tuple({w for r in loop_rules for w in r.loop_anchors}),
                                   tuple({p for r in active for p in r.branch_anchors}),
                                   tuple({w for r in loop_rules for w in r.loop_companions}))
    assert error is None
    return narrowed


def test_a_loop_that_never_steps_is_not_parsed():
    # a test suite's step-less backward loops cannot hold an accumulation finding: no parse for them
    source = big_source() + STEPLESS
    assert "def fit" in _narrowed(source) and "def test_grads_match" not in _narrowed(source)


def test_a_step_or_a_sync_context_elsewhere_keeps_the_loop():
    caller_steps = STEPLESS + textwrap.dedent("""
        def train(model, batches, opt):
            for chunk in batches:
                test_grads_match(model, chunk)
                opt.step()
    """)
    script_steps = STEPLESS + "\ntest_grads_match(DDP(net), data)\noptimizer.step()\n"
    caller_syncs = STEPLESS + textwrap.dedent("""
        def run(model, data):
            model.require_backward_grad_sync = False
            test_grads_match(model, data)
    """)
    for extra in (caller_steps, script_steps, caller_syncs):
        assert "def test_grads_match" in _narrowed(big_source() + extra), extra
