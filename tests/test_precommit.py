"""The pre-commit hook, installed by the real `pre-commit` into a throwaway repository.

pre-commit clones the hook repository at a commit and pip-installs it into its own virtual environment,
so this tests the checkout's committed HEAD (commit before running it), and it needs the package index
for the build requirements: without it the test is skipped, saying so.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lintlib import BAD_LOOP

ROOT = Path(__file__).resolve().parents[1]
GOOD = BAD_LOOP.replace("    loss = model(x).sum() / 4\n    loss.backward()\n",
                   "    with model.no_sync() if (i + 1) % 4 else nullcontext():\n"
                   "        loss = model(x).sum() / 4\n        loss.backward()\n")
# what pip says when it cannot reach an index; anything else is a real failure
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Failed to establish a new connection", "Could not fetch URL", "ProxyError",
           "No matching distribution found for setuptools", "Read timed out")


def _git(*args, cwd, env=None):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    pytest.importorskip("pre_commit", reason="pre-commit is in the test extra: pip install -e '.[test]'")
    head = _git("rev-parse", "HEAD", cwd=ROOT)
    if head.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout with a commit")
    if _git("cat-file", "-e", "HEAD:.pre-commit-hooks.yaml", cwd=ROOT).returncode != 0:
        pytest.skip("the checkout's HEAD has no .pre-commit-hooks.yaml yet (commit it first)")
    base = tmp_path_factory.mktemp("precommit")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(PRE_COMMIT_HOME=str(base / "home"), PRE_COMMIT_COLOR="never", SYNCCHECK_CACHE_DIR=str(base / "cache"))
    repo = base / "repo"
    repo.mkdir()
    assert _git("init", "-q", cwd=repo, env=env).returncode == 0
    (repo / ".pre-commit-config.yaml").write_text(
        f"repos:\n- repo: {ROOT}\n  rev: {head.stdout.strip()}\n  hooks:\n  - id: synccheck\n")
    (repo / "bad.py").write_text(BAD_LOOP)
    (repo / "good.py").write_text(GOOD)
    assert _git("add", ".", cwd=repo, env=env).returncode == 0
    install = subprocess.run([sys.executable, "-m", "pre_commit", "install-hooks"], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=240)
    if install.returncode != 0:
        log = install.stdout + install.stderr
        home_log = base / "home" / "pre-commit.log"
        if home_log.exists():
            log += home_log.read_text(errors="replace")
        offline = next((m for m in OFFLINE if m in log), None)
        if offline:
            pytest.skip(f"pre-commit could not pip-install the hook (package index unreachable: {offline})")
        pytest.fail(f"pre-commit install-hooks failed:\n{log[-4000:]}")
    return repo, env


def _run(hook_repo, *files):
    repo, env = hook_repo
    return subprocess.run([sys.executable, "-m", "pre_commit", "run", "synccheck", "--files", *files],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_hook_fails_a_bad_script(hook_repo):
    proc = _run(hook_repo, "bad.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Failed" in proc.stdout and "SC101" in proc.stdout and "bad.py:5:5" in proc.stdout


def test_hook_passes_a_good_script(hook_repo):
    proc = _run(hook_repo, "good.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Passed" in proc.stdout
