"""`synccheck lint --fix`: each rule's example is fixed, the result lints clean, fixing twice changes
nothing, and bad input (CRLF, latin-1, BOM, read-only, changed on disk, overlaps) loses nothing."""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from synccheck.analyzer.engine import check_source
from synccheck.analyzer.fix.apply import FixOptions, fix_result, fix_text
from synccheck.analyzer.fix.check import Overlap, apply_edits, verdict
from synccheck.analyzer.ftypes import LintResult
from synccheck.analyzer.rules import ALL_RULES, BY_CODE

from lintlib import BAD_LOOP

ALL = FixOptions(unsafe=True)
FIXABLE = ("SC101", "SC102", "SC103", "SC105", "SC201", "SC202", "SC302")


def run(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "synccheck", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "SYNCCHECK_DEBUG": ""})
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def examples():
    for rule in ALL_RULES:
        for i, source in enumerate(rule.INVALID):
            yield pytest.param(rule.code, textwrap.dedent(source), id=f"{rule.code}-{i}")


@pytest.mark.parametrize("code,source", list(examples()))
def test_every_offered_fix_lints_clean_and_is_idempotent(code, source, tmp_path):
    path = str(tmp_path / "train.py")
    found = [f for f in check_source(source, path) if f.code == code]
    assert found
    offered = [f for f in found if f.autofix and f.autofix.get("edits")]
    if code not in FIXABLE:
        assert not offered
        return
    for f in found:
        assert f.autofix, "a fixable rule either offers a fix or says why not"
        assert offered or f.autofix["reason"]
    if not offered:
        return
    new, fixed, left = fix_text(path, source, list(ALL_RULES), ALL)
    assert fixed and new != source
    compile(new, path, "exec")
    assert not [f for f in check_source(new, path) if f.code == code]
    again, fixed_again, _ = fix_text(path, new, list(ALL_RULES), ALL)
    assert again == new and not fixed_again


def test_ddp_flat_loop_fix_uses_the_loops_own_gate():
    new, fixed, left = fix_text("t.py", BAD_LOOP, list(ALL_RULES), FixOptions())
    assert "with (contextlib.nullcontext() if (i + 1) % 4 == 0 else model.no_sync()):" in new
    assert new.count("import contextlib") == 1 and not left


def test_a_chosen_context_callable_gets_the_steps_condition():
    # ``ctx = model.no_sync if step % gas else nullcontext`` then ``with ctx():``: the choice is fixed in
    # place (callables stay callables), not wrapped in a second context
    source = textwrap.dedent("""
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        for step, (x, y) in enumerate(loader):
            ctx = model.no_sync if step % gas else contextlib.nullcontext
            with ctx():
                (loss_fn(model(x), y) / gas).backward()
            if (step + 1) % gas == 0:
                optimizer.step()
                optimizer.zero_grad()
    """)
    assert [f.code for f in check_source(source, "t.py")] == ["SC103"]
    new, fixed, left = fix_text("t.py", source, list(ALL_RULES), ALL)
    assert "    ctx = contextlib.nullcontext if (step + 1) % gas == 0 else model.no_sync\n" in new
    assert new.count("with ") == 1 and fixed and not check_source(new, "t.py")


def test_inner_micro_step_loop_sets_the_flag_before_the_forward():
    source = textwrap.dedent(BY_CODE["SC101"].INVALID[3])
    new, fixed, _ = fix_text("t.py", source, list(ALL_RULES), FixOptions())
    lines = new.splitlines()
    flag = lines.index("        model.require_backward_grad_sync = (micro_step == grad_accum - 1)")
    assert lines[flag + 1].strip() == "logits, loss = model(X, Y)"


def test_existing_nullcontext_import_is_reused_and_comments_kept():
    source = ("from contextlib import nullcontext as nc\n"
              "from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "model = DDP(model)\n"
              "for i, (x, y) in enumerate(loader):\n"
              "    # the forward\n"
              "    loss = model(x).sum() / 4  # divided\n"
              "    loss.backward()\n"
              "    if (i + 1) % 4 == 0:\n"
              "        optimizer.step()\n"
              "        optimizer.zero_grad()\n")
    new, fixed, _ = fix_text("t.py", source, list(ALL_RULES), FixOptions())
    assert "import contextlib" not in new and "with (nc() if (i + 1) % 4 == 0 else model.no_sync()):" in new
    assert "    # the forward\n    with" in new and "loss = model(x).sum() / 4  # divided" in new


