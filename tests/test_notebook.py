"""Jupyter notebooks: code cells analysed together, IPython syntax tolerated, findings point at the cell."""
import json
import subprocess
import sys

import pytest

from synccheck.analyzer.notebook import parse_notebook, python_lines


def cell(source, kind="code"):
    c = {"cell_type": kind, "metadata": {}, "source": source}
    if kind == "code":
        c.update(outputs=[], execution_count=None)
    return c


def notebook(*cells, language="python"):
    return json.dumps({"cells": list(cells), "nbformat": 4, "nbformat_minor": 5,
                       "metadata": {"kernelspec": {"name": "k", "language": language, "display_name": "k"}}})


WRAP = ["from torch.nn.parallel import DistributedDataParallel as DDP\n", "model = DDP(model)"]
TRAIN = ("for i, (x, y) in enumerate(loader):\n"
         "    loss = model(x).sum() / 4\n"
         "    loss.backward()\n"
         "    if (i + 1) % 4 == 0:\n"
         "        optimizer.step()\n"
         "        optimizer.zero_grad()\n")


def lint(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", *args],
                          capture_output=True, text=True, cwd=tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


def test_wrap_in_one_cell_and_loop_in_another_maps_to_cell_and_line(tmp_path):
    (tmp_path / "train.ipynb").write_text(notebook(
        cell(["# Training\n", "Some words."], "markdown"),                 # cell 1
        cell(WRAP),                                                        # cell 2
        cell("print('unrelated')\n"),                                      # cell 3
        cell(["# the loop\n", TRAIN]),                                     # cell 4 (a string source)
    ))
    proc = lint(tmp_path, "--format", "json", ".")
    assert proc.returncode == 1
    (f,) = json.loads(proc.stdout)["findings"]
    assert (f["code"], f["cell"], f["line"], f["column"], f["end_line"]) == ("SC101", 4, 4, 5, 4)
    assert f["path"].endswith("train.ipynb")
    full = lint(tmp_path, "train.ipynb")
    assert "train.ipynb:4:5 (cell 4): SC101" in full.stdout
    assert "loss.backward()" in full.stdout          # the cell's own line is shown
    assert "(cell 4)" in lint(tmp_path, "--format", "concise", ".").stdout


def test_magics_do_not_break_the_parse(tmp_path):
    (tmp_path / "nb.ipynb").write_text(notebook(
        cell(["!pip install torch\n", "%matplotlib inline\n", "%load_ext autoreload\n"] + WRAP),
        cell("%%bash\necho 'not python (\n"),
        cell("%%time\n" + TRAIN.replace("    loss.backward()\n",
                                         "    %time x = 1\n    loss.backward()\n    !nvidia-smi\n")),
        cell("model?\n"),
        cell("??model\n"),
        cell("files = !ls\nt = %timeit -o f()\n"),
        cell("%%writefile helper.py\ndef f(:\n"),
    ))
    proc = lint(tmp_path, "--format", "json", ".")
    data = json.loads(proc.stdout)
    assert [(f["code"], f["cell"], f["line"]) for f in data["findings"]] == [("SC101", 3, 5)]
    assert data["errors"] == []


@pytest.mark.parametrize("cell_lines,expected", [
    (["%time f()"], ["pass"]),
    (["for x in y:", "    %time f()"], ["for x in y:", "    pass"]),
    (["!pip install x"], ["pass"]),
    (["x?", "x??", "?x"], ["pass", "pass", "pass"]),
    (["a = (b", "     % c)"], ["a = (b", "     % c)"]),          # a modulo inside brackets stays
    (["if (i + 1) \\", "        % 4 == 0:", "    step()"], ["if (i + 1) \\", "        % 4 == 0:", "    step()"]),
    (['s = """', "!not a command", '"""'], ['s = """', "!not a command", '"""']),
    (["print('why?')"], ["print('why?')"]),
    (["x = 1  # really?"], ["x = 1  # really?"]),
    (["out = !ls"], ["out = None"]),
    (["%%bash", "ls -la", "echo 'x"], ["", "", ""]),
    (["%%time", "%time f()", "g()"], ["", "pass", "g()"]),
    # Colab runs a cell magic after comment lines (yolov5's tutorial: ``# CI Checks`` then ``%%shell``)
    (["# CI Checks", "", "%%shell", "export X=\"$PWD\"", "for m in a; do"], ["", "", "", "", ""]),
    (["# timed", "%%time", "g()"], ["", "", "g()"]),
    (["# a comment", "x = 1"], ["# a comment", "x = 1"]),
    # a shell command continued over several lines (ABCD-3DCNN's notebooks): every line is the command's
    (["!python train.py \\", "  --lr 0.1 \\", "  --epochs 3", "x = 1"], ["pass", "", "", "x = 1"]),
    # automagic: a shell alias or line magic without its ``%`` (a Kaggle notebook's ``ls /kaggle/...``),
    # only where the line is no Python (``ls = 3`` and ``run(x)`` stay)
    (["ls /kaggle/working/dataset/ ", "cd ..", "pip install torch"], ["pass", "pass", "pass"]),
    (["ls = 3", "time = 4", "run(x)", "env = os.environ", "print(ls)"],
     ["ls = 3", "time = 4", "run(x)", "env = os.environ", "print(ls)"]),
])
def test_python_lines(cell_lines, expected):
    assert python_lines(cell_lines) == expected


@pytest.mark.parametrize("data,needle", [
    (b"{not json", "not a notebook: invalid JSON"),
    (b'{"metadata": {}}', 'not a notebook: no "cells" list'),
    (b"[1, 2]", 'not a notebook: no "cells" list'),
    (b'{"worksheets": [], "nbformat": 3}', "nbformat 3"),
    (b"\xff\xfe\x00garbage", "not a notebook"),
    (b"[" * 100000, "not a notebook"),
    (b'{"cells": [{"cell_type": "markdown", "source": 7}, {"cell_type": "code", "source": 42}]}',
     "not a notebook: cell 2's \"source\" is neither text nor a list of lines"),
    (b'{"cells": [{"cell_type": "code", "source": ["model = DDP(m)\\n", 3]}]}', "cell 1's \"source\""),
])
def test_not_a_notebook_is_reported_and_the_rest_still_linted(tmp_path, data, needle):
    (tmp_path / "bad.ipynb").write_bytes(data)
    (tmp_path / "good.ipynb").write_text(notebook(cell(WRAP), cell(TRAIN)))
    proc = lint(tmp_path, "--format", "json", ".")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    (error,) = out["errors"]
    assert error["path"].endswith("bad.ipynb") and needle in error["message"]
    assert [f["code"] for f in out["findings"]] == ["SC101"]
    concise = lint(tmp_path, "--format", "concise", "bad.ipynb")
    assert concise.returncode == 1 and "bad.ipynb: error: not a notebook" in concise.stdout


def test_syntax_error_points_at_its_cell(tmp_path):
    (tmp_path / "nb.ipynb").write_text(notebook(cell(WRAP), cell("x = 1\nfor i in loader:\n    loss.backward()\n    optimizer.step(\n")))
    data = json.loads(lint(tmp_path, "--format", "json", ".").stdout)
    assert [(f["code"], f["cell"], f["line"]) for f in data["findings"]] == [("SC000", 2, 4)]


def test_suppression_in_a_cell(tmp_path):
    (tmp_path / "nb.ipynb").write_text(notebook(
        cell(WRAP), cell(TRAIN.replace("enumerate(loader):", "enumerate(loader):  # synccheck: ignore[SC101]"))))
    assert lint(tmp_path, ".").returncode == 0


def test_other_languages_are_not_python(tmp_path):
    (tmp_path / "r.ipynb").write_text(notebook(cell(WRAP), cell(TRAIN), language="R"))
    assert lint(tmp_path, ".").returncode == 0


def test_cells_never_run_into_each_other():
    # a cell that ends inside an indented block must not swallow the next cell's first line
    nb, error = parse_notebook("x.ipynb", notebook(cell("for x in y:\n    pass"), cell("z = 1")).encode())
    assert error is None
    assert nb.text == "for x in y:\n    pass\n\nz = 1\n\n"
    assert nb.locate(4) == (2, 1) and nb.locate(3) == (1, 2)


def test_cached_results_keep_the_cell(tmp_path):
    (tmp_path / "nb.ipynb").write_text(notebook(cell(WRAP), cell(TRAIN)))
    args = [sys.executable, "-m", "synccheck", "lint", "--format", "json", "--cache-dir", str(tmp_path / "cache"), "."]
    cold = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    warm = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    assert cold.returncode == warm.returncode == 1
    assert json.loads(cold.stdout) == json.loads(warm.stdout)
    assert json.loads(warm.stdout)["findings"][0]["cell"] == 2


# --- fixes -----------------------------------------------------------------------------------------

def rich_notebook(indent=1, ensure_ascii=False):
    """A notebook as Jupyter saves it: markdown and raw cells, outputs (text and an image), metadata,
    non-ASCII text, the wrap in one code cell and the loop in a later one."""
    doc = {
        "cells": [
            {"cell_type": "markdown", "id": "m1", "metadata": {}, "source": ["# Entraînement\n", "Ça tourne sur 2 GPU."]},
            {"cell_type": "code", "execution_count": 1, "id": "c1", "metadata": {"tags": ["setup"]},
             "outputs": [{"name": "stdout", "output_type": "stream", "text": ["ready ✓\n"]}],
             "source": ["%pip install torch\n"] + WRAP},
            {"cell_type": "raw", "id": "r1", "metadata": {}, "source": ["model = DDP(model)  # raw, never run"]},
            {"cell_type": "code", "execution_count": 2, "id": "c2", "metadata": {"scrolled": True},
             "outputs": [{"data": {"image/png": "iVBORw0KGgo=\n", "text/plain": ["<Figure>"]},
                          "metadata": {"needs_background": "light"}, "output_type": "display_data"}],
             "source": ["# the loop\n"] + TRAIN.splitlines(keepends=True)},
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                     "language_info": {"name": "python", "version": "3.11.4"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    return doc, json.dumps(doc, indent=indent, ensure_ascii=ensure_ascii) + "\n"


def apply_cell_edits(doc, edits):
    """The notebook's cell sources with JSON edits applied to the cell each names."""
    from synccheck.analyzer.fix.check import apply_edits

    sources = {n: "".join(c["source"]) for n, c in enumerate(doc["cells"], start=1)}
    for number in sorted({e["cell"] for e in edits}):
        sources[number] = apply_edits(sources[number], [e for e in edits if e["cell"] == number])
    return sources


def test_json_fix_edits_are_in_cell_coordinates_and_match_what_fix_writes(tmp_path):
    doc, text = rich_notebook()
    path = tmp_path / "train.ipynb"
    path.write_text(text, encoding="utf-8")
    (f,) = json.loads(lint(tmp_path, "--format", "json", "train.ipynb").stdout)["findings"]
    assert (f["code"], f["cell"], f["line"]) == ("SC101", 4, 4)
    edits = f["fix"]["edits"]
    assert f["fix"]["applicability"] == "safe"
    # the import goes into cell 2 (after its `%pip` line), the wrap into cell 4, rows counted in the cell
    assert [(e["cell"], e["location"]["row"], e["end_location"]["row"]) for e in edits] == [(2, 2, 2), (4, 3, 5)]
    assert edits[0]["content"] == "import contextlib\n"
    assert edits[1]["content"].startswith("    with (contextlib.nullcontext() if (i + 1) % 4 == 0 else model.no_sync()):\n")
    expected = apply_cell_edits(doc, edits)
    assert lint(tmp_path, "--fix", "train.ipynb").returncode == 0
    fixed = json.loads(path.read_text(encoding="utf-8"))
    assert {n: "".join(c["source"]) for n, c in enumerate(fixed["cells"], start=1)} == expected


@pytest.mark.parametrize("indent,ensure_ascii,bom,newline", [(1, False, False, "\n"), (2, False, False, "\n"),
                                                         (4, True, False, "\n"), (None, False, False, "\n"),
                                                         (1, False, True, "\r\n")])
def test_fix_changes_only_the_fixed_cells_sources(tmp_path, indent, ensure_ascii, bom, newline):
    doc, text = rich_notebook(indent, ensure_ascii)
    path = tmp_path / "train.ipynb"
    prefix = b"\xef\xbb\xbf" if bom else b""
    path.write_bytes(prefix + text.replace("\n", newline).encode("utf-8"))
    assert lint(tmp_path, "--fix", "train.ipynb").returncode == 0
    raw = path.read_bytes()
    assert raw.startswith(prefix) and (b"\r\n" in raw) == (newline == "\r\n")
    after = raw[len(prefix):].decode("utf-8").replace(newline, "\n")
    fixed = json.loads(after)
    for number in (1, 3):          # markdown and raw cells: untouched
        assert fixed["cells"][number - 1] == doc["cells"][number - 1]
    for number in (2, 4):          # code cells: only the source changed (outputs, metadata, ids kept)
        assert {k: v for k, v in fixed["cells"][number - 1].items() if k != "source"} == \
            {k: v for k, v in doc["cells"][number - 1].items() if k != "source"}
        assert fixed["cells"][number - 1]["source"] != doc["cells"][number - 1]["source"]
    assert fixed["metadata"] == doc["metadata"]
    doc["cells"][1]["source"], doc["cells"][3]["source"] = fixed["cells"][1]["source"], fixed["cells"][3]["source"]
    # written as it was: the same indent, escapes and final newline
    assert after == json.dumps(doc, indent=indent, ensure_ascii=ensure_ascii) + "\n"
    assert lint(tmp_path, "train.ipynb").returncode == 0


def test_diff_shows_each_changed_cell_and_writes_nothing(tmp_path):
    _, text = rich_notebook()
    path = tmp_path / "train.ipynb"
    path.write_text(text, encoding="utf-8")
    proc = lint(tmp_path, "--diff", "train.ipynb")
    assert proc.returncode == 1 and path.read_text(encoding="utf-8") == text
    out = proc.stdout
    assert "--- train.ipynb:cell 2\n+++ train.ipynb:cell 2\n" in out
    assert "--- train.ipynb:cell 4\n+++ train.ipynb:cell 4\n" in out
    assert "+import contextlib\n" in out and "-    loss.backward()\n" in out
    assert "\"source\"" not in out and "cell 1" not in out and "cell 3" not in out   # cells, not JSON
    assert "Would fix 1 problem." in proc.stderr


def runs_on_notebook():
    """A loop that runs on from one cell into the next: Jupyter would refuse the second cell, but the
    joined code parses, and the SC101 rewrite would have to wrap statements of both cells."""
    return notebook(cell(WRAP), cell("for i, (x, y) in enumerate(loader):\n    loss = model(x).sum() / 4"),
                    cell("    loss.backward()\n    if (i + 1) % 4 == 0:\n        optimizer.step()\n"))


def test_a_fix_across_two_cells_is_not_offered(tmp_path):
    path = tmp_path / "nb.ipynb"
    path.write_text(runs_on_notebook())
    (f,) = json.loads(lint(tmp_path, "--format", "json", "nb.ipynb").stdout)["findings"]
    assert f["code"] == "SC101" and f["fix"]["applicability"] == "display-only" and f["fix"]["edits"] == []
    assert "two notebook cells" in f["fix"]["message"]
    proc = lint(tmp_path, "--fix", "--unsafe-fixes", "nb.ipynb")
    assert proc.returncode == 1 and path.read_text() == runs_on_notebook()
    assert "no automatic fix: the fix would change a statement that runs across two notebook cells" in proc.stdout
    assert "fixable" not in proc.stdout


def test_an_edit_over_a_cell_boundary_cannot_be_mapped():
    from synccheck.analyzer.fix.check import apply_edits
    from synccheck.analyzer.fix.notebooks import cell_sources

    nb, _ = parse_notebook("x.ipynb", notebook(cell(WRAP), cell(TRAIN)).encode())
    # the joined text: cell 1 (2 lines), a blank separator line, cell 2; join the two cells
    edit = {"content": "model = DDP(model); ", "location": {"row": 2, "column": 1}, "end_location": {"row": 4, "column": 1}}
    with pytest.raises(ValueError, match="two notebook cells"):
        cell_sources(nb, apply_edits(nb.text, [edit]))
    assert nb.map_fix({"applicability": "safe", "message": "m", "edits": [edit]}) == \
        {"reason": "the fix would change lines of two notebook cells at once"}


def test_a_fix_that_would_reindent_a_magic_is_not_offered(tmp_path):
    path = tmp_path / "nb.ipynb"
    source = notebook(cell(WRAP), cell(TRAIN.replace("    loss.backward()\n", "    %time f()\n    loss.backward()\n")))
    path.write_text(source)
    (f,) = json.loads(lint(tmp_path, "--format", "json", "nb.ipynb").stdout)["findings"]
    assert f["fix"]["edits"] == [] and "IPython syntax in cell 2" in f["fix"]["message"]
    assert lint(tmp_path, "--fix", "nb.ipynb").returncode == 1 and path.read_text() == source


@pytest.mark.parametrize("old,new", [
    ("a\nb", "a\nc\nd"), ("a\nb\n", "x\na\nb\n"), ("a\nb", "a\nb\nc"), ("", "x"), ("a", ""),
    ("a\n  b\nc", "a\n  with x:\n      b\nc"), ("a\nb", "b"),
])
def test_cell_edits_turn_the_old_source_into_the_new(old, new):
    from synccheck.analyzer.fix.check import apply_edits
    from synccheck.analyzer.fix.notebooks import cell_edits

    edits = cell_edits(old, new)
    assert apply_edits(old, edits) == new
    for e in edits:     # no position past the cell's text
        assert e["end_location"]["row"] <= old.count("\n") + 1
