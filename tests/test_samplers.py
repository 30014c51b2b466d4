"""SC302 where the DistributedSampler is made in a builder of another file: said where the linted
script takes the loader, and reseeded only by a set_epoch of the same program."""
from pathlib import Path

from projectlib import found, write_project

BUILDER = """
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler


    def build_loader(dataset, batch_size):
        sampler = DistributedSampler(dataset, shuffle=True)
        return DataLoader(dataset, sampler=sampler, batch_size=batch_size)
"""

# a script whose loader comes from the builder and is never reseeded
UNSEEDED = """
    import torch

    from data.builder import build_loader


    def main(model, dataset, val_dataset, optimizer, epochs):
        train_loader = build_loader(dataset, 32)
        val_loader = build_loader(val_dataset, 64)
        for epoch in range(epochs):
            for x, y in train_loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            evaluate(model, val_loader)
"""

# the same script that reseeds it through the loader
SEEDED = UNSEEDED.replace("            for x, y in train_loader:",
                          "            train_loader.sampler.set_epoch(epoch)\n            for x, y in train_loader:")


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.lstrip("\n").splitlines(), 1) if needle in line)


def test_builder_out_of_view_is_reported_where_the_script_takes_the_loader(tmp_path):
    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": UNSEEDED})
    # (only train.py linted, as a pre-commit hook does: the builder is context)
    got = found(root, [root / "train.py"])
    assert got == {("train.py", _line(UNSEEDED, "train_loader = build_loader"), "SC302")}


def test_a_script_that_reseeds_the_loader_it_takes_is_clean(tmp_path):
    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": SEEDED})
    assert found(root, [root / "train.py"]) == set()
    assert found(root) == set()


def test_a_shared_builder_reseeded_by_one_script_only(tmp_path):
    # train.py reseeds its loader; finetune.py takes one from the same builder and does not: the
    # other script's set_epoch does not reseed finetune's sampler
    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": SEEDED,
                                    "finetune.py": UNSEEDED})
    assert found(root) == {("finetune.py", _line(UNSEEDED, "train_loader = build_loader"), "SC302")}


def test_a_builder_called_by_one_script_is_reported_at_the_sampler_and_where_the_script_takes_it(tmp_path):
    # the folder linted: the builder's sampler, and the epoch loop where the fix (set_epoch) belongs
    # (ViT-pytorch's utils/data_utils.py and train.py)
    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": UNSEEDED})
    assert found(root) == {("data/builder.py", _line(BUILDER, "DistributedSampler(dataset"), "SC302"),
                           ("train.py", _line(UNSEEDED, "train_loader = build_loader"), "SC302")}


def test_the_fix_in_the_script_settles_the_builders_finding_too(tmp_path):
    # --fix on the folder reseeds the loader in train.py; what is left is read again from the files
    # as written, so the builder's finding (its sampler now reseeded) is gone too
    import contextlib
    import io

    from synccheck.analyzer.cli import lint_main

    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": UNSEEDED})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = lint_main(["--isolated", "--no-cache", "--fix", "--unsafe-fixes", str(root)])
    assert "set_epoch(epoch)" in (root / "train.py").read_text()
    assert rc == 0, out.getvalue()
    assert "Fixed 1 problem." in out.getvalue() and "All checks passed!" in out.getvalue()
    assert found(root) == set()


FIT = """
    import torch


    def fit(model, optimizer, train_loader, num_epoch):
        for epoch in range(0, num_epoch):
            for x, y in train_loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
"""

RUN = """
    from data.builder import build_loader
    from engine import fit


    def run(model, optimizer, dataset, config):
        train_loader = build_loader(dataset, config["batch_size"])
        fit(model, optimizer, train_loader, config["epochs"])
"""


def test_a_loop_handed_the_loader_is_told_at_its_epoch_loop(tmp_path):
    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "engine.py": FIT,
                                    "run.py": RUN})
    got = found(root, [root / "engine.py"])
    assert got == {("engine.py", _line(FIT, "for epoch in range"), "SC302")}


def test_the_fix_reseeds_the_loader_the_script_takes(tmp_path):
    from synccheck.analyzer.cli import lint_main

    root = write_project(tmp_path, {"data/__init__.py": "", "data/builder.py": BUILDER, "train.py": UNSEEDED})
    assert lint_main(["--isolated", "--no-cache", "-q", "--fix", "--unsafe-fixes", str(root / "train.py")]) == 0
    text = Path(root / "train.py").read_text()
    assert "train_loader.sampler.set_epoch(epoch)" in text
    assert found(root, [root / "train.py"]) == set()


