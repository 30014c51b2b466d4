"""Whole-program analysis: the training loop spread over functions, classes and files, as real code
spreads it. Each case is a small project written to a folder and linted as a user would lint it."""
import os
import textwrap

import pytest

from pathlib import Path

from projectlib import check_project, expected, found, write_project

# main.py wraps the model, engine.py accumulates (MAE, DeiT, ConvNeXt, BEiT are built like this)
MAE = {
    "main_pretrain.py": """
        import torch
        from torch.nn.parallel import DistributedDataParallel
        from engine_pretrain import train_one_epoch
        import util.misc as misc
        from util.misc import NativeScalerWithGradNormCount as NativeScaler

        def main(args):
            model = build_model(args)
            model.to("cuda")
            model_without_ddp = model
            if args.distributed:
                model = DistributedDataParallel(model, device_ids=[args.gpu])
                model_without_ddp = model.module
            optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr)
            loss_scaler = NativeScaler()
            for epoch in range(args.epochs):
                train_one_epoch(model, data_loader_train, optimizer, "cuda", epoch, loss_scaler, args=args)
    """,
    "engine_pretrain.py": """
        import math
        import sys

        def train_one_epoch(model, data_loader, optimizer, device, epoch, loss_scaler, args=None):
            model.train(True)
            accum_iter = args.accum_iter
            optimizer.zero_grad()
            for data_iter_step, (samples, _) in enumerate(data_loader):
                samples = samples.to(device, non_blocking=True)
                loss, _, _ = model(samples, mask_ratio=args.mask_ratio)
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    sys.exit(1)
                loss /= accum_iter
                loss_scaler(loss, optimizer, parameters=model.parameters(),  # SC101
                            update_grad=(data_iter_step + 1) % accum_iter == 0)
                if (data_iter_step + 1) % accum_iter == 0:
                    optimizer.zero_grad()
    """,
    "util/__init__.py": "",
    "util/misc.py": """
        import torch

        class NativeScalerWithGradNormCount:
            def __init__(self):
                self._scaler = torch.cuda.amp.GradScaler()

            def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False,
                         update_grad=True):
                self._scaler.scale(loss).backward(create_graph=create_graph)
                if update_grad:
                    self._scaler.unscale_(optimizer)
                    self._scaler.step(optimizer)
                    self._scaler.update()
    """,
}


def test_mae_loop_in_another_file_through_a_loss_scaler(tmp_path):
    # the finding is in engine_pretrain.py, where the accumulation is; the DDP model comes from main
    check_project(tmp_path, MAE)


def test_single_file_lint_reads_the_files_that_import_it(tmp_path):
    # a pre-commit hook passes only the changed file: main_pretrain.py beside it is read as context
    check_project(tmp_path, MAE, paths=["engine_pretrain.py"])


SAMPLER_IN_A_SUBFOLDER = {
    "utils/data_utils.py": """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler


        def get_loader(dataset, local_rank):
            sampler = DistributedSampler(dataset)  # SC302
            return DataLoader(dataset, sampler=sampler, batch_size=32)
    """,
    "train.py": """
        import torch

        from utils.data_utils import get_loader


        def train(model, dataset, optimizer, epochs, local_rank):
            loader = get_loader(dataset, local_rank)
            for epoch in range(epochs):
                for x, y in loader:
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    """,
}


def test_single_file_lint_reads_an_importer_in_the_folder_above(tmp_path):
    # ViT-pytorch: the sampler is built in utils/ (no __init__.py), the epoch loop is train.py above it
    check_project(tmp_path, SAMPLER_IN_A_SUBFOLDER, paths=["utils/data_utils.py"])


SAMPLER_IMPORTED_BY_A_SIBLING_PACKAGE = {
    "data_provider/__init__.py": "",
    "data_provider/data_factory.py": """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler


        def data_provider(dataset, batch_size):
            sampler = DistributedSampler(dataset)  # SC302
            return DataLoader(dataset, sampler=sampler, batch_size=batch_size)
    """,
    "exp/__init__.py": "",
    "exp/exp_forecast.py": """
        import torch

        from data_provider.data_factory import data_provider


        class ExpForecast:
            def __init__(self, model, dataset, optimizer, epochs):
                self.model, self.dataset, self.optimizer, self.epochs = model, dataset, optimizer, epochs

            def train(self):
                loader = data_provider(self.dataset, 32)
                for epoch in range(self.epochs):
                    for x, y in loader:
                        loss = torch.nn.functional.mse_loss(self.model(x), y)
                        loss.backward()
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """,
    "run.py": """
        from exp.exp_forecast import ExpForecast

        ExpForecast(None, None, None, 10).train()
    """,
}


def test_single_file_lint_reads_an_importer_in_a_sibling_package(tmp_path):
    # Large-Time-Series-Model: the sampler is built in data_provider/, the epoch loop is in exp/
    check_project(tmp_path, SAMPLER_IMPORTED_BY_A_SIBLING_PACKAGE, paths=["data_provider/data_factory.py"])


HELPERS_CALLED_FROM_SCRIPTS = {
    "utils/__init__.py": "",
    "utils/train_utils.py": """
        def train_one_epoch(config, accelerator, model, loss_module, optimizer, loader):
            for batch in loader:
                with accelerator.accumulate([model, loss_module]):  # SC104
                    loss = loss_module(model(batch))
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    "scripts/train_tokenizer.py": """
        from accelerate import Accelerator

        from utils.train_utils import train_one_epoch


        def main(config, model, loss_module, optimizer, loader):
            accelerator = Accelerator(gradient_accumulation_steps=config.accum)
            model, loss_module, optimizer = accelerator.prepare(model, loss_module, optimizer)
            for epoch in range(config.epochs):
                train_one_epoch(config, accelerator, model, loss_module, optimizer, loader)
    """,
}


def test_single_file_lint_follows_a_script_in_another_folder_into_the_linted_helpers(tmp_path):
    # 1d-tokenizer: scripts/train_titok.py builds the Accelerator (with accumulation) and prepares the
    # models; utils/train_utils.py, linted alone, holds the loop and its ``accumulate([list])`` bug
    check_project(tmp_path, HELPERS_CALLED_FROM_SCRIPTS, paths=["utils/train_utils.py"])


def test_mae_with_no_sync_is_clean(tmp_path):
    files = dict(MAE)
    files["engine_pretrain.py"] = MAE["engine_pretrain.py"].replace("""                loss_scaler(loss, optimizer, parameters=model.parameters(),  # SC101
                            update_grad=(data_iter_step + 1) % accum_iter == 0)""", """                if (data_iter_step + 1) % accum_iter != 0:
                    with model.no_sync():
                        loss_scaler(loss, optimizer, parameters=model.parameters(), update_grad=False)
                else:
                    loss_scaler(loss, optimizer, parameters=model.parameters(), update_grad=True)""")
    # the forward ran outside no_sync: wrapping only the scaler's backward does nothing
    files["engine_pretrain.py"] = files["engine_pretrain.py"].replace(
        "                    with model.no_sync():", "                    with model.no_sync():  # SC102")
    check_project(tmp_path, files)


TRAINER_BASE = {
    "trainer/__init__.py": "from .base import BaseTrainer\n",
    "trainer/base.py": """
        import torch

        class BaseTrainer:
            def __init__(self, model, optimizer, accum_steps):
                self.model = model
                self.optimizer = optimizer
                self.accum_steps = accum_steps

            def _forward(self, batch):
                return self.model(**batch).loss / self.accum_steps

            def _backward(self, loss):
                loss.backward()  # SC101

            def fit(self, loader):
                for step, batch in enumerate(loader):
                    loss = self._forward(batch)
                    self._backward(loss)
                    if (step + 1) % self.accum_steps == 0:
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """,
    "train.py": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from trainer import BaseTrainer

        class LMTrainer(BaseTrainer):
            pass

        def main():
            model = DDP(build().cuda())
            optimizer = torch.optim.AdamW(model.parameters())
            LMTrainer(model, optimizer, accum_steps=8).fit(loader)

        if __name__ == "__main__":
            main()
    """,
}


