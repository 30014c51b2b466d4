"""`synccheck lint` as a user runs it: exit codes, formats, and bad input (never a traceback)."""
import json
import os
import subprocess
import sys

import pytest

from lintlib import BAD_LOOP



def run(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "synccheck", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "SYNCCHECK_DEBUG": ""})
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def test_findings_exit_1_and_json_shape(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    proc = run("lint", "--format", "json", str(tmp_path))
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["version"] == 1 and data["files"] == 1 and data["errors"] == []
    (f,) = data["findings"]
    assert set(f) == {"code", "name", "severity", "path", "line", "column", "end_line", "end_column",
                      "message", "fix"}
    assert (f["code"], f["name"], f["severity"], f["line"], f["column"]) == (
        "SC101", "sync-every-microstep", "warning", 5, 5)
    assert f["path"].endswith("train.py") and "no_sync" in f["fix"]["message"]
    # ruff's shape: an applicability and edits with 1-based ranges
    assert f["fix"]["applicability"] == "safe" and f["fix"]["edits"]
    assert set(f["fix"]["edits"][0]) == {"content", "location", "end_location"}


def test_clean_exit_0(tmp_path):
    (tmp_path / "ok.py").write_text("print('hello')\n")
    proc = run("lint", str(tmp_path))
    assert proc.returncode == 0 and "All checks passed" in proc.stdout


def test_full_format_shows_source_and_fix(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    proc = run("lint", str(tmp_path / "train.py"))
    assert proc.returncode == 1
    assert "train.py:5:5: SC101" in proc.stdout
    assert "loss.backward()" in proc.stdout and "^^^^" in proc.stdout
    assert "fix:" in proc.stdout and "Found 1 problem" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["lint", "/definitely/not/here.py"], "no such file"),
    (["lint", "--select", "SC999", "."], "unknown rule code"),
    (["lint", "--no-such-option"], "unrecognized arguments"),
    (["lint", "--format", "xml", "."], "invalid choice"),
    (["nonsense"], "unknown command"),
    (["rule", "SC999"], "unknown rule"),
])
def test_usage_errors_exit_2_one_line(args, needle, tmp_path):
    proc = run(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_select_and_ignore_prefixes(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    assert run("lint", "--select", "SC1", str(tmp_path)).returncode == 1
    assert run("lint", "--ignore", "SC101", str(tmp_path)).returncode == 0
    assert run("lint", "--select", "SC103", str(tmp_path)).returncode == 0


def test_inline_suppression(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP.replace("loss.backward()", "loss.backward()  # synccheck: ignore[SC101]"))
    assert run("lint", str(tmp_path)).returncode == 0
    (tmp_path / "train.py").write_text(BAD_LOOP.replace("loss.backward()", "loss.backward()  # synccheck: ignore[SC103]"))
    assert run("lint", str(tmp_path)).returncode == 1


def test_bad_input_is_reported_and_the_rest_still_linted(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    # files that mention training get parsed; a syntax error there is SC000 (files that don't are skipped)
    (tmp_path / "syntax.py").write_text("for i in loader:\n    with model.no_sync():\n        loss.backward(\n")
    (tmp_path / "py2.py").write_text("for i in loader:\n    print 'loss', model.no_sync(), loss.backward()\n")
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "binary.py").write_bytes(b"\x7fELF\x00\x00\x01backward")
    (tmp_path / "latin1_cookie.py").write_bytes(
        b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + BAD_LOOP.encode())
    (tmp_path / "latin1_no_cookie.py").write_bytes(b"# caf\xe9\nloss.backward()\n")
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink(str(tmp_path), str(loop / "back"))   # a folder symlink loop
    proc = run("lint", "--format", "json", str(tmp_path))
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    by_file = {}
    for f in data["findings"]:
        by_file.setdefault(os.path.basename(f["path"]), []).append(f["code"])
    assert by_file["train.py"] == ["SC101"]
    assert by_file["syntax.py"] == ["SC000"]
    assert by_file["py2.py"] == ["SC000"]
    assert by_file["latin1_cookie.py"] == ["SC101"]          # the coding cookie is honoured
    assert "empty.py" not in by_file
    errors = {os.path.basename(e["path"]): e["message"] for e in data["errors"]}
    assert "binary" in errors["binary.py"]
    assert "cannot decode" in errors["latin1_no_cookie.py"]
    py2 = next(f for f in data["findings"] if f["path"].endswith("py2.py"))
    assert "print" in py2["message"] and py2["line"] == 2


def test_rule_command_prints_docs():
    proc = run("rule", "SC101")
    assert proc.returncode == 0
    for heading in ("What it does", "Why is this bad?", "Example", "Use instead"):
        assert heading in proc.stdout
    listing = run("rule", "--all")
    assert listing.returncode == 0 and "SC103" in listing.stdout


def test_lint_never_imports_torch_or_the_checked_code(tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n" + BAD_LOOP)
    code = ("import sys, synccheck.cli as c; rc = c.main(['lint', '--format', 'json', sys.argv[1]]);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert not marker.exists()


def test_a_folder_without_python_files_is_clean_but_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("loss.backward()\n")
    proc = run("lint", "--no-cache", str(tmp_path))
    assert proc.returncode == 0
    assert "no Python files found" in proc.stderr and "0 files checked" in proc.stdout