SPLAT = """
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler


    def train(model, dataset, optimizer, epochs):
        sampler_args = {{"shuffle": {shuffle}, "drop_last": False}}
        sampler = DistributedSampler(dataset, **sampler_args)
        other = DistributedSampler(dataset, **{{"shuffle": {shuffle}}})
        for epoch in range(epochs):
            for x, y in DataLoader(dataset, sampler=sampler, batch_size=8):
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            for x, y in DataLoader(dataset, sampler=other, batch_size=8):
                pass
"""


def test_shuffle_off_through_a_keyword_dict_needs_no_set_epoch(tmp_path):
    # (mbzuai-oryx/groundingLMM: ``DistributedSampler(ds, **{"shuffle": False, ...})``)
    root = write_project(tmp_path / "off", {"train.py": SPLAT.format(shuffle=False)})
    assert found(root) == set()
    text = SPLAT.format(shuffle=True)
    root = write_project(tmp_path / "on", {"train.py": text})
    assert found(root) == {("train.py", _line(text, "sampler = DistributedSampler"), "SC302"),
                           ("train.py", _line(text, "other = DistributedSampler"), "SC302")}


LOADERS = """
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler


    def plain_loader(dataset):
        return DataLoader(dataset, batch_size=8, shuffle=True)


    def dist_loader(dataset):
        return DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset))
"""

BRANCHED = """
    import torch

    from loaders import dist_loader, plain_loader


    def train(model, dataset, optimizer, epochs, distributed):
        if not distributed:
            loader = plain_loader(dataset)
        else:
            loader = dist_loader(dataset)
        for epoch in range(epochs):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
"""


def test_the_binding_that_takes_the_distributed_loader_is_the_one_told(tmp_path):
    # (dennis9707/Post2Vec: the single-process loader is bound first, the distributed one in the else)
    root = write_project(tmp_path, {"loaders.py": LOADERS, "train.py": BRANCHED})
    assert found(root, [root / "train.py"]) == {("train.py", _line(BRANCHED, "loader = dist_loader"), "SC302")}


KEPT = """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler


    def build_loader(dataset):
        sampler = DistributedSampler(dataset, shuffle=True)
        pre_epoch = sampler.set_epoch
        return DataLoader(dataset, sampler=sampler, batch_size=8), pre_epoch


    def train(model, dataset, optimizer, epochs):
        loader, pre_epoch = build_loader(dataset)
        for epoch in range(epochs):
            {reseed}
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
"""


def test_a_bound_set_epoch_kept_to_call_later_reseeds(tmp_path):
    # (zd11024/NaviLLM: ``pre_epoch = sampler.set_epoch``, called by the loader wrapper each epoch)
    root = write_project(tmp_path / "kept", {"loaders.py": KEPT.format(reseed="pre_epoch(epoch)")})
    assert found(root) == set()


REBUILT = """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler


    def train(model, base_dataset, build, optimizer, epochs):
        for epoch in range(epochs):
            {data}
            loader = DataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=True), batch_size=8)
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
"""


def test_a_sampler_over_a_dataset_rebuilt_each_epoch(tmp_path):
    # (facebookresearch/coconut: the dataset is reshuffled as it is built, each epoch: no SC302)
    text = REBUILT.format(data="dataset = build(base_dataset, shuffle=True)")
    assert found(write_project(tmp_path / "rebuilt", {"train.py": text})) == set()
    # the same sampler made each epoch over the same data replays one order (Post2Vec), also when the
    # data is reloaded each epoch without a shuffle (albert's pregenerated files): SC302
    for name, data in (("same", "dataset = base_dataset"), ("reloaded", "dataset = build(base_dataset)")):
        text = REBUILT.format(data=data)
        assert found(write_project(tmp_path / name, {"train.py": text})) == {
            ("train.py", _line(text, "DistributedSampler(dataset"), "SC302")}


MAIN_BUILDS = """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from engine import fit


    def main(model, optimizer, dataset, config):
        train_sampler = DistributedSampler(dataset, shuffle=True)
        train_loader = DataLoader(dataset, sampler=train_sampler, batch_size=32)
        fit(DDP(model), optimizer, train_loader, config["epochs"])
"""


def test_a_script_built_sampler_is_also_told_at_the_epoch_loop_it_is_handed_to(tmp_path):
    # MPCoder: main.py builds the sampler and its loader, train_utils.train loops over the epochs
    root = write_project(tmp_path, {"main.py": MAIN_BUILDS, "engine.py": FIT})
    assert found(root) == {("main.py", _line(MAIN_BUILDS, "DistributedSampler(dataset"), "SC302"),
                           ("engine.py", _line(FIT, "for epoch in range"), "SC302")}
