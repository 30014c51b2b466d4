"""The results cache: a warm run over an unchanged tree parses nothing, and an edit is seen."""
import os

from synccheck.analyzer.engine import lint

BAD = """from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(model)
for i, x in enumerate(loader):
    (model(x).sum() / 4).backward()
    if (i + 1) % 4 == 0:
        optimizer.step()
"""


def test_warm_run_parses_nothing_and_edits_are_seen(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"train{i}.py").write_text(BAD)
    (src / "util.py").write_text("x = 1\n")
    cache = str(tmp_path / "cache")
    cold = lint([str(src)], cache_dir=cache)
    assert cold.parsed == 3 and cold.cached == 0 and len(cold.findings) == 3
    warm = lint([str(src)], cache_dir=cache)
    assert warm.parsed == 0 and warm.cached == 4
    assert [(f.path, f.line, f.code) for f in warm.findings] == [(f.path, f.line, f.code) for f in cold.findings]
    # an edit that fixes one file is seen (same size, so only the content tells)
    fixed = BAD.replace("(model(x).sum() / 4).backward()", "(model(x).sum() / 4).backward()  # synccheck: ignore")
    (src / "train1.py").write_text(fixed)
    os.utime(src / "train1.py", ns=(1, 1))
    after = lint([str(src)], cache_dir=cache)
    assert after.parsed == 1 and len(after.findings) == 2


def test_corrupt_cache_is_ignored(tmp_path):
    (tmp_path / "train.py").write_text(BAD)
    cache = tmp_path / "cache"
    lint([str(tmp_path / "train.py")], cache_dir=str(cache))
    for dirpath, _, names in os.walk(cache):
        for name in names:
            if name.endswith(".json"):
                (open(os.path.join(dirpath, name), "w")).write("{not json")
    again = lint([str(tmp_path / "train.py")], cache_dir=str(cache))
    assert len(again.findings) == 1


def test_a_pipeline_that_only_marks_xla_steps_is_not_parsed(tmp_path):
    # ``xm.mark_step()`` in a sampling loop (every diffusers pipeline) is no trainer's step call: the
    # file cannot hold a finding and is left unparsed; a ``trainer.train_step(batch)`` loop is parsed
    (tmp_path / "pipe.py").write_text("import torch_xla.core.xla_model as xm\n\n"
                                      "def sample(unet, latents, timesteps):\n"
                                      "    for t in timesteps:\n        latents = unet(latents, t)\n"
                                      "        xm.mark_step()\n    return latents\n")
    (tmp_path / "drive.py").write_text("def run(trainer, loader):\n    for batch in loader:\n"
                                       "        trainer.train_step(batch)\n")
    result = lint([str(tmp_path)], jobs=1)
    assert result.parsed == 1 and not result.findings and not result.errors


def test_an_internal_error_costs_only_its_component(tmp_path, monkeypatch):
    # a bug of ours met while analysing one component is reported as that component not being
    # checked; the findings of the other components are still reported, and nothing is cached for it
    from synccheck.analyzer.project import program as program_module

    (tmp_path / "good.py").write_text(BAD)
    (tmp_path / "boom.py").write_text(BAD.replace("loader", "batches"))
    real = program_module.Program.flows

    def flows(self):
        if any(m.path.endswith("boom.py") for m in self.project.modules()):
            raise KeyError("injected")
        return real(self)

    monkeypatch.setattr(program_module.Program, "flows", flows)
    monkeypatch.delenv("SYNCCHECK_DEBUG", raising=False)
    cache = str(tmp_path / "cache")
    result = lint([str(tmp_path)], jobs=1, cache_dir=cache)
    assert [os.path.basename(f.path) for f in result.findings] == ["good.py"]
    assert len(result.errors) == 1 and result.errors[0].path.endswith("boom.py")
    assert "internal error KeyError" in result.errors[0].message
    monkeypatch.setattr(program_module.Program, "flows", real)
    again = lint([str(tmp_path)], jobs=1, cache_dir=cache)
    assert sorted(os.path.basename(f.path) for f in again.findings) == ["boom.py", "good.py"] and not again.errors


def test_an_edited_analyzer_does_not_reuse_results(tmp_path, monkeypatch):
    # an editable or git install changes the analyzer's files without a new version number: results
    # the old code computed must not be served to the new one
    from synccheck.analyzer import cache as cache_module
    code = tmp_path / "analyzer"
    code.mkdir()
    (code / "rules.py").write_text("RULES = 1\n")
    monkeypatch.setattr(cache_module, "ANALYZER_DIR", str(code))
    (tmp_path / "train.py").write_text(BAD)
    cache = str(tmp_path / "cache")
    assert lint([str(tmp_path / "train.py")], cache_dir=cache).parsed == 1
    assert lint([str(tmp_path / "train.py")], cache_dir=cache).parsed == 0
    (code / "rules.py").write_text("RULES = 22\n")
    assert lint([str(tmp_path / "train.py")], cache_dir=cache).parsed == 1
