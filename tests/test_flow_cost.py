"""What one root's analysis costs: the statements it walks (``Flow.work``) and the properties a loop
head holds (``Flow.peak``, what each statement costs), on shapes real training scripts have. Both are
counts, not timings: the same on every machine."""
import os
import textwrap
from pathlib import Path

from projectlib import check_project, write_project

from synccheck.analyzer.parse import parse
from synccheck.analyzer.project.index import Project
from synccheck.analyzer.project.program import Program


def _program(root: Path, files: dict) -> Program:
    """The whole-program model of the project written to ``root``, every file parsed."""
    write_project(root, files)
    project = Project(roots=[str(root)])
    for name in files:
        path = str(root / name)
        text = Path(path).read_text()
        tree, error = parse(text, path)
        assert error is None, error
        project.add(path, text, tree)
    return Program(project)


def _flows(root: Path, files: dict) -> dict:
    """{root function name: its Flow} for the project written to ``root``."""
    program = _program(root, files)
    flows = {getattr(getattr(f.root, "node", None), "name", os.path.basename(getattr(f.root, "path", "")))
             : f for f in program.flows()}
    assert not program.incomplete
    return flows


def test_a_continue_inside_no_sync_leaves_it(tmp_path):
    # the with's control ends at the continue: the boundary micro-step runs with sync on (this was
    # an SC103 false alarm, the control left on for the next turn)
    check_project(tmp_path, {"train.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def train(net, loader, optimizer, accum):
            model = DDP(net)
            for i, batch in enumerate(loader):
                if (i + 1) % accum != 0:
                    with model.no_sync():
                        loss = model(batch).mean() / accum
                        loss.backward()
                        continue
                loss = model(batch).mean() / accum
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    """})


def test_a_return_inside_a_helpers_no_sync_leaves_it(tmp_path):
    check_project(tmp_path, {"train.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def micro_step(model, batch, accum, last):
            if not last:
                with model.no_sync():
                    loss = model(batch).mean() / accum
                    loss.backward()
                    return loss
            loss = model(batch).mean() / accum
            loss.backward()
            return loss

        def train(net, loader, optimizer, accum):
            model = DDP(net)
            for i, batch in enumerate(loader):
                micro_step(model, batch, accum, (i + 1) % accum == 0)
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})


def test_two_phases_that_leave_their_accumulate_by_continue_stay_small(tmp_path):
    # a GAN script alternating phases, each under accelerator.accumulate, each of which may leave it
    # by continue: every turn used to stack the controls once more (thousands of properties, minutes)
    phases = "\n".join(f"""
            if phase == "{k}":
                with accelerator.accumulate(models[{k}]):
                    loss = models[{k}](batch).mean()
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if not loss.isfinite():
                            optimizers[{k}].zero_grad()
                            continue
                        phase = "{k + 1}"
                        optimizers[{k}].step()
                        optimizers[{k}].zero_grad()""" for k in range(2))
    flows = _flows(tmp_path, {"train.py": """
        from accelerate import Accelerator

        def main(nets, opts, loader):
            accelerator = Accelerator(gradient_accumulation_steps=4)
            models, optimizers = [], []
            for net, opt in zip(nets, opts):
                m, o = accelerator.prepare(net, opt)
                models.append(m)
                optimizers.append(o)
            phase = "0"
            for epoch in range(10):
                for step, batch in enumerate(loader):
PHASES
    """.replace("PHASES", textwrap.indent(textwrap.dedent(phases), " " * 20))})
    assert flows["main"].peak <= 64


def test_loops_inside_a_model_do_not_multiply_the_state(tmp_path):
    # a VAE's tiled encode: loops over tiles and blocks, analysed because the training loop's
    # function calls it with the model; their first iterations are of no test's concern
    flows = _flows(tmp_path, {"train.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def encode(model, x, tiles):
            rows = []
            for row in tiles:
                cols = []
                for col in row:
                    for block in model.blocks:
                        for layer in block:
                            for part in layer:
                                col = part(col)
                    cols.append(model(col))
                rows.append(cols)
            return rows

        def train(net, loader, optimizer, accum):
            model = DDP(net)
            for i, batch in enumerate(loader):
                with model.no_sync():
                    out = encode(model, batch, batch.tiles)
                loss = out.mean() / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """})
    assert flows["train"].peak <= 16


def test_a_dispatch_over_many_classes_is_not_walked(tmp_path):
    # ``self.scheduler.step(...)`` where the scheduler may be any of a library's dozens: each
    # override is long (and runs a backward of its own, as guided diffusion pipelines do); the
    # training loop's analysis does not walk them all
    long_body = "\n".join(f"        if x > {k}:\n            x = x - {k}" for k in range(40)) + "\n        x.backward()"
    classes = "\n".join(f"class Sched{k}(Base):\n    def step(self, x):\n{long_body}\n        return x\n"
                        for k in range(12))
    flows = _flows(tmp_path, {"scheds.py": "class Base:\n    def step(self, x):\n        return x\n\n" + classes,
                              "train.py": """
        from torch.nn.parallel import DistributedDataParallel as DDP
        import scheds

MAKE

        def train(net, loader, optimizer, accum, kind):
            model = DDP(net)
            sched = make(kind)
            for i, batch in enumerate(loader):
                loss = model(batch).mean() / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    sched.step(optimizer)
                    optimizer.step()
                    optimizer.zero_grad()
    """.replace("MAKE", "        def make(kind):\n" + "".join(
        f"            if kind == {k}:\n                return scheds.Sched{k}()\n" for k in range(12)))})
    assert flows["train"].work < 12 * 40