def test_unknown_boundary_offers_no_fix_and_says_why():
    source = BAD_LOOP.replace("if (i + 1) % 4 == 0:", "if should_step(i):")
    (f,) = check_source(source, "t.py")
    assert "edits" not in f.autofix and "calls a function" in f.autofix["reason"]


def test_verdict_refuses_code_that_does_not_parse_or_adds_a_finding():
    rules = list(ALL_RULES)
    why, _ = verdict("t.py", BAD_LOOP, BAD_LOOP + "def (:\n", [], rules)
    assert "would not parse" in why
    clean = "print('hi')\n"
    why, _ = verdict("t.py", clean, BAD_LOOP, [], rules)
    assert why == "the fix would add 1 SC101 finding"


def test_overlapping_edits_are_refused_by_the_applier():
    e = {"content": "x\n", "location": {"row": 1, "column": 1}, "end_location": {"row": 3, "column": 1}}
    f = {"content": "y\n", "location": {"row": 2, "column": 1}, "end_location": {"row": 2, "column": 1}}
    with pytest.raises(Overlap):
        apply_edits("a\nb\nc\n", [e, f])


def test_two_fixes_on_the_same_lines_both_land_in_rounds():
    # SC101 wraps the backward's line and SC202 rewrites it: they overlap, so one goes first
    source = BAD_LOOP.replace(".sum() / 4", ".sum()")
    found = {f.code for f in check_source(source, "t.py")}
    assert found == {"SC101", "SC202"}
    new, fixed, left = fix_text("t.py", source, list(ALL_RULES), ALL)
    assert {f.code for f in fixed} == {"SC101", "SC202"} and not left
    assert "(loss / 4).backward()" in new


def cli_files(tmp_path, text=BAD_LOOP, name="train.py", data=None):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    else:
        path.write_text(text)
    return path


def test_cli_fix_writes_and_reports(tmp_path):
    path = cli_files(tmp_path)
    proc = run("lint", "--no-cache", "--fix", str(tmp_path))
    assert proc.returncode == 0, proc.stdout
    assert "Fixed 1 problem." in proc.stdout and "All checks passed!" in proc.stdout
    assert "model.no_sync()" in path.read_text()
    assert run("lint", "--no-cache", str(tmp_path)).returncode == 0


def test_cli_diff_writes_nothing_and_exits_1(tmp_path):
    path = cli_files(tmp_path)
    proc = run("lint", "--no-cache", "--diff", str(tmp_path))
    assert proc.returncode == 1 and proc.stdout.startswith("---") and "+    with (" in proc.stdout
    assert "Would fix 1 problem." in proc.stderr
    assert path.read_text() == BAD_LOOP
    path.write_text("print('hi')\n")
    assert run("lint", "--no-cache", "--diff", str(tmp_path)).returncode == 0


def test_cli_unsafe_fixes_are_hidden_unless_asked(tmp_path):
    source = textwrap.dedent(BY_CODE["SC201"].INVALID[0])
    path = cli_files(tmp_path, source)
    proc = run("lint", "--no-cache", str(tmp_path))
    assert "No fixes available (1 hidden fix can be enabled with --unsafe-fixes)." in proc.stdout
    proc = run("lint", "--no-cache", "--fix", str(tmp_path))
    assert proc.returncode == 1 and path.read_text() == source
    proc = run("lint", "--no-cache", "--fix-only", "--unsafe-fixes", str(tmp_path))
    assert proc.returncode == 0 and "Fixed 1 problem." in proc.stdout and path.read_text() != source


def test_config_keys_fix_unsafe_fixes_fixable_unfixable(tmp_path):
    path = cli_files(tmp_path, BAD_LOOP.replace(".sum() / 4", ".sum()"))
    (tmp_path / "pyproject.toml").write_text('[tool.synccheck]\nfix = true\nunsafe-fixes = true\n'
                                             'unfixable = ["SC101"]\n')
    proc = run("lint", "--no-cache", ".", cwd=tmp_path)
    text = path.read_text()
    assert "(loss / 4).backward()" in text and "no_sync" not in text
    assert proc.returncode == 1 and "SC101" in proc.stdout
    (tmp_path / "pyproject.toml").write_text('[tool.synccheck]\nfixable = ["SC2"]\nfix = "yes"\n')
    proc = run("lint", "--no-cache", ".", cwd=tmp_path)
    assert proc.returncode == 2 and "fix: expected true or false" in proc.stderr