def test_trainer_base_class_in_another_package(tmp_path):
    check_project(tmp_path, TRAINER_BASE)


def test_helper_that_wraps_in_another_module(tmp_path):
    check_project(tmp_path, {
        "utils/torch_utils.py": """
            from torch.nn.parallel import DistributedDataParallel as DDP

            def smart_DDP(model):
                return DDP(model, device_ids=[0], output_device=0, static_graph=False)
        """,
        "utils/__init__.py": "",
        "train.py": """
            from utils.torch_utils import smart_DDP

            def compute_loss(pred, targets):
                bs = pred.shape[0]
                return (pred - targets).abs().mean() * bs     # YOLOv5 sums over the nominal batch

            def train(model, loader, optimizer, scaler, accumulate, cuda, RANK):
                if cuda and RANK != -1:
                    model = smart_DDP(model)
                last_opt_step = -1
                for i, (imgs, targets) in enumerate(loader):
                    ni = i
                    loss = compute_loss(model(imgs), targets)
                    scaler.scale(loss).backward()  # SC101
                    if ni - last_opt_step >= accumulate:
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad()
                        last_opt_step = ni
        """,
    })


@pytest.mark.parametrize("wrap", [
    ["model = torch.compile(DDP(net))"],
    ["model = DDP(torch.compile(net))"],
    ["model = DDP(net) if distributed else net"],
    ["model = net", "if distributed:", "    model = DDP(model)"],
])
def test_wrapper_spellings_reach_a_loop_in_another_function(tmp_path, wrap):
    lines = "\n".join("    " + line for line in wrap)
    check_project(tmp_path, {"train.py": """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

def train_epoch(model, loader, optimizer, accum):
    for i, batch in enumerate(loader):
        loss = model(batch).mean() / accum
        loss.backward()  # SC101
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()

def main(net, loader, distributed):
WRAP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(10):
        train_epoch(model, loader, optimizer, 4)
""".replace("WRAP", lines)})


