"""The same code gives the same findings on every run: nothing in the analysis may depend on the order
in which Python happens to iterate a set of strings (it changes with PYTHONHASHSEED, run to run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def _lint(seed: str, *paths) -> list:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--isolated", "--no-cache", "--exit-zero",
                           "--format", "json", *map(str, paths)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return sorted((f["path"], f["line"], f["column"], f["code"], f["message"]) for f in json.loads(proc.stdout)["findings"])


def test_findings_do_not_depend_on_the_hash_seed():
    targets = [FIXTURES / "patterns", FIXTURES / "realistic"]
    runs = [_lint(seed, *targets) for seed in ("0", "3", "4", "12345")]
    assert runs[0], "the fixtures have findings"
    for other in runs[1:]:
        assert other == runs[0]