def test_json_carries_ruff_shaped_fix_objects(tmp_path):
    cli_files(tmp_path, BAD_LOOP.replace(".sum() / 4", ".sum()"))
    data = json.loads(run("lint", "--no-cache", "--format", "json", str(tmp_path)).stdout)
    fixes = {f["code"]: f["fix"] for f in data["findings"]}
    assert fixes["SC101"]["applicability"] == "safe" and fixes["SC202"]["applicability"] == "unsafe"
    for edit in fixes["SC101"]["edits"]:
        assert set(edit["location"]) == set(edit["end_location"]) == {"row", "column"}


@pytest.mark.parametrize("encoding,prefix,newline", [
    ("utf-8", b"", "\r\n"),
    ("latin-1", b"# -*- coding: latin-1 -*-\n# caf\xe9\n", "\n"),
    ("utf-8-sig", b"", "\n"),
])
def test_encoding_bom_and_line_endings_are_kept(tmp_path, encoding, prefix, newline):
    body = BAD_LOOP.replace("\n", newline).encode(encoding)
    if encoding == "latin-1":
        body = prefix + BAD_LOOP.encode("latin-1")
    path = cli_files(tmp_path, data=body)
    assert run("lint", "--no-cache", "--fix", str(tmp_path)).returncode == 0
    data = path.read_bytes()
    if encoding == "utf-8-sig":
        assert data.startswith(b"\xef\xbb\xbf") and data.count(b"\xef\xbb\xbf") == 1
    if newline == "\r\n":
        assert data.count(b"\r\n") == data.count(b"\n")
    if encoding == "latin-1":
        assert data.startswith(prefix) and b"caf\xe9" in data
    assert b"no_sync()" in data


def test_read_only_file_is_reported_and_untouched(tmp_path):
    path = cli_files(tmp_path)
    path.chmod(stat.S_IRUSR)
    proc = run("lint", "--no-cache", "--fix", str(tmp_path))
    assert proc.returncode == 1 and "read-only" in proc.stdout and path.read_text() == BAD_LOOP
    # the finding the fix could not write is still reported, saying why it was not fixed
    assert "SC101" in proc.stdout and "fix not applied: the file is read-only" in proc.stdout
    assert "Fixed" not in proc.stdout and "1 problem" in proc.stdout


def test_file_changed_on_disk_before_writing_is_not_overwritten(tmp_path):
    from synccheck.analyzer.engine import lint

    path = cli_files(tmp_path)
    result = lint([str(tmp_path)], cache_dir=None)
    result.fixed = 0
    edited = BAD_LOOP + "# edited meanwhile\n"
    fix_result(result, list(ALL_RULES), FixOptions(), before_write=lambda p: path.write_text(edited))
    assert path.read_text() == edited and result.fixed == 0
    assert any("changed on disk" in e.message for e in result.errors)


