"""Folder walks honour .gitignore as git does; files named on the command line are always checked."""
import json
import os
import subprocess
import sys

import pytest

from synccheck.analyzer.files import IgnorePatterns, discover

LOOP = "for x in loader:\n    loss.backward()\n"


def matches(patterns, rel, is_dir=False, base="/r"):
    return IgnorePatterns(base, patterns).match(base + "/" + rel, is_dir)


@pytest.mark.parametrize("patterns,rel,is_dir,expected", [
    (["*.log"], "a/b/x.log", False, True),                 # no slash: a name at any depth
    (["build"], "src/build", True, True),
    (["build/"], "src/build", False, None),                # folders only
    (["build/"], "src/build", True, True),
    (["/top.py"], "top.py", False, True),                  # anchored
    (["/top.py"], "sub/top.py", False, None),
    (["doc/frotz"], "doc/frotz", True, True),              # a middle slash anchors too
    (["doc/frotz"], "a/doc/frotz", True, None),
    (["**/logs"], "a/b/logs", True, True),
    (["**/logs"], "logs", True, True),
    (["a/**/b"], "a/b", True, True),
    (["a/**/b"], "a/x/y/b", True, True),
    (["a/**"], "a/x/y.py", False, True),
    (["a/**"], "a", True, None),
    (["*.py", "!keep.py"], "keep.py", False, False),       # negation: last match wins
    (["!keep.py", "*.py"], "keep.py", False, True),
    (["gen_?.py"], "gen_1.py", False, True),
    (["gen_?.py"], "gen_10.py", False, None),
    (["gen_[0-9].py"], "gen_7.py", False, True),
    (["gen_[!0-9].py"], "gen_7.py", False, None),
    (["*.py"], "a/b.py", False, True),
    (["a/*.py"], "a/b/c.py", False, None),                 # "*" stays within one folder
    (["# comment", "", "  "], "x.py", False, None),
    (["\\#hash.py"], "#hash.py", False, True),
    (["\\!bang.py"], "!bang.py", False, True),
    (["trailing.py   "], "trailing.py", False, True),
    (["gen_[z-a].py", "*.txt"], "gen_b.py", False, None),    # a pattern git cannot match is skipped
    (["[unclosed.py"], "[unclosed.py", False, True),
])
def test_gitignore_patterns(patterns, rel, is_dir, expected):
    assert matches(patterns, rel, is_dir) is expected


def tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def names(found, root):
    return sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in found)


def test_walk_honours_nested_gitignores(tmp_path):
    (tmp_path / ".git").mkdir()
    tree(tmp_path, {
        ".gitignore": "build_out/\n*.gen.py\n!keep.gen.py\n/top_only.py\n",
        "train.py": LOOP, "keep.gen.py": LOOP, "x.gen.py": LOOP, "top_only.py": LOOP,
        "build_out/a.py": LOOP, "sub/top_only.py": LOOP,
        "sub/.gitignore": "!x.gen.py\nlocal.py\n",
        "sub/x.gen.py": LOOP, "sub/local.py": LOOP, "local.py": LOOP,
        "sub/deep/local.py": LOOP,
    })
    assert names(discover([str(tmp_path)]), tmp_path) == [
        "keep.gen.py", "local.py", "sub/top_only.py", "sub/x.gen.py", "train.py"]
    # off: everything
    assert len(discover([str(tmp_path)], respect_gitignore=False)) == 10


def test_walk_from_a_subfolder_uses_the_parents_gitignore_up_to_the_repo_root(tmp_path):
    tree(tmp_path, {".gitignore": "*.py\n"})            # above the repository: not this project's
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    tree(repo, {".gitignore": "skip_me.py\n", "pkg/skip_me.py": LOOP, "pkg/train.py": LOOP})
    assert names(discover([str(repo / "pkg")]), repo) == ["pkg/train.py"]
    # outside any git repository only the walked folder's own .gitignore files count
    plain = tmp_path / "plain"
    tree(plain, {".gitignore": "ignored.py\n", "ignored.py": LOOP, "train.py": LOOP})
    assert names(discover([str(plain)]), plain) == ["train.py"]


def test_cli_walk_skips_gitignored_but_named_files_are_checked(tmp_path):
    (tmp_path / ".git").mkdir()
    bad = ("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)\n"
           "for i, (x, y) in enumerate(loader):\n    loss = model(x).sum() / 4\n    loss.backward()\n"
           "    if (i + 1) % 4 == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n")
    tree(tmp_path, {".gitignore": "generated/\n", "generated/train.py": bad, "ok.py": "print(1)\n",
                    ".venv2/pyvenv.cfg": "", ".venv2/lib/train.py": bad})
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", "--format", "json", "."],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["files"] == 1
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", "generated/train.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "SC101" in proc.stdout


def test_a_file_reached_twice_through_links_is_linted_once(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("x = 1\n")
    os.symlink(str(tmp_path / "pkg" / "train.py"), str(tmp_path / "alias.py"))   # a file link
    os.symlink(str(tmp_path / "pkg"), str(tmp_path / "also"))                     # a folder link
    found = discover([str(tmp_path), str(tmp_path / "also")])
    assert len(found) == 1, found