def test_annotation_says_ddp(tmp_path):
    check_project(tmp_path, {"engine.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train_epoch(model: DDP, loader, optimizer, accum: int):
            for i, batch in enumerate(loader):
                loss = model(batch).mean() / accum
                loss.backward()  # SC101
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_relative_import_of_the_loop(tmp_path):
    check_project(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/engine.py": """
            def run(model, loader, opt, n):
                for i, b in enumerate(loader):
                    (model(b).sum() / n).backward()  # SC101
                    if (i + 1) % n == 0:
                        opt.step()
                        opt.zero_grad()
        """,
        "pkg/main.py": """
            import torch.nn.parallel as par
            from .engine import run

            def main(net, loader, opt):
                run(par.DistributedDataParallel(net), loader, opt, 4)
        """,
    })


def test_trainer_methods_with_a_sync_helper_around_backward_only(tmp_path):
    # the helper flips require_backward_grad_sync around backward() only: DDP already decided. The
    # finding is at the `with` that enters the helper, where the fix goes (cover the forward too)
    check_project(tmp_path, {"trainer.py": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        class Trainer:
            def __init__(self, model, optimizer, accum):
                self.model = DDP(model)
                self.optimizer = optimizer
                self.accum = accum

            @contextlib.contextmanager
            def maybe_sync(self, sync):
                self.model.require_backward_grad_sync = sync
                yield
                self.model.require_backward_grad_sync = True

            def _forward_backward(self, batch, sync):
                loss = self.model(batch).mean() / self.accum
                self._backward_loss(loss, sync)

            def _backward_loss(self, loss, sync):
                with self.maybe_sync(sync):  # SC102
                    loss.backward()

            def train(self, loader):
                for i, batch in enumerate(loader):
                    sync = (i + 1) % self.accum == 0
                    self._forward_backward(batch, sync)
                    if sync:
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """})


def test_accelerator_backward_in_a_method(tmp_path):
    check_project(tmp_path, {"trainer.py": """
        from accelerate import Accelerator

        class Trainer:
            def __init__(self, model, optimizer, loader):
                self.accelerator = Accelerator()
                self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)

            def backward_step(self, loss):
                self.accelerator.backward(loss)  # SC101

            def train(self, accum):
                for step, batch in enumerate(self.loader):
                    loss = self.model(**batch).loss / accum
                    self.backward_step(loss)
                    if (step + 1) % accum == 0:
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """})


@pytest.mark.parametrize("enter", [
    ["if not sync:", "    stack.enter_context(model.no_sync())"],
    ["stack.enter_context(model.no_sync() if not sync else contextlib.nullcontext())"],
])
def test_exitstack_sync_control_is_understood(tmp_path, enter):
    lines = "\n".join(" " * 12 + line for line in enter)
    check_project(tmp_path, {"train.py": """
import contextlib
from torch.nn.parallel import DistributedDataParallel as DDP

def train(model, loader, optimizer, accum):
    model = DDP(model)
    for i, batch in enumerate(loader):
        sync = (i + 1) % accum == 0
        with contextlib.ExitStack() as stack:
ENTER
            loss = model(batch).mean() / accum
            loss.backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()
""".replace("ENTER", lines)})


def test_exitstack_entered_on_every_micro_step_is_unsynced(tmp_path):
    check_project(tmp_path, {"train.py": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(model, loader, optimizer, accum):
            model = DDP(model)
            for i, batch in enumerate(loader):
                with contextlib.ExitStack() as stack:
                    stack.enter_context(model.no_sync())  # SC103
                    loss = model(batch).mean() / accum
                    loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_functools_partial_of_no_sync_helper(tmp_path):
    check_project(tmp_path, {"train.py": """
        import functools
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        def sync_context(model, last):
            return model.no_sync() if last else nullcontext()

        def train(model, loader, optimizer, accum):
            model = DDP(model)
            ctx_for = functools.partial(sync_context, model)
            for i, batch in enumerate(loader):
                last = (i + 1) % accum == 0
                with ctx_for(last):  # SC103
                    loss = model(batch).mean() / accum
                    loss.backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_project_data_parallel_subclass(tmp_path):
    check_project(tmp_path, {
        "parallel.py": """
            from torch.nn.parallel import DistributedDataParallel

            class DataParallelModel(DistributedDataParallel):
                def gather(self, outputs, output_device):
                    return outputs
        """,
        "train.py": """
            from parallel import DataParallelModel

            def train(net, loader, optimizer, accum):
                model = DataParallelModel(net)
                for i, batch in enumerate(loader):
                    loss = model(batch).mean() / accum
                    loss.backward()  # SC101
                    if (i + 1) % accum == 0:
                        optimizer.step()
                        optimizer.zero_grad()
        """,
    })


# -- precision traps ---------------------------------------------------------------------------------

def test_download_first_barrier_idiom_is_not_a_hang(tmp_path):
    check_project(tmp_path, {"train.py": """
        import torch
        import torch.distributed as dist
        from contextlib import contextmanager

        @contextmanager
        def torch_distributed_zero_first(local_rank):
            if local_rank not in [-1, 0]:
                dist.barrier(device_ids=[local_rank])
            yield
            if local_rank == 0:
                dist.barrier(device_ids=[0])

        def main(args):
            if args.local_rank not in [-1, 0]:
                torch.distributed.barrier()
            dataset = load_and_cache(args)
            if args.local_rank == 0:
                torch.distributed.barrier()
            with torch_distributed_zero_first(args.local_rank):
                data = check_dataset(args.data)
    """})


def test_barrier_outside_the_rank_branch_is_fine_but_inside_hangs(tmp_path):
    check_project(tmp_path, {"train.py": """
        import torch.distributed as dist
        from accelerate import Accelerator

        def save(model, rank, accelerator):
            if rank == 0:
                torch.save(model.state_dict(), "ckpt.pt")
            dist.barrier()
            if accelerator.is_main_process:
                accelerator.save_state("out")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                accelerator.wait_for_everyone()  # SC301
    """})


def test_collective_through_a_helper_in_another_file(tmp_path):
    check_project(tmp_path, {
        "dist_utils.py": """
            import torch.distributed as dist

            def reduce_metrics(t):
                dist.all_reduce(t)
                return t
        """,
        "train.py": """
            from dist_utils import reduce_metrics

            def log(metrics, rank):
                if rank == 0:
                    reduce_metrics(metrics)  # SC301
        """,
    })


def test_loss_divided_in_a_helper_or_by_accelerate_is_not_sc202(tmp_path):
    check_project(tmp_path, {
        "losses.py": """
            def compute_loss(outputs, batch, accum):
                loss = outputs.loss
                return loss / accum
        """,
        "train.py": """
            from accelerate import Accelerator
            from losses import compute_loss

            def plain(model, loader, optimizer, accum):
                for i, batch in enumerate(loader):
                    loss = compute_loss(model(**batch), batch, accum)
                    loss.backward()
                    if (i + 1) % accum == 0:
                        optimizer.step()
                        optimizer.zero_grad()

            def grads_scaled(model, loader, optimizer, accum):
                for i, batch in enumerate(loader):
                    model(**batch).loss.backward()
                    if (i + 1) % accum == 0:
                        for p in model.parameters():
                            p.grad /= accum
                        optimizer.step()
                        optimizer.zero_grad()

            def accelerated(model, loader, optimizer):
                accelerator = Accelerator(gradient_accumulation_steps=4)
                model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
                for batch in loader:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(**batch).loss)
                        optimizer.step()
                        optimizer.zero_grad()
        """,
    })


def test_no_sync_miss_is_sc102_not_also_sc101(tmp_path):
    check_project(tmp_path, {"train.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(model, loader, optimizer, accum):
            model = DDP(model)
            for i, batch in enumerate(loader):
                loss = model(batch).mean() / accum
                if (i + 1) % accum != 0:
                    with model.no_sync():  # SC102
                        loss.backward()
                else:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_single_device_fabric_has_nothing_to_sync(tmp_path):
    check_project(tmp_path, {"train.py": """
        import lightning as L

        def train(model, optimizer, loader, accum):
            fabric = L.Fabric(accelerator="cuda", devices=1)
            model, optimizer = fabric.setup(model, optimizer)
            for i, batch in enumerate(loader):
                loss = model(batch).mean() / accum
                fabric.backward(loss)
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_multi_device_fabric_without_no_backward_sync(tmp_path):
    check_project(tmp_path, {"train.py": """
        import lightning as L

        def train(model, optimizer, loader, accum):
            fabric = L.Fabric(accelerator="cuda", devices=4, strategy="ddp")
            model, optimizer = fabric.setup(model, optimizer)
            for i, batch in enumerate(loader):
                loss = model(batch).mean() / accum
                fabric.backward(loss)  # SC101
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_branch_heavy_loop_keeps_its_finding(tmp_path):
    branches = "\n".join(f"        if cfg.aux_{k}:\n            loss = loss + aux_{k}(out) * 0.1" for k in range(64))
    check_project(tmp_path, {"train.py": """
from torch.nn.parallel import DistributedDataParallel as DDP

def train(model, loader, optimizer, accum, cfg):
    model = DDP(model)
    for i, batch in enumerate(loader):
        out = model(batch)
        loss = out.mean()
BRANCHES
        loss = loss / accum
        loss.backward()  # SC101
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
""".replace("BRANCHES", branches)})


# -- bad input -----------------------------------------------------------------------------------------

def test_import_cycle_missing_module_and_recursion(tmp_path):
    check_project(tmp_path, {
        "a.py": """
            import b
            from missing_module import thing
            from b import *

            def loop(model, loader, opt, n):
                for i, x in enumerate(loader):
                    (model(x).sum() / n).backward()  # SC101
                    if (i + 1) % n == 0:
                        opt.step()
                        opt.zero_grad()
                    ping(i)

            def ping(i):
                return pong(i - 1) if i else 0

            def pong(i):
                return ping(i)
        """,
        "b.py": """
            import a
            from torch.nn.parallel import DistributedDataParallel as DDP

            def main(net, loader, opt):
                a.loop(DDP(net), loader, opt, 4)
                return main(net, loader, opt)
        """,
    })


def test_two_scripts_with_the_same_module_name(tmp_path):
    script = """
        from torch.nn.parallel import DistributedDataParallel as DDP
        from engine import run
        run(DDP(net), loader, opt)
    """
    engine = """
        def run(model, loader, opt):
            for i, x in enumerate(loader):
                (model(x).sum() / 4).backward()  # SC101
                if (i + 1) % 4 == 0:
                    opt.step()
                    opt.zero_grad()
    """
    clean_engine = """
        def run(model, loader, opt):
            for x in loader:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    """
    check_project(tmp_path, {"one/main.py": script, "one/engine.py": engine,
                             "two/main.py": script, "two/engine.py": clean_engine})


def test_huge_function_and_a_name_rebound_many_times(tmp_path):
    body = "\n".join(f"    x{i} = helper(x{i - 1 if i else 0}) + {i}" for i in range(5000))
    rebound = "\n".join("        loss = loss * 1.0" for _ in range(1000))
    check_project(tmp_path, {"train.py": """
from torch.nn.parallel import DistributedDataParallel as DDP

def big(model, loader, optimizer):
BODY
    model = DDP(model)
    for i, batch in enumerate(loader):
        loss = model(batch).mean()
REBOUND
        loss.backward()  # SC101
        if (i + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
""".replace("BODY", body).replace("REBOUND", rebound)})


def test_sc103_message_says_which_control_is_active_at_the_boundary_and_why():
    # FunASR's trainer: the sync context is chosen by a condition that is off by one from the step's
    from synccheck.analyzer.engine import check_source
    source = textwrap.dedent("""
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train_epoch(model, loader, optimizer, accum_grad):
            model = DDP(model)
            for batch_idx, (x, y) in enumerate(loader):
                my_context = model.no_sync if batch_idx % accum_grad != 0 else nullcontext
                with my_context():
                    loss = (model(x) - y).pow(2).mean() / accum_grad
                    loss.backward()
                if (batch_idx + 1) % accum_grad == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """)
    [finding] = [f for f in check_source(source, "trainer.py") if f.code == "SC103"]
    assert finding.line == 9
    message = finding.message
    # both conditions are stated as they hold at the boundary, in the code's own words
    assert "`batch_idx % accum_grad != 0` is true" in message
    assert "`(batch_idx + 1) % accum_grad == 0` is true" in message
    assert "is false" not in message
    assert "`my_context()` turns it off" in message


@pytest.mark.parametrize("also_context", [False, True])
def test_a_file_that_vanishes_after_discovery(tmp_path, monkeypatch, also_context):
    # files found by the walk, then deleted before they are read (an editor's temp file, a checkout
    # switching branches): each is reported as an error, the others are still linted, nothing raises
    import synccheck.analyzer.engine as engine
    write_project(tmp_path, {**MAE, "gone.py": "import torch\nfor x in y:\n    x.backward()\n"})
    discover = engine.discover
    doomed = [tmp_path / "gone.py"] + ([tmp_path / "util" / "misc.py"] if also_context else [])

    def discover_then_delete(*args, **kwargs):
        files = discover(*args, **kwargs)
        for path in doomed:
            path.unlink()       # misc.py is read lazily, as context of the loop
        return files

    monkeypatch.setattr(engine, "discover", discover_then_delete)
    result = engine.lint([str(tmp_path)], jobs=1)
    assert sorted(Path(e.path).name for e in result.errors) == sorted(p.name for p in doomed)
    assert all("cannot read" in e.message for e in result.errors)
    codes = {(Path(f.path).name, f.code) for f in result.findings}
    # the other files are still linted: the loop's finding stands (main_pretrain.py, read because its
    # loop drives ``train_one_epoch(...)``, names the scaler ``NativeScaler`` even without misc.py)
    assert ("engine_pretrain.py", "SC101") in codes


def test_a_script_whose_loop_drives_a_trainer_object_in_another_file(tmp_path):
    # train.py names no backward, step or sync word: only ``trainer.lm_step(...)`` in a loop; the
    # trainer's undivided accumulation is found through it when the folder is linted. It is reported
    # in lm_step, which holds the micro-step and its own schedule (``self.n_iter % accumulate``), as
    # a lint of lm/trainer.py alone does (the corpus labels XLM's trainer.py)
    files = {
        "lm/trainer.py": """
            class Trainer:
                def __init__(self, model, optimizer, params):
                    self.model, self.optimizer, self.params = model, optimizer, params
                    self.n_iter = 0

                def lm_step(self, batch):
                    loss = self.model(batch).mean()
                    if self.n_iter % self.params.accumulate == 0:
                        loss.backward()
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                    else:
                        loss.backward()  # SC202

                def iter(self):
                    self.n_iter += 1
        """,
        "lm/__init__.py": "",
        "train.py": """
            from lm.trainer import Trainer


            def main(model, optimizer, params, loader):
                trainer = Trainer(model, optimizer, params)
                for batch in loader:
                    trainer.lm_step(batch)
                    trainer.iter()
        """,
    }
    assert check_project(tmp_path, files) == expected(tmp_path, files)


def test_wrapper_imported_inside_the_function_that_wraps(tmp_path):
    # ``from torch.nn.parallel import DistributedDataParallel`` inside __init__ (only when distributed)
    files = {
        "distiller.py": """
            class Distiller:
                def __init__(self, student, optimizer, params):
                    self.student, self.optimizer, self.params = student, optimizer, params
                    self.n_iter = 0
                    if params.multi_gpu and params.fp16:
                        from apex.parallel import DistributedDataParallel
                        self.student = DistributedDataParallel(self.student)
                    elif params.multi_gpu:
                        from torch.nn.parallel import DistributedDataParallel
                        self.student = DistributedDataParallel(self.student, device_ids=[params.local_rank])

                def train(self, loader):
                    for batch in loader:
                        loss = self.student(batch).mean() / self.params.accum
                        loss.backward()  # SC101
                        self.n_iter += 1
                        if self.n_iter % self.params.accum == 0:
                            self.optimizer.step()
                            self.optimizer.zero_grad()
        """,
    }
    check_project(tmp_path, files)


# a method of an object from a registry (fairseq's ``self.task.train_step``): which class stands for it
REGISTRY_TRAINER = """
    class Trainer:
        def __init__(self, task, model, optimizer):
            self.task = task
            self.model = DistributedDataParallel(model)
            self.optimizer = optimizer

        def train_step(self, samples):
            for sample in samples:
                self.task.train_step(sample, self.model, self.optimizer)  # SC101
            self.optimizer.step()
            self.optimizer.zero_grad()
"""
BASE_TASK = """
    class BaseTask:
        def train_step(self, sample, model, optimizer):
            loss = model(sample).mean()
            optimizer.backward(loss)
"""


def test_registry_method_stands_for_its_base_class(tmp_path):
    files = {"pkg/__init__.py": "", "pkg/tasks/__init__.py": "",
             "pkg/trainer.py": "from torch.nn.parallel import DistributedDataParallel\n" + textwrap.dedent(REGISTRY_TRAINER),
             "pkg/tasks/base.py": BASE_TASK,
             "pkg/tasks/lm.py": """
                 from pkg.tasks.base import BaseTask

                 class LanguageModelingTask(BaseTask):
                     def train_step(self, sample, model, optimizer):
                         return super().train_step(sample, model, optimizer)
             """}
    # the trainer alone: the task's class is found on disk, in the trainer's package
    assert check_project(tmp_path, files, paths=[tmp_path / "pkg" / "trainer.py"]) == expected(tmp_path, {"pkg/trainer.py": 0})


def test_registry_method_defined_by_unrelated_classes_is_not_guessed(tmp_path):
    files = {"pkg/__init__.py": "",
             "pkg/trainer.py": "from torch.nn.parallel import DistributedDataParallel\n" +
                               textwrap.dedent(REGISTRY_TRAINER).replace("  # SC101", ""),
             "pkg/base.py": BASE_TASK,
             # another family with a method of the same name and the same arguments: no contract to go by
             "pkg/other.py": """
                 class Evaluator:
                     def train_step(self, sample, model, optimizer):
                         return None
             """}
    assert check_project(tmp_path, files) == set()



def test_import_resolved_by_a_unique_path_tail_in_the_lint_set(tmp_path):
    """A launcher in a sub-folder imports the project's packages as top-level modules (a
    ``sys.path.insert`` puts their folder on the path when it runs): ``import libs.egs`` from
    ``pytorch/launcher/run.py`` means ``pytorch/libs/egs.py``, the one file of the lint set with
    that tail (asv-subtools). Linting the repository root finds the sampler the launcher's trainer
    iterates."""
    files = {
        "pytorch/libs/__init__.py": "",
        "pytorch/libs/egs.py": """
            from torch.utils.data import DataLoader, DistributedSampler

            class Bunch:
                def __init__(self, trainset):
                    sampler = DistributedSampler(trainset, shuffle=True)  # SC302
                    self.train_loader = DataLoader(trainset, sampler=sampler, batch_size=32)
        """,
        "pytorch/libs/trainer.py": """
            class Trainer:
                def __init__(self, model, optimizer, bunch):
                    self.model, self.optimizer, self.data = model, optimizer, bunch

                def run(self, epochs):
                    for epoch in range(epochs):
                        for x, y in self.data.train_loader:
                            self.optimizer.zero_grad()
                            self.model(x, y).backward()
                            self.optimizer.step()
        """,
        "pytorch/launcher/run.py": """
            import sys

            from torch.nn.parallel import DistributedDataParallel as DDP

            sys.path.insert(0, "subtools/pytorch")
            import libs.egs as egs
            import libs.trainer as trainer

            def main(model, trainset):
                model = DDP(model)
                trainer.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), egs.Bunch(trainset)).run(10)
        """,
        # a second tree with the same module names: ``import other.egs`` is not guessed between them
        "tools/other/egs.py": "",
        "vendor/other/egs.py": "",
    }
    check_project(tmp_path, files)


def test_single_file_context_skips_tests_and_packaging(tmp_path):
    # a test builds toy objects (speechbrain's tests/unittests/test_core.py makes a Brain of plain
    # modules): read as context, it told the analysis the model was never DDP, and core.py's SC102 was lost
    from synccheck.analyzer.imports import importers_beside
    files = dict(HELPERS_CALLED_FROM_SCRIPTS)
    uses = "from utils.train_utils import train_one_epoch\n"
    files["tests/test_train_utils.py"] = uses
    files["scripts/test_helpers.py"] = uses
    files["setup.py"] = uses
    write_project(tmp_path, files)
    found = importers_beside(str(tmp_path / "utils" / "train_utils.py"), set())
    assert sorted(os.path.relpath(p, tmp_path) for p in found) == [os.path.join("scripts", "train_tokenizer.py")]


SHARDED_THROUGH_A_REGISTRY = {
    "titan/__init__.py": "",
    "titan/parallelisms/__init__.py": """
        from titan.parallelisms.parallelize_llama import parallelize_llama

        models_parallelize_fns = {
            "llama2": parallelize_llama,
            "llama3": parallelize_llama,
        }
    """,
    "titan/parallelisms/parallelize_llama.py": """
        from torch.distributed._composable.fsdp import fully_shard


        def parallelize_llama(model, world_mesh, job_config):
            for layer_id, block in model.layers.items():
                fully_shard(block, mesh=world_mesh)
            fully_shard(model, mesh=world_mesh)
            return model
    """,
    "train.py": """
        import torch

        from titan.parallelisms import models_parallelize_fns


        def main(job_config, model_cls, world_mesh, data_iterator, loss_fn):
            model = model_cls.from_model_args(job_config.model)
            models_parallelize_fns[job_config.model.name](model, world_mesh, job_config)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
            for step in range(job_config.training.steps):
                optimizer.zero_grad()
                for microbatch in range(job_config.training.grad_accumulation_steps):
                    input_ids, labels = next(data_iterator)
                    loss = loss_fn(model(input_ids), labels) / job_config.training.grad_accumulation_steps
                    loss.backward()  # SC101
                optimizer.step()
    """,
}


def test_a_model_sharded_in_place_through_a_registry_of_helpers(tmp_path):
    # torchtitan-style ``models_parallelize_fns[name](model, ...)`` (Adam-mini's llama example): the
    # helper kept in a dict shards the model in place; the inner loop accumulates with sync on
    check_project(tmp_path, SHARDED_THROUGH_A_REGISTRY)


def test_a_model_sharded_in_place_by_a_helper_of_a_file_not_linted(tmp_path):
    # a lint of train.py alone: the helpers it calls into are parsed to see the in-place wrapping
    check_project(tmp_path, SHARDED_THROUGH_A_REGISTRY, paths=["train.py"])


ENGINE_STEPPED_BY_A_SCRIPT = {
    "engine.py": """
        import torch
        from torch.nn.parallel import DistributedDataParallel


        class Engine(torch.nn.Module):
            def __init__(self, model, batch_size, microbatch_size):
                super().__init__()
                if torch.distributed.is_initialized():
                    self.model = DistributedDataParallel(model)
                else:
                    self.model = model
                self.current_batch_size = batch_size
                self.microbatch_size = microbatch_size
                self.accumulation_steps_expected = batch_size // microbatch_size
                self.accumulated_samples = 0
                self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(self, batch):
                loss = self.forward(**batch)["loss"]
                self.backward(loss)  # FILE-MODE
                self.optimizer_step()
                return loss.detach()

            def forward(self, *inputs, **kwargs):
                return self.model(*inputs, **kwargs)

            def backward(self, loss):
                self.accumulated_samples += self.microbatch_size
                return (loss / self.accumulation_steps_expected).backward()

            def optimizer_step(self):
                if self.accumulated_samples >= self.current_batch_size:
                    self.accumulated_samples = 0
                    self.optimizer.step()
                    self.optimizer.zero_grad()
    """,
    "pretrain.py": """
        import torch

        from engine import Engine


        def main(model, dataloader):
            torch.distributed.init_process_group("nccl")
            model_engine = Engine(model, batch_size=1536, microbatch_size=128)
            for step, batch in enumerate(dataloader):
                loss = model_engine.step(batch)  # DIR-MODE
    """,
}


def test_an_engine_stepped_by_a_script_it_does_not_name(tmp_path):
    # cramming (before 38d65b6): the engine runs forward and backward on every step(batch) and steps
    # the optimizer on its own sample counter; pretrain.py, which names none of our words but
    # ``model_engine.step(``, runs the loop. The whole folder: reported at the loop's call
    files = {k: v.replace("# DIR-MODE", "# SC101").replace("  # FILE-MODE", "") for k, v in ENGINE_STEPPED_BY_A_SCRIPT.items()}
    check_project(tmp_path, files)


def test_an_engine_linted_alone_is_reported_in_its_own_file(tmp_path):
    # a lint of engine.py alone reads pretrain.py as context: the finding is engine.py's, at the call
    # nearest to the context file's loop
    files = {k: v.replace("# FILE-MODE", "# SC101").replace("  # DIR-MODE", "") for k, v in ENGINE_STEPPED_BY_A_SCRIPT.items()}
    check_project(tmp_path, files, paths=["engine.py"])


def test_an_engine_whose_loop_is_out_of_view_returns_at_the_end_of_each_micro_step(tmp_path):
    # cramming's torch_default.py alone: step(batch) is the body of a loop nobody in view runs; its
    # ``return loss.detach()`` ends one turn of that loop, not the loop (it used to end the analysis)
    engine = ENGINE_STEPPED_BY_A_SCRIPT["engine.py"].replace("  # FILE-MODE", "").replace(
        "return (loss / self.accumulation_steps_expected).backward()",
        "return (loss / self.accumulation_steps_expected).backward()  # SC101")
    check_project(tmp_path, {"engine.py": engine})



def test_single_file_lint_reads_the_nearest_importers_first(tmp_path):
    # SLAM-LLM: utils/train_utils.py is imported by a dozen example models and by the pipeline that
    # wraps the model in DDP; the pipeline, nearer in the tree, is among the importers read
    files = {
        "pyproject.toml": "",
        "src/pkg/__init__.py": "",
        "src/pkg/utils/__init__.py": "",
        "src/pkg/utils/train_utils.py": """
            def train(model, loader, optimizer, gradient_accumulation_steps):
                for step, batch in enumerate(loader):
                    loss = model(**batch).loss / gradient_accumulation_steps
                    loss.backward()  # SC101
                    if (step + 1) % gradient_accumulation_steps == 0:
                        optimizer.step()
                        optimizer.zero_grad()
        """,
        "src/pkg/pipeline/__init__.py": "",
        "src/pkg/pipeline/finetune.py": """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            from pkg.utils.train_utils import train


            def main(model, loader, cfg):
                model = DDP(model, device_ids=[cfg.local_rank])
                optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
                train(model, loader, optimizer, cfg.gradient_accumulation_steps)
        """,
    }
    for i in range(12):
        files[f"examples/ex{i:02d}/model/slam_model.py"] = """
            from pkg.utils.train_utils import train  # noqa: F401


            def build():
                return None
        """
    write_project(tmp_path, files)
    got = found(tmp_path, [tmp_path / "src/pkg/utils/train_utils.py"])
    assert got == expected(tmp_path, files), got


@pytest.mark.parametrize("folder", ["mae_st", "mae-st", "facebookresearch+mae_st@c5dec1b"])
def test_repository_that_is_its_own_namespace_package(tmp_path, folder):
    # facebookresearch/mae_st: no __init__.py anywhere, and the scripts import their siblings as
    # ``mae_st.engine_pretrain`` (run from the folder above the clone, whatever the clone is called)
    files = {
        "main_pretrain.py": """
            import torch
            from torch.nn.parallel import DistributedDataParallel
            import mae_st.util.misc as misc
            from mae_st.engine_pretrain import train_one_epoch

            def main(args):
                model = build_model(args)
                if args.distributed:
                    model = DistributedDataParallel(model, device_ids=[args.gpu])
                optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
                loss_scaler = misc.Scaler()
                for epoch in range(args.epochs):
                    train_one_epoch(model, loader, optimizer, epoch, loss_scaler, args=args)
        """,
        "engine_pretrain.py": """
            def train_one_epoch(model, data_loader, optimizer, epoch, loss_scaler, args=None):
                accum_iter = args.accum_iter
                for data_iter_step, samples in enumerate(data_loader):
                    loss = model(samples) / accum_iter
                    loss_scaler(loss, optimizer, update_grad=(data_iter_step + 1) % accum_iter == 0)  # SC101
                    if (data_iter_step + 1) % accum_iter == 0:
                        optimizer.zero_grad()
        """,
        "util/misc.py": """
            import torch

            class Scaler:
                def __init__(self):
                    self._scaler = torch.cuda.amp.GradScaler()

                def __call__(self, loss, optimizer, update_grad=True):
                    self._scaler.scale(loss).backward()
                    if update_grad:
                        self._scaler.step(optimizer)
                        self._scaler.update()
        """,
    }
    root = tmp_path / folder
    write_project(root, files)
    got = found(root, [root / "engine_pretrain.py"])
    assert got == expected(root, files), got


def test_single_file_lint_reads_the_runner_that_calls_its_training_method(tmp_path):
    # salesforce/LAVIS, MiniGPT-4, Video-LLaMA: the runner wraps the model in DDP and calls
    # ``self.task.train_epoch(model=self.model, ...)`` on a task a registry made; it never imports
    # the task's module, so it is not an importer of tasks/base_task.py
    files = {
        "pyproject.toml": "",
        "runners/runner_base.py": """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            class RunnerBase:
                def __init__(self, cfg, task, model, loader):
                    self.config = cfg
                    self.task = task
                    self._model = model
                    self._wrapped_model = None
                    self.loader = loader
                    self.optimizer = torch.optim.AdamW(self._model.parameters(), lr=1e-4)

                @property
                def model(self):
                    if self._wrapped_model is None:
                        self._wrapped_model = DDP(self._model, device_ids=[self.config.gpu])
                    return self._wrapped_model

                def train(self):
                    for epoch in range(self.config.max_epoch):
                        self.task.train_epoch(epoch=epoch, model=self.model, data_loader=self.loader,
                                              optimizer=self.optimizer,
                                              accum_grad_iters=self.config.accum_grad_iters)
        """,
        "tasks/base_task.py": """
            class BaseTask:
                def train_step(self, model, samples):
                    return model(samples)["loss"]

                def train_epoch(self, epoch, model, data_loader, optimizer, accum_grad_iters=1):
                    for i, samples in enumerate(data_loader):
                        loss = self.train_step(model=model, samples=samples) / accum_grad_iters
                        loss.backward()  # SC101
                        if (i + 1) % accum_grad_iters == 0:
                            optimizer.step()
                            optimizer.zero_grad()
        """,
        "train.py": """
            from tasks import setup_task
            from runners import get_runner_class

            def main(cfg, model, loader):
                task = setup_task(cfg)
                runner = get_runner_class(cfg)(cfg=cfg, task=task, model=model, loader=loader)
                runner.train()
        """,
    }
    write_project(tmp_path, files)
    got = found(tmp_path, [tmp_path / "tasks/base_task.py"])
    assert got == expected(tmp_path, files), got


def test_a_checkout_folder_no_import_can_name_is_the_project_top(tmp_path):
    # a repository whose top holds an __init__.py, checked out as ``owner+repo@commit`` beside other
    # checkouts: the package root stops there (no import spells that name), so the files of the other
    # checkouts are not this project's
    from synccheck.analyzer.imports import _package_roots, _project_top
    repo = tmp_path / "checkouts" / "owner+repo@abc123"
    (repo / "train").mkdir(parents=True)
    (repo / "__init__.py").write_text("")
    (repo / "train" / "__init__.py").write_text("")
    (tmp_path / "checkouts" / "other+thing@def456").mkdir()
    here = str(repo / "train")
    assert _package_roots(here)[0] == str(repo)
    assert _project_top(here) == str(repo)


def test_findings_do_not_depend_on_where_the_project_is_checked_out(tmp_path):
    # the analysis walks sets of functions and classes in their hash order: a hash of the whole path
    # made the same repository give other findings in another folder (HALOs' SC101 came and went)
    import ast as _ast
    from synccheck.analyzer.project.index import Project
    text = "class Trainer:\n    def train(self):\n        pass\n"
    hashes = []
    for folder in ("w_s7a", "zz_b"):
        path = tmp_path / folder / "repo@abc" / "train" / "trainers.py"
        project = Project(roots=[str(path.parent)])
        module = project.add(str(path), text, _ast.parse(text), linted=True)
        hashes.append((hash(module), sorted(hash(f) for f in module.functions.values()),
                       sorted(hash(k) for k in module.classes.values())))
    assert hashes[0] == hashes[1]


# ``import _init_paths`` puts ``../lib`` on sys.path; the script imports the package ``dataset``, whose
# __init__ re-exports the builder (HigherHRNet's tools/dist_train.py and lib/dataset/build.py)
SYS_PATH_HELPER = {
    "setup.py": "",
    "lib/dataset/__init__.py": """
        from .build import make_dataloader
    """,
    "lib/dataset/build.py": """
        import torch.utils.data.distributed
        from torch.utils.data import DataLoader


        def make_dataloader(dataset, batch_size, distributed=False):
            sampler = torch.utils.data.distributed.DistributedSampler(dataset) if distributed else None  # SC302
            return DataLoader(dataset, batch_size=batch_size, shuffle=sampler is None, sampler=sampler)
    """,
    "tools/_init_paths.py": """
        import os.path as osp
        import sys


        def add_path(path):
            if path not in sys.path:
                sys.path.insert(0, path)


        this_dir = osp.dirname(__file__)
        add_path(osp.join(this_dir, '..', 'lib'))
    """,
    "tools/dist_train.py": """
        import torch

        import _init_paths
        from dataset import make_dataloader


        def main(data, model, optimizer, epochs):
            loader = make_dataloader(data, 32, distributed=True)  # SC302
            for epoch in range(epochs):
                for x, y in loader:
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
    """,
}


@pytest.mark.parametrize("paths", [None, ["lib/dataset/build.py"]], ids=["folder", "single-file"])
def test_a_package_found_through_a_sys_path_helper_and_its_reexport(tmp_path, paths):
    check_project(tmp_path, SYS_PATH_HELPER, paths=paths)


# the trainer module is imported through its package's __init__ (``from lib.train.trainers import
# LTRTrainer``), the model hidden in an actor object (MixFormer's lib/train/trainers/ltr_trainer.py)
REEXPORTED_TRAINER = {
    "setup.py": "",
    "lib/__init__.py": "",
    "lib/train/__init__.py": "",
    "lib/train/trainers/__init__.py": """
        from .ltr_trainer import LTRTrainer
    """,
    "lib/train/trainers/ltr_trainer.py": """
        class LTRTrainer:
            def __init__(self, actor, loader, optimizer, accum_iter=1):
                self.actor, self.loader, self.optimizer, self.accum_iter = actor, loader, optimizer, accum_iter

            def cycle_dataset(self):
                for i, data in enumerate(self.loader, 1):
                    loss = self.actor(data) / self.accum_iter
                    loss.backward()  # SC101
                    if i % self.accum_iter == 0:
                        self.optimizer.step()
                        self.optimizer.zero_grad()
    """,
    "lib/train/run_training.py": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from lib.train.trainers import LTRTrainer


        class Actor:
            def __init__(self, net):
                self.net = net

            def __call__(self, data):
                return self.net(data).mean()


        def run(net, loader, local_rank, accum_iter):
            net = DDP(net, device_ids=[local_rank])
            optimizer = torch.optim.AdamW(net.parameters())
            LTRTrainer(Actor(net), loader, optimizer, accum_iter=accum_iter).cycle_dataset()
    """,
}


@pytest.mark.parametrize("paths", [None, ["lib/train/trainers/ltr_trainer.py"]], ids=["folder", "single-file"])
def test_a_trainer_imported_through_its_packages_reexport(tmp_path, paths):
    check_project(tmp_path, REEXPORTED_TRAINER, paths=paths)


# the training function is re-exported by a star import (nanoT5: ``from .train_utils import *`` in
# nanoT5/utils/__init__.py, ``from .utils import train`` in nanoT5/main.py)
STAR_REEXPORTED_TRAIN = {
    "setup.py": "",
    "proj/__init__.py": "",
    "proj/utils/__init__.py": """
        from .model_utils import *
        from .train_utils import *
    """,
    "proj/utils/model_utils.py": """
        def get_model(name):
            return name
    """,
    "proj/utils/train_utils.py": """
        def _forward(model, batch):
            return model(**batch).loss


        def train(model, loader, optimizer, accelerator, grad_acc):
            for batch_id, batch in enumerate(loader, start=1):
                loss = _forward(model, batch)
                accelerator.backward(loss / grad_acc)  # SC101
                if batch_id % grad_acc == 0:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    """,
    "proj/main.py": """
        from accelerate import Accelerator

        from .utils import get_model, train


        def main(cfg, loader, optimizer):
            accelerator = Accelerator()
            model, optimizer, loader = accelerator.prepare(get_model(cfg.model), optimizer, loader)
            train(model, loader, optimizer, accelerator, cfg.grad_acc)
    """,
}


@pytest.mark.parametrize("paths", [None, ["proj/utils/train_utils.py"]], ids=["folder", "single-file"])
def test_a_training_function_reexported_by_a_star_import(tmp_path, paths):
    check_project(tmp_path, STAR_REEXPORTED_TRAIN, paths=paths)


# the training script only calls the helpers that wrap and train (VALOR: ``model, optimizer =
# set_parallel_optimizer_and_apex(...)``, ``conduct_train(model, ...)``): no loop, no word of ours
DRIVER_WITHOUT_A_LOOP = {
    "setup.py": "",
    "train_utils.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP


        def setup(model, optimizer, opts):
            model = DDP(model, device_ids=[opts.local_rank])
            return model, optimizer


        def conduct_train(model, optimizer, train_loader, opts):
            for step, batch in enumerate(train_loader):
                loss = model(batch) / opts.accum
                loss.backward()  # SC101
                if (step + 1) % opts.accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    "train.py": """
        from train_utils import conduct_train, setup


        def main(opts, net, optimizer, loader):
            model, optimizer = setup(net, optimizer, opts)
            conduct_train(model, optimizer, loader, opts)
    """,
}


@pytest.mark.parametrize("paths", [None, ["train_utils.py"]], ids=["folder", "single-file"])
def test_a_training_script_without_a_loop_drives_the_helpers(tmp_path, paths):
    check_project(tmp_path, DRIVER_WITHOUT_A_LOOP, paths=paths)


# a callback of a library calls its hooks itself: the method's name appears nowhere else, and it runs
LIBRARY_CALLBACK_SEEDS_THE_SAMPLER = {
    "callbacks.py": """
        import lightning.pytorch as pl


        class ReseedSampler(pl.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                trainer.datamodule.sampler.set_epoch(trainer.current_epoch)
    """,
    "data.py": """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler


        def loader(dataset):
            sampler = DistributedSampler(dataset)
            return DataLoader(dataset, sampler=sampler, batch_size=8)
    """,
    "train.py": """
        import torch

        from callbacks import ReseedSampler
        from data import loader
        from loops import fit_loop


        def main(model, dataset, optimizer, epochs):
            batches = loader(dataset)
            fit_loop(model, batches, optimizer, epochs, callbacks=[ReseedSampler()])
            for epoch in range(epochs):
                for x in batches:
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
    """,
}


def test_a_library_callbacks_hook_is_taken_to_run(tmp_path):
    check_project(tmp_path, LIBRARY_CALLBACK_SEEDS_THE_SAMPLER)


# save_state on the main process only: a hang where every launch configuration is DeepSpeed's
SAVE_STATE_ON_THE_MAIN_RANK = (
    "from accelerate import Accelerator\n\n\n"
    "def main(model, loader, out):\n"
    "    accelerator = Accelerator(gradient_accumulation_steps=4)\n"
    "    model, loader = accelerator.prepare(model, loader)\n"
    "    for step, batch in enumerate(loader):\n"
    "        with accelerator.accumulate(model):\n"
    "            accelerator.backward(model(**batch).loss)\n"
    "        if accelerator.is_main_process:\n"
    "            accelerator.save_state(out)\n")


def test_launch_configs_are_a_dependency_of_the_cached_result(tmp_path):
    """A project whose only accelerate launch configuration says DeepSpeed makes save_state on rank 0 a
    hang; editing that YAML (or adding a multi-GPU one beside it) must not be hidden by the cache."""
    from synccheck.analyzer.engine import lint

    (tmp_path / "train.py").write_text(SAVE_STATE_ON_THE_MAIN_RANK)
    (tmp_path / "zero3.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 8\n")
    cache = str(tmp_path / "cache")

    def codes():
        return sorted(f.code for f in lint([str(tmp_path)], cache_dir=cache, jobs=1).findings)

    assert codes() == ["SC301"]
    assert codes() == ["SC301"]                 # from the cache
    (tmp_path / "multi_gpu.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 8\n")
    assert codes() == []                        # not every launch is DeepSpeed's: save_state meets no one


# accumulate() on an Accelerator built without gradient_accumulation_steps (SC105 unless DeepSpeed's
# configuration gives the number of micro-steps)
ACCUMULATE_WITHOUT_STEPS = (
    "from accelerate import Accelerator\n\n\n"
    "def main(model, optimizer, loader):\n"
    "    accelerator = Accelerator()\n"
    "    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)\n"
    "    for batch in loader:\n"
    "        with accelerator.accumulate(model):\n"
    "            accelerator.backward(model(**batch).loss)\n"
    "            optimizer.step()\n"
    "            optimizer.zero_grad()\n")


def test_the_deepspeed_json_a_launch_config_names_is_a_dependency_of_the_cached_result(tmp_path):
    """The micro-step count of a DeepSpeed launch is read from the JSON its accelerate config names:
    ``"auto"`` leaves it to ``Accelerator()`` (SC105); writing a number there must not be hidden by
    the cache."""
    from synccheck.analyzer.engine import lint

    (tmp_path / "train.py").write_text(ACCUMULATE_WITHOUT_STEPS)
    (tmp_path / "ds.yaml").write_text("deepspeed_config:\n  deepspeed_config_file: ds_zero2.json\n"
                                      "distributed_type: DEEPSPEED\n")
    (tmp_path / "ds_zero2.json").write_text('{"gradient_accumulation_steps": "auto"}\n')
    cache = str(tmp_path / "cache")

    def codes():
        return sorted(f.code for f in lint([str(tmp_path)], cache_dir=cache, jobs=1).findings)

    assert codes() == ["SC105"]
    assert codes() == ["SC105"]                 # from the cache
    (tmp_path / "ds_zero2.json").write_text('{"gradient_accumulation_steps": 4}\n')
    assert codes() == []                        # DeepSpeed's count now: the Accelerator accumulates


def test_launch_configs_are_read_within_the_repository_only(tmp_path):
    """The search for accelerate configurations climbs from the script's folder, but not past the
    repository's root (a ``.git``), and not into a sibling folder that only has "config" in its name."""
    from synccheck.analyzer.engine import lint

    repo = tmp_path / "work" / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "train.py").write_text(SAVE_STATE_ON_THE_MAIN_RANK)
    (repo / "configs").mkdir()
    (repo / "configs" / "zero3.yaml").write_text("distributed_type: DEEPSPEED\n")
    # outside the repository: another project's multi-GPU launch, and a test folder named for configs
    (tmp_path / "work" / "multi_gpu.yaml").write_text("distributed_type: MULTI_GPU\n")
    (tmp_path / "test_launch_configs_of_another0").mkdir()
    (tmp_path / "test_launch_configs_of_another0" / "multi.yaml").write_text("distributed_type: MULTI_GPU\n")

    def codes():
        return sorted(f.code for f in lint([str(repo)], jobs=1).findings)

    assert codes() == ["SC301"]
    (repo / ".git").rmdir()          # no repository root: the folder above is the project's too
    assert codes() == []


def test_a_rewritten_test_keeps_its_position(tmp_path):
    """``self.step != 0`` is read as ``not (self.step == 0)``: the rewritten comparison keeps the
    original's line, which the first-turn reading of ``self.step`` compares with its ``+= 1``
    (index-tts's facodec trainer: an internal error left 16 files unchecked)."""
    check_project(tmp_path, {"train.py": """
        from accelerate import Accelerator


        class Trainer:
            def __init__(self, model, optimizer, loader):
                self.accelerator = Accelerator()
                self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
                self.step: int = 0

            def train_loop(self, epochs):
                for epoch in range(epochs):
                    self._train_epoch()

            def _train_epoch(self):
                for batch in self.loader:
                    loss = self.model(batch).mean()
                    self.accelerator.backward(loss)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    self.accelerator.log({"lr": (self.optimizer.lr if self.step != 0 else 0)}, step=self.step)
                    self.step += 1
    """})
