"""`[tool.synccheck]` in pyproject.toml, as a user writes it: selection, excludes, per-file ignores, and
configuration mistakes (one line naming the file and the key, exit 2)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from lintlib import BAD_LOOP



def run(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", *args], capture_output=True,
                          text=True, cwd=cwd)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def reported(proc) -> list:
    """Sorted (relative path, code) pairs of a `--format json` run."""
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    return sorted((os.path.normpath(f["path"]), f["code"]) for f in data["findings"])


def project(tmp_path, config: str, files=("train.py",)):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'demo'\n\n[tool.synccheck]\n" + textwrap.dedent(config))
    for name in files:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(BAD_LOOP)
    return tmp_path


@pytest.mark.parametrize("config,expected_rc", [
    ("", 1),
    ('ignore = ["SC101"]\n', 0),
    ('ignore = ["SC1"]\n', 0),
    ('select = ["SC103"]\n', 0),
    ('select = ["SC1"]\n', 1),
    ('select = ["ALL"]\nignore = ["SC10"]\n', 0),
    ('select = ["SC101"]\nignore = ["SC1"]\n', 1),     # the more specific code wins, as in ruff
    ('select = ["SC1"]\nignore = ["SC1"]\n', 0),       # equal specificity: ignore wins
])
def test_select_and_ignore_from_config(tmp_path, config, expected_rc):
    project(tmp_path, config)
    assert run(".", cwd=tmp_path).returncode == expected_rc


@pytest.mark.parametrize("config,cli,expected_rc", [
    ('ignore = ["SC101"]\n', ["--select", "SC101"], 1),    # --select replaces the config's selection
    ('select = ["SC103"]\n', ["--select", "SC1"], 1),
    ('select = ["SC1"]\n', ["--ignore", "SC101"], 0),      # a lone --ignore removes from it
    ('ignore = ["SC101"]\n', ["--ignore", "SC103"], 0),    # ... and keeps the config's ignore
])
def test_command_line_overrides_config(tmp_path, config, cli, expected_rc):
    project(tmp_path, config)
    assert run(*cli, ".", cwd=tmp_path).returncode == expected_rc


def test_exclude_and_extend_exclude(tmp_path):
    project(tmp_path, """\
        exclude = ["legacy/", "*_old.py"]
        extend-exclude = ["/scratch.py"]
    """, files=("train.py", "legacy/a.py", "legacy/deep/b.py", "src/train_old.py", "scratch.py",
                "src/scratch.py"))
    assert reported(run("--format", "json", ".", cwd=tmp_path)) == [
        ("src/scratch.py", "SC101"), ("train.py", "SC101")]   # "/scratch.py" is anchored to the config's folder
    # named files too: pre-commit names every file it checks
    proc = run("--format", "json", "legacy/a.py", "src/train_old.py", "train.py", cwd=tmp_path)
    assert reported(proc) == [("train.py", "SC101")]
    assert json.loads(proc.stdout)["files"] == 1


def test_per_file_ignores(tmp_path):
    project(tmp_path, """\
        [tool.synccheck.per-file-ignores]
        "tests/*" = ["SC101"]
        "examples/" = ["SC1"]
        "*_demo.py" = ["SC103", "SC101"]
        "scripts/keep.py" = ["SC103"]
    """, files=("train.py", "tests/t.py", "tests/sub/t.py", "examples/e.py", "a_demo.py", "scripts/keep.py"))
    assert reported(run("--format", "json", ".", cwd=tmp_path)) == [
        ("scripts/keep.py", "SC101"), ("train.py", "SC101")]


def test_config_is_found_upward_and_paths_are_relative_to_it(tmp_path):
    project(tmp_path, '[tool.synccheck.per-file-ignores]\n"pkg/skip.py" = ["SC101"]\n',
            files=("pkg/skip.py", "pkg/train.py"))
    sub = tmp_path / "pkg"
    # a nearer pyproject.toml without [tool.synccheck] is not ours: the search goes on upward (ruff does too)
    (sub / "pyproject.toml").write_text("[project]\nname = 'inner'\n")
    assert reported(run("--format", "json", ".", cwd=sub)) == [("train.py", "SC101")]
    assert reported(run("--format", "json", "--isolated", ".", cwd=sub)) == [
        ("skip.py", "SC101"), ("train.py", "SC101")]


def test_explicit_config_path(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "pyproject.toml").write_text('[tool.synccheck]\nignore = ["SC101"]\n')
    assert run(".", cwd=tmp_path).returncode == 1
    assert run("--config", "conf/pyproject.toml", ".", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("text,needles", [
    ("[tool.synccheck\nselect = 1\n", ["pyproject.toml", "invalid TOML"]),
    ('[tool.synccheck]\nselect = ["SC101"\n', ["pyproject.toml", "invalid TOML"]),
    ('[tool.synccheck]\nselect = ["SC999"]\n', ["pyproject.toml", "select", "'SC999'"]),
    ('[tool.synccheck]\nignore = ["XYZ"]\n', ["pyproject.toml", "ignore", "'XYZ'"]),
    ('[tool.synccheck]\nslect = ["SC101"]\n', ["pyproject.toml", "slect", "unknown key"]),
    ('[tool.synccheck]\nper_file_ignores = {}\n', ["per_file_ignores", "did you mean 'per-file-ignores'"]),
    ('[tool.synccheck]\nselect = "SC101"\n', ["pyproject.toml", "select", "list of strings"]),
    ('[tool.synccheck]\nexclude = [1]\n', ["exclude", "list of strings"]),
    ('[tool.synccheck.per-file-ignores]\n"tests/*" = ["SC9"]\n', ["per-file-ignores 'tests/*'", "'SC9'"]),
    ('[tool.synccheck.per-file-ignores]\n"tests/*" = "SC101"\n', ["per-file-ignores 'tests/*'", "list of strings"]),
    ("[tool]\nsynccheck = 3\n", ["pyproject.toml", "must be a table"]),
    ('[tool.synccheck]\nexclude = ["gen_[z-a].py"]\n', ["exclude", "invalid pattern"]),
    ('[tool.synccheck.per-file-ignores]\n"[z-a]" = ["SC101"]\n', ["per-file-ignores", "invalid pattern"]),
])
def test_configuration_mistakes_exit_2_one_line(tmp_path, text, needles):
    (tmp_path / "pyproject.toml").write_text(text)
    (tmp_path / "train.py").write_text(BAD_LOOP)
    proc = run(".", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    assert proc.stdout == ""


def test_missing_config_path_exit_2(tmp_path):
    proc = run("--config", "nope.toml", ".", cwd=tmp_path)
    assert proc.returncode == 2 and "nope.toml: no such file" in proc.stderr
    (tmp_path / "conf").mkdir()
    proc = run("--config", "conf", ".", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        f"synccheck lint: error: --config conf: a folder, not a file (pass {os.path.join('conf', 'pyproject.toml')})"


def test_pyproject_that_never_mentions_us_is_not_parsed(tmp_path):
    # someone else's broken pyproject.toml is not our configuration: lint as if there were none
    (tmp_path / "pyproject.toml").write_text("[project\nname = 'x'\n")
    (tmp_path / "train.py").write_text(BAD_LOOP)
    assert run(".", cwd=tmp_path).returncode == 1


def test_resolve_rules_layers():
    from synccheck.analyzer.config import Config, resolve_rules

    def codes(config, select=None, ignore=None):
        return [r.code for r in resolve_rules(config, select, ignore)]

    everything = codes(Config())
    assert "SC101" in everything and "SC000" in everything
    assert codes(Config(select=["SC101"])) == ["SC101"]
    assert "SC101" not in codes(Config(ignore=["SC101"]))
    assert codes(Config(ignore=["SC101"]), select=["SC101"]) == ["SC101"]
    assert codes(Config(select=["SC101", "SC103"]), ignore=["SC103"]) == ["SC101"]
    assert codes(Config(select=[])) == []


def test_exclude_matching_in_process(tmp_path):
    from synccheck.analyzer.config import Config

    config = Config(root=str(tmp_path), exclude=["build", "/data/", "gen_*.py"])
    assert config.is_excluded(str(tmp_path / "build"))
    assert config.is_excluded(str(tmp_path / "a" / "build" / "x.py"))
    assert config.is_excluded(str(tmp_path / "a" / "gen_1.py"))
    assert config.is_excluded(str(tmp_path / "data" / "x.py"))
    assert not config.is_excluded(str(tmp_path / "a" / "data" / "x.py"))     # anchored
    assert not config.is_excluded(str(tmp_path))                             # never the project itself
    assert not config.is_excluded(str(tmp_path / "train.py"))


def test_a_walk_from_the_current_folder_reports_plain_relative_paths(tmp_path):
    project(tmp_path, "", files=("train.py", "pkg/run.py"))
    proc = run("--format", "concise", ".", cwd=tmp_path)
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if "SC101" in line] == \
        ["pkg/run.py", "train.py"]
    proc = run("--format", "concise", "./pkg", cwd=tmp_path)
    assert proc.stdout.startswith("pkg/run.py:")
    proc = run("--format", "concise", "./train.py", cwd=tmp_path)    # a file named is reported as typed
    assert proc.stdout.startswith("./train.py:")

