"""Suppression comments: on the finding's line, on the `with` / loop that holds it, or for the whole file."""
import subprocess
import sys
import textwrap

import pytest

from synccheck.analyzer.engine import check_source

LOOP = textwrap.dedent("""\
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model)


    def train():{def_comment}
        with torch.autocast("cuda"):{with_comment}
            for i, (x, y) in enumerate(loader):{for_comment}
                loss = model(x).sum() / 4
                loss.backward(){line_comment}
                if (i + 1) % 4 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
""")


def codes(**comments) -> list:
    slots = {k: "" for k in ("def_comment", "with_comment", "for_comment", "line_comment")}
    slots.update({k: "  " + v for k, v in comments.items()})
    return [f.code for f in check_source(LOOP.format(**slots), "train.py")]


def test_unsuppressed_loop_is_reported():
    assert codes() == ["SC101"]


@pytest.mark.parametrize("where", ["line_comment", "for_comment", "with_comment"])
@pytest.mark.parametrize("comment,silenced", [
    ("# synccheck: ignore[SC101]", True),
    ("# synccheck: ignore[SC1]", True),
    ("# synccheck: ignore", True),
    ("#synccheck:ignore[SC103, SC101]", True),
    ("# synccheck: ignore[SC103]", False),
    ("# some other comment", False),
])
def test_comment_on_line_or_enclosing_block(where, comment, silenced):
    assert codes(**{where: comment}) == ([] if silenced else ["SC101"])


def test_other_enclosing_statements_do_not_suppress():
    # only the blocks that hold a micro-step say something about it: not the function around them
    assert codes(def_comment="# synccheck: ignore[SC101]") == ["SC101"]


def test_a_loop_that_does_not_hold_the_finding_does_not_suppress():
    text = LOOP.format(def_comment="", with_comment="", for_comment="", line_comment="")
    text = text.replace("def train():", "for warmup in range(3):  # synccheck: ignore\n    pass\n\n\ndef train():")
    assert [f.code for f in check_source(text, "t.py")] == ["SC101"]


def test_multi_line_loop_header():
    text = LOOP.format(def_comment="", with_comment="", for_comment="", line_comment="")
    text = text.replace("enumerate(loader):", "enumerate(\n            loader,\n        ):  # synccheck: ignore[SC101]")
    assert [f.code for f in check_source(text, "t.py")] == []


def test_a_for_inside_a_docstring_is_not_a_loop():
    text = LOOP.format(def_comment="", with_comment="", for_comment="", line_comment="")
    # a `for` inside a docstring is text, not a loop: it holds nothing
    text = text.replace('def train():', 'def train():\n    """\n    for x in y:  # synccheck: ignore\n    """')
    assert [f.code for f in check_source(text, "t.py")] == ["SC101"]


@pytest.mark.parametrize("header,expected", [
    ("# synccheck: ignore-file\n", []),
    ("# synccheck: ignore-file[SC101]\n", []),
    ("# synccheck: ignore-file[SC1]\n", []),
    ("# synccheck: ignore-file[SC103]\n", ["SC101"]),
    ("# synccheck: ignore-file[SC102]\n# synccheck: ignore-file[SC101]\n", []),
])
def test_file_level(header, expected):
    text = header + LOOP.format(def_comment="", with_comment="", for_comment="", line_comment="")
    assert [f.code for f in check_source(text, "t.py")] == expected


def test_ignore_file_with_codes_on_the_finding_line_is_not_a_bare_ignore():
    text = LOOP.format(def_comment="", with_comment="", for_comment="",
                       line_comment="  # synccheck: ignore-file[SC103]")
    assert [f.code for f in check_source(text, "t.py")] == ["SC101"]


def test_cli_honours_block_and_file_suppression(tmp_path):
    text = LOOP.format(def_comment="", with_comment="  # synccheck: ignore[SC101]", for_comment="", line_comment="")
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.py").write_text("# synccheck: ignore-file[SC103]\n" + text.replace("  # synccheck: ignore[SC101]", ""))
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", "--format", "concise", "."],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "b.py:11:13: SC101" in proc.stdout and "a.py" not in proc.stdout
