"""`synccheck lint -q/--quiet`, `-s/--silent` and `--output-file PATH`, as ruff has them: the findings
only, nothing at all, or the report in a file; the exit codes do not change."""
import json
import os
import stat
import subprocess
import sys

import pytest

from lintlib import BAD_LOOP


class Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run(capsys, monkeypatch):
    """`synccheck lint --no-cache ARGS` in this process (the real entry point, ~50 times faster than a
    subprocess); the unwritable-path test below runs the command for real."""
    from synccheck.cli import main

    monkeypatch.setenv("COLUMNS", "200")

    def lint(*args, cwd):
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main(["lint", "--no-cache", *args])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err, err
        return Run(code, out, err)
    return lint


@pytest.fixture
def project(tmp_path):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    (tmp_path / "clean.py").write_text("print('hello')\n")
    return tmp_path


@pytest.mark.parametrize("fmt", ["full", "concise"])
def test_quiet_prints_the_findings_without_the_summary(run, project, fmt):
    loud = run("--format", fmt, "train.py", cwd=project)
    quiet = run("--format", fmt, "-q", "train.py", cwd=project)
    assert loud.returncode == quiet.returncode == 1
    assert "Found 1 problem" in loud.stdout and "Found" not in quiet.stdout
    assert "train.py:5:5: SC101" in quiet.stdout
    # everything but the summary (the "Found" line and ruff's "[*] N fixable with --fix") is the same
    summary = [line for line in loud.stdout.strip().splitlines()[-2:] if line.startswith(("Found", "[*] "))]
    assert len(summary) == 2
    assert quiet.stdout.strip() == loud.stdout.strip()[:-len("\n".join(summary))].strip()


def test_quiet_on_clean_code_prints_nothing(run, project):
    proc = run("--quiet", "clean.py", cwd=project)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    empty = project / "empty"
    empty.mkdir()
    proc = run("-q", "empty", cwd=project)        # not even the "no Python files" warning
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    proc = run("--statistics", "-q", "train.py", cwd=project)
    assert proc.returncode == 1 and proc.stdout.split() == ["1", "SC101", "sync-every-microstep"]
    proc = run("--statistics", "-s", "-o", "stats.txt", "train.py", cwd=project)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")
    assert (project / "stats.txt").read_text().split() == ["1", "SC101", "sync-every-microstep"]
    proc = run("--statistics", "-s", "--format", "json", "-o", "stats.json", "train.py", cwd=project)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")          # no counts on stderr either
    assert json.loads((project / "stats.json").read_text())["findings"][0]["code"] == "SC101"


@pytest.mark.parametrize("flag", ["--silent", "-s", "-qq"])
def test_silent_prints_nothing_and_keeps_the_exit_code(run, project, flag):
    proc = run(flag, "train.py", cwd=project)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")
    proc = run(flag, "clean.py", cwd=project)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


@pytest.mark.parametrize("fmt", ["full", "concise", "json", "sarif", "github"])
def test_output_file_holds_what_stdout_would(run, project, fmt):
    expected = run("--format", fmt, "train.py", cwd=project)
    proc = run("--format", fmt, "--output-file", "report.out", "train.py", cwd=project)
    assert proc.returncode == expected.returncode == 1
    assert proc.stdout == "" and proc.stderr == ""
    assert (project / "report.out").read_text() == expected.stdout
    if fmt == "json":
        assert json.loads((project / "report.out").read_text())["findings"][0]["code"] == "SC101"
    # -q and -s change what goes into the file the same way as on stdout; the exit code stays
    proc = run("--format", fmt, "-o", "quiet.out", "-q", "train.py", cwd=project)
    assert proc.returncode == 1 and (project / "quiet.out").read_text() == run("--format", fmt, "-q", "train.py",
                                                                              cwd=project).stdout
    proc = run("--format", fmt, "-o", "silent.out", "-s", "train.py", cwd=project)
    assert proc.returncode == 1 and proc.stdout == "" and (project / "silent.out").read_text() == (
        project / "quiet.out").read_text()


@pytest.mark.parametrize("target,needle", [
    ("missing/report.txt", "folder"),       # the folder does not exist
    (".", "it is a folder"),
    ("clean.py/report.txt", "report.txt"),  # the "folder" is a file
    ("/proc/synccheck-report.txt", "/proc/synccheck-report.txt"),   # root passes the mode bits here
])
def test_an_unwritable_output_file_is_one_line_and_exit_2_before_any_work(project, target, needle):
    if target.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    cache = project / "cache"
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--cache-dir", str(cache), "-o", target,
                           "train.py"], capture_output=True, text=True, cwd=project)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("synccheck lint: error: cannot write --output-file ") and needle in line
    assert not cache.exists()              # nothing was linted


def test_output_file_replaces_only_a_complete_report_and_keeps_links_and_modes(run, project):
    report = project / "report.txt"
    report.write_text("the previous report\n")
    os.chmod(report, 0o640)
    proc = run("-o", "report.txt", "--select", "SC999", "train.py", cwd=project)    # a usage error
    assert proc.returncode == 2 and report.read_text() == "the previous report\n"
    link = project / "latest.txt"
    link.symlink_to(report.name)
    proc = run("-o", "latest.txt", "train.py", cwd=project)
    assert proc.returncode == 1
    assert link.is_symlink() and "SC101" in report.read_text()      # written through the link
    assert stat.S_IMODE(report.stat().st_mode) == 0o640
    assert [p.name for p in project.iterdir() if p.name.endswith(".tmp")] == []
