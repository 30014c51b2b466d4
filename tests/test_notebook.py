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
