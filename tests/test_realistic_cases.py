"""Small scripts the way real training code writes them, each a case the analyzer once got wrong
(found by linting realistic buggy/fixed pairs). A line ending in ``# SCxxx`` must be reported with
that code, and nothing else may be; the fixed twin of each bug must stay clean."""
import pytest

from projectlib import check_project

CASES = {
    # a base trainer whose hook is a stub; the subclass fills it
    "abstract_hook_stub": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        class BaseTrainer:
            def __init__(self, accum):
                self.accum = accum

            def training_step(self, batch):
                raise NotImplementedError

            def train(self, loader):
                for idx, batch in enumerate(loader):
                    self.training_step(batch)
                    if (idx + 1) % self.accum == 0:
                        self.optimizer.step()
                        self.optimizer.zero_grad()

        class Trainer(BaseTrainer):
            def __init__(self, model, accum):
                super().__init__(accum)
                self.model = DDP(model)
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def training_step(self, batch):
                loss = self.model(batch).sum() / self.accum
                loss.backward()  # SC101
    """,
    # ``model.train()`` inside ``def train(model, ...)`` is the module's method, not the function
    "model_train_inside_def_train": """
        import torch
        from accelerate import Accelerator

        def train(accelerator, model, optimizer, loader):
            model.train()
            for i, (x, y) in enumerate(loader):
                loss = torch.nn.functional.cross_entropy(model(x), y) / 4
                accelerator.backward(loss)  # SC101
                if (i + 1) % 4 == 0:
                    optimizer.step()
                    optimizer.zero_grad()

        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(torch.nn.Linear(64, 10), torch.optim.Adam([]))
        train(accelerator, model, optimizer, loader)
    """,
    # the HF legacy layout: DataParallel, then DDP under local_rank; no_sync only when distributed
    "dataparallel_then_ddp_fixed": """
        import contextlib
        import torch

        def train(args, loader, model, optimizer):
            if args.n_gpu > 1:
                model = torch.nn.DataParallel(model)
            if args.local_rank != -1:
                model = torch.nn.parallel.DistributedDataParallel(model)
            for step, (x, y) in enumerate(loader):
                sync = (step + 1) % args.accum == 0
                with model.no_sync() if (args.local_rank != -1 and not sync) else contextlib.nullcontext():
                    loss = (model(x) - y).pow(2).mean() / args.accum
                    loss.backward()
                if sync:
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    # nanoGPT's inner loop with the sync flag on the wrong micro-step
    "first_micro_step_syncs": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
        n = 4
        for it in range(100):
            for micro_step in range(n):
                model.require_backward_grad_sync = micro_step == 0  # SC103
                loss = model(torch.randn(2, 8)).sum() / n
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    """,
    "last_micro_step_syncs": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
        n = 4
        for it in range(100):
            for micro_step in range(n):
                model.require_backward_grad_sync = micro_step == n - 1
                loss = model(torch.randn(2, 8)).sum() / n
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    """,
    # SC106's own advice: let the very first micro-step sync under static_graph
    "static_graph_first_step_syncs": """
        import torch
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 8), static_graph=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for it in range(2000):
            sync = it == 0 or (it + 1) % 4 == 0
            with nullcontext() if sync else model.no_sync():
                loss = model(torch.randn(2, 8)).sum() / 4
                loss.backward()
            if (it + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
    """,
    # activation checkpointing runs the model it is given
    "checkpoint_runs_the_model": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.checkpoint import checkpoint

        model = DDP(torch.nn.Linear(8, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for it, x in enumerate(loader):
            y = checkpoint(model, x, use_reentrant=False)
            loss = y.sum() / 4
            loss.backward()  # SC101
            if (it + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
    """,
    # the counter moves on between the sync decision and the step's test
    "counter_moved_on_between_tests": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
        step = 0
        for x in loader:
            ctx = contextlib.nullcontext() if step % 4 == 0 else model.no_sync()
            with ctx:  # SC103
                model(x).sum().div(4).backward()
            step += 1
            if step % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    "counter_moved_on_between_tests_fixed": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
        step = 0
        for x in loader:
            ctx = contextlib.nullcontext() if step % 4 == 3 else model.no_sync()
            with ctx:
                model(x).sum().div(4).backward()
            step += 1
            if step % 4 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    # a partial of the wrapper class, and one loss through two wrapped models one optimizer steps
    "partial_wrapper_two_models": """
        import functools
        import torch
        from torch.nn.parallel import DistributedDataParallel

        wrap = functools.partial(DistributedDataParallel, device_ids=[0])
        encoder = wrap(torch.nn.Linear(128, 64))
        decoder = wrap(torch.nn.Linear(64, 128))
        optimizer = torch.optim.Adam(list(encoder.parameters()) + list(decoder.parameters()))
        for step, x in enumerate(loader):
            loss = torch.nn.functional.mse_loss(decoder(encoder(x)), x) / 8
            loss.backward()  # SC101
            if (step + 1) % 8 == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    # FSDP2 in place on an instance of the project's own model class
    "fully_shard_project_class": """
        import torch
        from torch.distributed.fsdp import fully_shard

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x)

        model = Net()
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for step in range(100):
            for mb in range(4):
                loss = model(torch.randn(2, 8)).sum() / 4
                loss.backward()  # SC101
            optim.step()
            optim.zero_grad()
    """,
    # no_sync on the module the wrapper was built from: SC104 only (not also SC103)
    "no_sync_on_original_project_module": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        class Net(torch.nn.Module):
            def forward(self, x):
                return x

        net = Net()
        model = DDP(net)
        for i, x in enumerate(loader):
            with net.no_sync():  # SC104
                loss = model(x).sum() / 4
                loss.backward()
            if (i + 1) % 4 == 0:
                optimizer.step()
    """,
    # a loss divided in place, and an output given its gradient (GradCache): not SC202
    "loss_divided_in_place": """
        def loop(model, opt, loader, accum):
            for i, x in enumerate(loader):
                loss = model(x)
                loss.div_(accum)
                loss.backward()
                if (i + 1) % accum == 0:
                    opt.step()
                    opt.zero_grad()
    """,
    "loss_not_divided": """
        def loop(model, opt, loader, accum):
            for i, x in enumerate(loader):
                loss = model(x)
                loss.backward()  # SC202
                if (i + 1) % accum == 0:
                    opt.step()
                    opt.zero_grad()
    """,
    "backward_with_explicit_gradient": """
        def step(encoder, optimizer, chunks, grads):
            for chunk, grad in zip(chunks, grads):
                reps = encoder(chunk)
                reps.backward(grad)
            optimizer.step()
            optimizer.zero_grad()
    """,
    # the loop's bound under another name: ``n = len(microbatches)``
    "sync_on_every_micro_step_but_the_last": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(net, opt, microbatches):
            model = DDP(net)
            n = len(microbatches)
            for idx, x in enumerate(microbatches):
                model.require_backward_grad_sync = idx != n - 1  # SC103
                loss = model(x) / n
                loss.backward()
            opt.step()
            opt.zero_grad()
    """,
    "sync_on_the_last_micro_step": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(net, opt, microbatches):
            model = DDP(net)
            n = len(microbatches)
            for idx, x in enumerate(microbatches):
                model.require_backward_grad_sync = idx == n - 1
                loss = model(x) / n
                loss.backward()
            opt.step()
            opt.zero_grad()
    """,
    # ``i < len(samples)``: true on every turn, so the last micro-step runs under no_sync too
    "no_sync_on_every_micro_step": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train_step(net, optimizer, samples):
            model = DDP(net)
            for i, sample in enumerate(samples):
                ctx = model.no_sync() if i < len(samples) else contextlib.nullcontext()
                with ctx:  # SC103
                    loss = model(sample) / len(samples)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """,
    "no_sync_but_on_the_last_micro_step": """
        import contextlib
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train_step(net, optimizer, samples):
            model = DDP(net)
            for i, sample in enumerate(samples):
                ctx = model.no_sync() if i < len(samples) - 1 else contextlib.nullcontext()
                with ctx:
                    loss = model(sample) / len(samples)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """,
    # two wrapped models, one optimizer handed in, no_sync on the encoder only: the decoder syncs
    "no_sync_on_one_of_two_models": """
        from contextlib import nullcontext
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(enc_net, dec_net, opt, loader):
            encoder = DDP(enc_net)
            decoder = DDP(dec_net)
            for i, x in enumerate(loader):
                sync = (i + 1) % 4 == 0
                with nullcontext() if sync else encoder.no_sync():
                    loss = decoder(encoder(x)) / 4
                    loss.backward()  # SC101
                if sync:
                    opt.step()
                    opt.zero_grad()
    """,
    # a GAN steps two optimizers: the generator's loss through D is no accumulation of D
    "gan_generator_loss_through_discriminator": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(gen, disc, opt_g, opt_d, loader, criterion):
            G, D = DDP(gen), DDP(disc)
            for real in loader:
                opt_d.zero_grad()
                fake = G(real.new_randn())
                loss_d = criterion(D(real), 1) + criterion(D(fake.detach()), 0)
                loss_d.backward()
                opt_d.step()
                opt_g.zero_grad()
                loss_g = criterion(D(fake), 1)
                loss_g.backward()
                opt_g.step()
    """,
    # gradients divided before the step are the accumulation's division; a helper nobody calls is not
    "grads_divided_before_the_step": """
        def train(model, optimizer, loader, accum):
            for step, (x, y) in enumerate(loader):
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                if (step + 1) % accum == 0:
                    for p in model.parameters():
                        p.grad /= accum
                    optimizer.step()
                    optimizer.zero_grad()
    """,
    "dead_grad_division_helper": """
        import torch

        def scale_grads(model, n):
            for p in model.parameters():
                p.grad /= n

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # SC202
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_realistic_case(tmp_path, name):
    check_project(tmp_path, {f"{name}.py": CASES[name]})