def test_notebook_is_fixed_cell_by_cell(tmp_path):
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": ["%pip install torch\n", "from torch.nn.parallel import DistributedDataParallel as DDP\n",
                         "model = DDP(model)"]},
             {"cell_type": "markdown", "metadata": {}, "source": "# train"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": BAD_LOOP.split("model = DDP(model)\n")[1].splitlines(keepends=True)}]
    doc = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "train.ipynb"
    path.write_text(json.dumps(doc, indent=1))
    proc = run("lint", "--no-cache", "--fix", str(tmp_path))
    assert proc.returncode == 0, proc.stdout
    fixed = json.loads(path.read_text())
    first, train = "".join(fixed["cells"][0]["source"]), "".join(fixed["cells"][2]["source"])
    assert first.startswith("%pip install torch\nimport contextlib\n")
    assert "with (contextlib.nullcontext() if (i + 1) % 4 == 0 else model.no_sync()):" in train
    assert fixed["cells"][1] == cells[1]
    assert run("lint", "--no-cache", str(tmp_path)).returncode == 0


CONDITIONAL = BAD_LOOP.replace("model = DDP(model)\n", "if rank != -1:\n    model = DDP(model)\n")


@pytest.mark.parametrize("source,guarded", [
    (BAD_LOOP, False),
    (CONDITIONAL, True),
    (BAD_LOOP.replace("model = DDP(model)", "model = DDP(model) if distributed else model"), True),
    (BAD_LOOP.replace("model = DDP(model)\n", "try:\n    model = DDP(model)\nexcept RuntimeError:\n    pass\n"), True),
    (BAD_LOOP.replace("model = DDP(model)\n", "try:\n    pass\nfinally:\n    model = DDP(model)\n"), False),
])
def test_a_model_not_wrapped_on_every_path_gets_a_guarded_no_sync(source, guarded):
    new, fixed, left = fix_text("t.py", source, list(ALL_RULES), FixOptions())
    assert [f.code for f in fixed] == ["SC101"] and not left
    assert ('or not hasattr(model, "no_sync") else model.no_sync()' in new) == guarded
    # run the micro-steps with a plain module on the unwrapped path: no AttributeError
    if guarded:
        class Plain:
            def __call__(self, x):
                return self

            def sum(self):
                return self

            def __truediv__(self, n):
                return self

            def backward(self):
                pass

        class Optimizer:
            steps = 0

            def step(self):
                Optimizer.steps += 1

            def zero_grad(self):
                pass

        def unavailable(module):
            raise RuntimeError("no process group")

        body = new.split("\n", 1)[1] if new.startswith("import contextlib") else new
        exec(compile("import contextlib\n" + body.replace("from torch.nn.parallel import DistributedDataParallel as DDP\n", ""),
                     "t.py", "exec"),
             {"rank": -1, "distributed": False, "model": Plain(), "DDP": unavailable, "loader": [(1, 2)] * 8,
              "optimizer": Optimizer()})
        assert Optimizer.steps == 2


def test_static_graph_ddp_is_not_rewritten():
    source = BAD_LOOP.replace("DDP(model)", "DDP(model, static_graph=True)")
    (f,) = [f for f in check_source(source, "t.py") if f.code == "SC101"]
    assert "static_graph" in f.autofix["reason"] and "edits" not in f.autofix
    new, fixed, _ = fix_text("t.py", source, list(ALL_RULES), ALL)
    assert new == source and not fixed
    (g,) = check_source(source.replace("static_graph=True", "static_graph=False"), "t.py")
    assert g.autofix.get("edits")


def test_rule_docs_have_fix_safety():
    for rule in ALL_RULES:
        assert "## Fix safety" in rule.documentation()


def _offers(findings) -> list:
    return sorted((os.path.relpath(f.path), f.line, f.code, f.autofix.get("applicability"))
                  for f in findings if f.autofix and (f.autofix.get("edits") or f.autofix.get("deferred")))


def test_a_plain_lint_knows_the_fixes_without_building_them():
    from synccheck.analyzer.engine import lint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [os.path.join(root, "examples"), os.path.join(root, "tests", "fixtures")]
    eager = lint(paths, jobs=1)
    lazy = lint(paths, jobs=1, edits=False)
    assert [f._replace(autofix=None) for f in lazy.findings] == [f._replace(autofix=None) for f in eager.findings]
    offered = _offers(eager.findings)
    assert len(offered) >= 40 and _offers(lazy.findings) == offered
    for f in lazy.findings:
        assert not (f.autofix or {}).get("edits") or f.path.endswith(".ipynb")
    # nothing of libcst was even imported: the rewrite is what a plain lint saves
    probe = ("import sys; from synccheck.analyzer.engine import lint; "
             f"r = lint({paths!r}, jobs=1, edits=False); "
             "print(sum(1 for f in r.findings if f.autofix and f.autofix.get('deferred')), 'libcst' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(offered)), "False"]


def test_fixable_count_is_what_fix_unsafe_fixes_fixes(tmp_path):
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the lint fixtures add findings with no fix (the forward in another method, SC104, SC301...)
    for folder in ("examples", os.path.join("tests", "fixtures", "fixable"), os.path.join("tests", "fixtures", "lint")):
        shutil.copytree(os.path.join(root, folder), tmp_path / os.path.basename(folder))
    summary = run("lint", "--no-cache", "--unsafe-fixes", ".", cwd=tmp_path).stdout
    (count,) = [int(line.split()[1]) for line in summary.splitlines() if line.startswith("[*] ")
                and line.endswith("fixable with --fix")]
    data = json.loads(run("lint", "--no-cache", "--format", "json", ".", cwd=tmp_path).stdout)
    assert count == sum(1 for f in data["findings"] if f["fix"]["edits"])
    assert len(data["findings"]) > count + 5
    fixed = run("lint", "--no-cache", "--fix", "--unsafe-fixes", ".", cwd=tmp_path)
    assert f"Fixed {count} problems." in fixed.stdout, fixed.stdout