def test_a_classmethod_factory_makes_the_class_it_was_called_on(tmp_path):
    # ``FluxPipeline.from_pretrained(...)``: ``cls(...)`` in the base's classmethod is FluxPipeline,
    # not each of the library's pipelines (whose ``__call__`` the training loop would then walk)
    subclasses = "".join(f"class Pipe{k}(Base):\n    pass\n\n" for k in range(6))
    program = _program(tmp_path, {"pipes.py": "class Base:\n    @classmethod\n    def load(cls, path):\n"
                                              "        return cls()\n\n" + subclasses,
                                  "train.py": "import pipes\n\ndef main():\n    pipe = pipes.Pipe3.load('x')\n"})
    main = next(f for m in program.project.modules() for f in m.functions.values() if f.node.name == "main")
    made = program.values.expr(main.node.body[0].value, main)
    assert {v.cls.node.name for v in made} == {"Pipe3"}


def _mixin_project(classes: int) -> dict:
    """A mixin whose method updates an attribute from itself (diffusers' ``self._merged_adapters =
    self._merged_adapters | names``), ``classes`` pipelines inheriting it, all used in one loop."""
    pipes = "".join(textwrap.dedent(f"""
        class Pipe{k}(Mixin):
            extra{k} = set()

            def __init__(self, unet):
                self.unet = unet

            def load(self, names):
                self.fuse(names)
                return self.merged | self.extra{k}
        """) for k in range(classes))
    mixin = "class Mixin:\n    merged = set()\n\n    def fuse(self, names):\n        self.merged = self.merged | names\n"
    made = "".join(f"    p{k} = Pipe{k}(model)\n" for k in range(classes))
    used = "".join(f"        p{k}.load(b)\n" for k in range(classes))
    train = ("from torch.nn.parallel import DistributedDataParallel as DDP\nfrom pipes import *\n\n\n"
             "def train(net, loader, opt, accum):\n    model = DDP(net)\n" + made +
             "    for i, b in enumerate(loader):\n" + used +
             "        loss = model(b).mean() / accum\n        loss.backward()\n"
             "        if (i + 1) % accum == 0:\n            opt.step()\n            opt.zero_grad()\n")
    return {"pipes.py": mixin + pipes, "train.py": train}


def test_a_self_updating_attribute_of_a_mixin_costs_linear_work(tmp_path):
    # every pipeline's ``merged`` is read through ``self`` of the mixin's method, which may be any of
    # them: one cycle through all the classes. Values dropped and computed again each time the
    # cycle's head moved doubled the work with every class (12 classes: 8,352 values computed)
    spent = {}
    for n in (4, 12):
        program = _program(tmp_path / str(n), _mixin_project(n))
        program.flows()
        spent[n] = program.values.spent
    assert spent[12] < 4 * spent[4], spent


def test_a_setup_helpers_tests_take_no_places_in_the_condition_table(tmp_path):
    # MeZO's trainer fits a linear head before training (``super().train(...)``): a feature pass under
    # torch.no_grad() and a dozen configuration tests. The table holds ten conditions; those tests
    # once took them all, the accumulation boundary came after, and its SC101 was lost
    flags = "\n".join(f"                opt{k} = {k + 2} if self.args.option{k} else 1" for k in range(10))
    flows = _flows(tmp_path, {"train.py": """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        class HeadTrainer:
            def train(self, model, loader, optimizer):
                features = []
                with torch.no_grad():
                    for step, inputs in enumerate(loader):
                        if self.args.probabilities:
                            features.append(model(**inputs).logits)
                        elif self.args.pooled:
                            features.append(model(**inputs).pooler_output)
                        if self.args.limit and step > self.args.limit:
                            break
                use_bias = (model.model_type != "opt" and model.model_type != "gpt2") or self.args.probabilities
        FLAGS
                self.head = self.solve(features, use_bias)

        class Trainer(HeadTrainer):
            def train(self, model, loader, optimizer):
                if self.args.from_linear_head:
                    super().train(model, loader, optimizer)
                model = DDP(model)
                for step, inputs in enumerate(loader):
                    loss = model(**inputs).loss / self.args.accum
                    loss.backward()
                    if (step + 1) % self.args.accum == 0:
                        optimizer.step()
                        optimizer.zero_grad()
    """.replace("        FLAGS", flags)})
    flow = next(f for name, f in flows.items() if name == "train" and f.root.cls.node.name == "Trainer")
    texts = [a.text for a in flow.atoms.atoms]
    assert any("% self.args.accum" in t for t in texts), texts
    assert not flow.atoms.overflowed, texts
