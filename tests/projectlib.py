"""Write a small project to a folder and lint it, as a user would: ``synccheck lint DIR``.

Files say what they expect inline, as the fixtures do: a line ending with ``# SC101`` must be reported
with that code, and nothing else may be.
"""
import textwrap
from pathlib import Path

from synccheck.analyzer.engine import lint
from synccheck.analyzer.rules import Rule


def write_project(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def expected(root: Path, files: dict, paths=None) -> set:
    """The markers of the linted files (``paths``: only those; a finding is said in a linted file)."""
    out = set()
    linted = [Path(root, p).resolve().relative_to(root.resolve()).as_posix() for p in paths] if paths else files
    for name in linted:
        text = (root / name).read_text()
        for line, code in Rule.expected_lines(text):
            out.add((name, line, code))
    return out


def found(root: Path, paths=None, **kwargs) -> set:
    result = lint([str(p) for p in (paths or [root])], jobs=1, **kwargs)
    assert not result.errors, result.errors
    out = set()
    for f in result.findings:
        out.add((Path(f.path).resolve().relative_to(root.resolve()).as_posix(), f.line, f.code))
    return out


def check_project(root: Path, files: dict, paths=None) -> set:
    write_project(root, files)
    got = found(root, [root / p for p in paths] if paths else None)
    want = expected(root, files, paths)
    assert got == want, f"expected {sorted(want)}, got {sorted(got)}"
    return got
