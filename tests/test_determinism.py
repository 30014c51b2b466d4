"""The same files give the same findings whatever order Python's sets come in (string hashing is
randomised per process: PYTHONHASHSEED). A rule that hangs on the iteration order of a frozenset flips
from run to run, which a pre-commit hook shows as a finding that comes and goes."""
import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "patterns" / "446_optimizer_of_a_plain_module_beside_a_wrappers"


def _findings(seed: int) -> list:
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--isolated", "--no-cache", "--exit-zero",
                           "-j", "1", "--format", "json", str(FIXTURE)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return sorted((Path(f["path"]).name, f["line"], f["code"]) for f in json.loads(proc.stdout)["findings"])


def test_findings_do_not_depend_on_the_hash_seed():
    # seeds 2, 3, 4, 6 and 7 gave a false SC201 at line 33 when an optimizer's owners were read in
    # the frozenset's order (micro_step._owned stopped at the first one that owned no wrapper)
    runs = {seed: _findings(seed) for seed in range(8)}
    assert all(found == [("train.py", 40, "SC101")] for found in runs.values()), runs
