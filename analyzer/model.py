"""Stage 4 of the pipeline: the training-loop model of one module.

The model is built once per parsed file and every rule queries it. It holds:

* ``imports``: local name -> qualified name, from the module's own import statements (no
  whole-file QualifiedNameProvider: that metadata costs ~10x the parse);
* ``wrapped``: names and attribute paths bound to a data-parallel wrapper (DDP, FSDP, ``fully_shard``,
  ``accelerator.prepare``, ``fabric.setup``, ``deepspeed.initialize``), with the ``if`` conditions under
  which the wrapping happened (``if args.distributed: model = DDP(model)``);
* ``functions``: every function and method as a small *training IR* -- only what matters for gradient
  synchronization survives (forward / backward / optimizer step / zero_grad calls, sync controls,
  ``require_backward_grad_sync`` writes, collectives, ``if``/loop/``with`` structure, assignments that
  conditions may read). Calls into functions and methods of the same file are inlined, so a trainer
  whose loop calls ``self._run_batch()`` is seen as one loop.

``paths.py`` then walks the IR of each accumulation loop micro-step by micro-step.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import libcst as cst

# ---------------------------------------------------------------------------------------------------
# Names of things, as torch / accelerate / lightning / deepspeed spell them.

WRAPPER_CALLS = {
    "torch.nn.parallel.DistributedDataParallel": "ddp",
    "torch.nn.parallel.distributed.DistributedDataParallel": "ddp",
    "torch.nn.DistributedDataParallel": "ddp",
    "torch.distributed.fsdp.FullyShardedDataParallel": "fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "fsdp",
    "torch.distributed.fsdp.fully_shard": "fsdp2",
    "torch.distributed._composable.fsdp.fully_shard": "fsdp2",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard": "fsdp2",
    "deepspeed.initialize": "deepspeed",
}
ACCELERATOR_CLASSES = {"accelerate.Accelerator", "accelerate.accelerator.Accelerator"}
FABRIC_CLASSES = {
    "lightning.Fabric", "lightning.fabric.Fabric", "lightning.fabric.fabric.Fabric",
    "lightning_fabric.Fabric", "lightning_fabric.fabric.Fabric",
}
OPTIMIZER_SUFFIXES = (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
    "LBFGS", "SparseAdam", "ASGD", "Adafactor", "Muon", "LAMB", "Lamb", "FusedAdam", "FusedLAMB",
    "AdamW8bit", "Adam8bit", "Lion", "ZeroRedundancyOptimizer",
)
GRADSCALER_NAMES = ("GradScaler",)
# how optimizers are named when they come from elsewhere: optimizer, opt, optG, opt_d, solver, ...
OPTIMIZER_NAME = re.compile(r"(?i)^(?:\w*optim\w*|opt(?!ion)[A-Za-z0-9_]{0,3}|solver\w*)$")
NO_GRAD_CONTEXTS = {"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad",
                    "torch.autograd.grad_mode.no_grad", "torch.autograd.inference_mode"}
COLLECTIVES = {
    "barrier", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "all_to_all", "all_to_all_single", "gather_object", "scatter_object_list", "monitored_barrier",
}
# ``accelerator.*`` / ``fabric.*`` methods that are collectives too.
FRAMEWORK_COLLECTIVES = {"wait_for_everyone", "gather", "gather_for_metrics", "reduce", "all_reduce",
                         "all_gather", "broadcast", "barrier"}

DP_KINDS = ("ddp", "fsdp", "fsdp2", "accelerate", "fabric")
# DDP decides at *forward* time whether the next backward all-reduces (reducer.prepare_for_backward
# in _post_forward); FSDP reads its switch during backward.
FORWARD_DECIDES = ("ddp", "accelerate", "fabric")


def dotted(node: cst.CSTNode) -> Optional[str]:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    # exact type tests: libcst's node classes are ABCs, and isinstance on them was a tenth of a big
    # file's analysis (Name and Attribute have no subclasses)
    parts = []
    while type(node) is cst.Attribute:
        parts.append(node.attr.value)
        node = node.value
    if type(node) is cst.Name:
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def last_part(name: Optional[str]) -> str:
    """``a.b.c`` -> ``c``; a function-local key ``train:opt`` -> ``opt``."""
    return name.split(":", 1)[-1].rsplit(".", 1)[-1] if name else ""


# ---------------------------------------------------------------------------------------------------
# Facts

@dataclass
class Wrapped:
    """A name or attribute path bound to a data-parallel wrapper."""
    key: str                       # "model", "@Trainer.model" for self.model in class Trainer
    kind: str                      # ddp, fsdp, fsdp2, accelerate, fabric, deepspeed
    node: cst.CSTNode              # the wrapping call (reported by SC106)
    conds: tuple = ()              # ((atom, polarity), ...) under which the wrapping happened
    options: dict = field(default_factory=dict)   # static_graph, ...
    inferred: bool = False         # only known from use (``x.no_sync()``), not from construction


@dataclass
class FrameworkObject:
    """An ``Accelerator(...)`` / ``Fabric(...)`` object and how it was configured."""
    key: str
    kind: str                      # accelerate | fabric
    node: cst.Call
    kwargs: dict                   # keyword -> expression node


# ---------------------------------------------------------------------------------------------------
# Training IR. Plain dataclasses; ``node`` is the libcst node to report at.

@dataclass
class Event:
    kind: str                      # forward | backward | step | zero_grad | collective | yield
    node: cst.CSTNode
    model: Optional[str] = None    # forward: wrapped key; backward: engine key if known
    target: Optional[str] = None   # step/zero_grad: object key; collective: function name
    via: str = ""                  # backward: "loss.backward", "accelerator.backward", ...
    arg: Optional[cst.BaseExpression] = None   # backward: the loss expression


@dataclass
class Flag:
    """``model.require_backward_grad_sync = value`` / ``model.set_requires_gradient_sync(value)``."""
    model: str
    value: cst.BaseExpression
    node: cst.CSTNode


@dataclass
class Assign:
    name: str
    value: cst.BaseExpression
    node: cst.CSTNode


@dataclass
class If:
    test: cst.BaseExpression
    body: list
    orelse: list
    node: cst.CSTNode


@dataclass
class Loop:
    node: Union[cst.For, cst.While]
    body: list
    target: Optional[str] = None   # for-loop target (first name)
    iter: Optional[cst.BaseExpression] = None
    test: Optional[cst.BaseExpression] = None


@dataclass
class With:
    items: list                    # with-item expressions
    body: list
    node: cst.With
    no_grad: bool = False
    ctx: object = None             # the scope its names are resolved in (aliases of an inlined call)


@dataclass
class Exit:
    kind: str                      # continue | break | return | raise
    node: cst.CSTNode
    value: Optional[cst.BaseExpression] = None


@dataclass
class Inline:
    """A same-file function or method inlined at its call site."""
    name: str
    call: cst.Call
    body: list


IRNode = Union[Event, Flag, Assign, If, Loop, With, Exit, Inline]


@dataclass
class Function:
    name: str                      # "train", "Trainer._run_batch", "<module>"
    node: cst.CSTNode
    class_name: Optional[str]
    body: list                     # IR
    is_contextmanager: bool = False


# ---------------------------------------------------------------------------------------------------

def walk_ir(nodes: Sequence, into_loops: bool = True) -> Iterator:
    for n in nodes:
        yield n
        if isinstance(n, If):
            yield from walk_ir(n.body, into_loops)
            yield from walk_ir(n.orelse, into_loops)
        elif isinstance(n, (With, Inline)):
            yield from walk_ir(n.body, into_loops)
        elif isinstance(n, Loop) and into_loops:
            yield from walk_ir(n.body, into_loops)


def has_event(nodes: Sequence, kind: str, into_loops: bool = True) -> bool:
    return any(isinstance(n, Event) and n.kind == kind for n in walk_ir(nodes, into_loops))


class ModuleModel:
    """Everything the rules need to know about one module."""

    def __init__(self, module: cst.Module, path: str = "<string>", source: Optional[str] = None) -> None:
        self.module = module
        self.path = path
        self.imports: dict[str, str] = {}
        self.wrapped: dict[str, list[Wrapped]] = {}
        self.optimizers: dict[str, cst.CSTNode] = {}
        self.framework: dict[str, FrameworkObject] = {}
        self.scalers: set[str] = set()
        self.samplers: dict[str, cst.CSTNode] = {}
        self.defs: dict[str, tuple[cst.FunctionDef, Optional[str]]] = {}   # "f" / "Cls.m" -> def
        self.classes: dict[str, cst.ClassDef] = {}
        self.framework_setattrs: list[tuple[str, str, cst.CSTNode]] = []   # (obj key, attr, node)
        # the module a wrapper was built from, when the wrapper got another name: model -> ddp_model
        self.originals: dict[str, str] = {}
        # every sync control call: (call node, key of what it names, how it was spelled)
        self.sync_calls: list[tuple[cst.Call, Optional[str], str]] = []
        # ``accelerator.accumulate(model)`` calls: (call node, accelerator key)
        self.accumulate_calls: list[tuple[cst.Call, Optional[str]]] = []
        # optimizers whose zero_grad() is a no-op off the boundary (accelerate, DeepSpeed)
        self.managed_optimizers: set[str] = set()
        # synccheck.runtime objects: GradientAccumulator key -> its model; models under LocalSGD
        self.accumulators: dict[str, Optional[str]] = {}
        self.local_sgd_models: set[str] = set()
        # optimizer -> the model whose parameters it was built on (two models, two step schedules)
        self.optimizer_model: dict[str, str] = {}
        # loops over epochs: ``for epoch in ...`` or a loop holding another loop
        self.epoch_loops: list[cst.CSTNode] = []
        self.locals: dict[str, set] = {}      # function -> names it assigns (Python's local names)
        # reported node -> the statement that holds it (its function, or a top-level statement):
        # positions are computed for that statement alone, not the whole file
        self.owner: dict[int, cst.CSTNode] = {}
        self._top: Optional[cst.CSTNode] = None
        self._fn: Optional[str] = None        # the function the facts pass is in
        self._source: Optional[str] = source
        self._atom_cache: dict[int, str] = {}
        self._code_cache: dict = {}     # id(node) -> (node, source text)
        self._calls_cache: dict = {}    # id(expr) -> (expr, the calls in it)
        self._expr_cache: dict[str, Optional[ast.AST]] = {}
        self._collect_defs(module.body, None)
        self._collect_imports()
        self._collect_facts(module.body, None, ())
        self.functions: list[Function] = self._build_functions()
        self.function_named: dict[str, Function] = {f.name: f for f in self.functions}

    # -- source text -------------------------------------------------------------------------------
    @property
    def source(self) -> str:
        if self._source is None:
            self._source = self.module.code
        return self._source

    def code(self, node: cst.CSTNode) -> str:
        # libcst regenerates the text on every call, and the path walk asks for the same few condition
        # nodes hundreds of times (415 calls on 11 nodes in one 213-line torch file)
        hit = self._code_cache.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1]
        text = self.module.code_for_node(node)
        self._code_cache[id(node)] = (node, text)
        return text

    def _calls(self, expr) -> list:
        """``_calls(expr)``, walked once per expression: a helper inlined at many call sites is not
        walked again at each (the node is kept beside its result, so a reused id never matches)."""
        hit = self._calls_cache.get(id(expr))
        if hit is not None and hit[0] is expr:
            return hit[1]
        out = _calls(expr)
        self._calls_cache[id(expr)] = (expr, out)
        return out

    def atom(self, node: cst.BaseExpression) -> str:
        """A canonical, parenthesis- and whitespace-insensitive key for a condition expression."""
        cached = self._atom_cache.get(id(node))
        if cached is not None:
            return cached
        tree = self.expr_ast(node)
        key = ast.dump(tree) if tree is not None else "".join(self.code(node).split())
        self._atom_cache[id(node)] = key
        return key

    def expr_ast(self, node) -> Optional[ast.AST]:
        """The stdlib-ast form of an expression (cached by its text): conditions are compared as ASTs."""
        text = self.code(node).strip()
        if text not in self._expr_cache:
            try:
                self._expr_cache[text] = ast.parse("(" + text + ")", mode="eval").body
            except SyntaxError:
                self._expr_cache[text] = None
        return self._expr_cache[text]

    # -- imports -----------------------------------------------------------------------------------
    def _collect_imports(self) -> None:
        for node in _small_statements(self.module.body):
            if isinstance(node, cst.Import):
                for alias in node.names:
                    full = dotted(alias.name)
                    if not full:
                        continue
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        self.imports[alias.asname.name.value] = full
                    else:
                        top = full.split(".")[0]
                        self.imports.setdefault(top, top)
            elif isinstance(node, cst.ImportFrom) and not node.relative and node.module is not None:
                base = dotted(node.module)
                if not base or isinstance(node.names, cst.ImportStar):
                    continue
                for alias in node.names:
                    name = dotted(alias.name)
                    local = alias.asname.name.value if (alias.asname is not None and
                                                        isinstance(alias.asname.name, cst.Name)) else name
                    if name and local:
                        self.imports[local] = f"{base}.{name}"

    def qualify(self, name: Optional[str]) -> str:
        """Resolve the first segment of a dotted name through the module's imports."""
        if not name:
            return ""
        head, _, rest = name.partition(".")
        full = self.imports.get(head)
        if full is None:
            return name
        return f"{full}.{rest}" if rest else full

    # -- keys ----------------------------------------------------------------------------------------
    @staticmethod
    def key_for(name: Optional[str], class_name: Optional[str]) -> Optional[str]:
        """``self.model`` inside class C becomes ``@C.model``: visible from every method of C."""
        if name and class_name and (name == "self" or name.startswith("self.")):
            return f"@{class_name}{name[4:]}"
        return name

    def scoped(self, name: Optional[str], class_name: Optional[str], fn: Optional[str] = "") -> Optional[str]:
        """The key of a name where it is used: ``self.x`` is the class's, a local is its function's
        (``train:model``), anything else is the module's. ``fn=""``: the function the facts pass is in."""
        if not name:
            return name
        if name == "self" or name.startswith("self."):
            return self.key_for(name, class_name)
        fn = self._fn if fn == "" else fn
        if fn and name.split(".")[0] in self.locals.get(fn, ()):
            return f"{fn}:{name}"
        return name

    def lookup(self, key: Optional[str]) -> list[Wrapped]:
        return self.wrapped.get(key, []) if key else []

    def is_optimizer(self, key: Optional[str]) -> bool:
        if not key:
            return False
        if key in self.optimizers:
            return True
        entries = self.lookup(key)
        if entries and all(w.kind in ("accelerate", "fabric") for w in entries) and "optim" in key.lower():
            return True
        tail = last_part(key)
        return bool(OPTIMIZER_NAME.match(tail)) and "sched" not in tail.lower()

    def is_scaler(self, key: Optional[str]) -> bool:
        return bool(key) and (key in self.scalers or "scaler" in last_part(key).lower())

    def framework_kind(self, key: Optional[str]) -> Optional[str]:
        """accelerate / fabric for an Accelerator / Fabric object, by construction or by its usual name."""
        if not key:
            return None
        obj = self.framework.get(key)
        if obj is not None:
            return obj.kind
        tail = last_part(key)
        if tail in ("accelerator", "accel"):
            return "accelerate"
        if tail == "fabric":
            return "fabric"
        return None

    # -- facts pass ----------------------------------------------------------------------------------
    def _collect_defs(self, stmts, class_name: Optional[str]) -> None:
        for stmt in stmts:
            if isinstance(stmt, cst.FunctionDef):
                qual = f"{class_name}.{stmt.name.value}" if class_name else stmt.name.value
                self.defs.setdefault(qual, (stmt, class_name))
                self.locals.setdefault(qual, _assigned_names(stmt))
            elif isinstance(stmt, cst.ClassDef):
                self.classes.setdefault(stmt.name.value, stmt)
                if isinstance(stmt.body, cst.IndentedBlock):
                    self._collect_defs(stmt.body.body, stmt.name.value)
            elif isinstance(stmt, cst.If):
                self._collect_defs(_block(stmt.body), class_name)
                for orelse in _orelse_blocks(stmt):
                    self._collect_defs(orelse, class_name)
            elif isinstance(stmt, (cst.Try,)):
                self._collect_defs(_block(stmt.body), class_name)

    def _cond_lits(self, conds) -> tuple:
        return tuple((self.atom(test), polarity) for test, polarity in conds
                     if not isinstance(test, cst.Name) or test.value not in ("True", "False"))

    def _add_wrapped(self, key: Optional[str], kind: str, node: cst.CSTNode, conds, options=None,
                     inferred: bool = False) -> None:
        if not key:
            return
        self._own(node)
        entry = Wrapped(key, kind, node, self._cond_lits(conds), dict(options or {}), inferred)
        self.wrapped.setdefault(key, []).append(entry)

    def _own(self, node) -> None:
        """Remember which statement holds a node a rule may report (facts pass)."""
        holder = self.defs.get(self._fn, (None,))[0] if self._fn else self._top
        if holder is not None:
            self.owner[id(node)] = holder

    def _collect_facts(self, stmts, class_name: Optional[str], conds: tuple) -> None:
        for stmt in stmts:
            if class_name is None and self._fn is None and not conds:
                self._top = stmt
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    self._fact_small(small, class_name, conds)
            elif isinstance(stmt, cst.If):
                self._fact_expr(stmt.test, class_name, conds)
                self._collect_facts(_block(stmt.body), class_name, conds + ((stmt.test, True),))
                neg = conds + ((stmt.test, False),)
                orelse = stmt.orelse
                if isinstance(orelse, cst.If):
                    self._collect_facts([orelse], class_name, neg)
                elif isinstance(orelse, cst.Else):
                    self._collect_facts(_block(orelse.body), class_name, neg)
            elif isinstance(stmt, cst.FunctionDef):
                outer = self._fn
                qual = f"{class_name}.{stmt.name.value}" if class_name else stmt.name.value
                self._fn = qual if self.defs.get(qual, (None,))[0] is stmt else None
                self._collect_facts(_block(stmt.body), class_name, ())
                self._fn = outer
            elif isinstance(stmt, cst.ClassDef):
                self._collect_facts(_block(stmt.body), stmt.name.value, ())
            elif isinstance(stmt, (cst.For, cst.While, cst.With, cst.Try)):
                if isinstance(stmt, cst.With):
                    for item in stmt.items:
                        self._fact_expr(item.item, class_name, conds)
                elif isinstance(stmt, cst.For):
                    self._fact_expr(stmt.iter, class_name, conds)
                    target = dotted(stmt.target) or ""
                    if "epoch" in target or _holds_loop(_block(stmt.body)):
                        self.epoch_loops.append(stmt)
                self._collect_facts(_block(stmt.body), class_name, conds)
                if isinstance(stmt, cst.Try):
                    for handler in stmt.handlers:
                        self._collect_facts(_block(handler.body), class_name, conds)
                    if stmt.finalbody is not None:
                        self._collect_facts(_block(stmt.finalbody.body), class_name, conds)
                elif getattr(stmt, "orelse", None) is not None:
                    self._collect_facts(_block(stmt.orelse.body), class_name, conds)

    def _fact_small(self, small, class_name, conds) -> None:
        if isinstance(small, cst.Assign):
            targets = [t.target for t in small.targets]
            for target in targets:
                self._fact_assign(target, small.value, class_name, conds)
                if isinstance(target, cst.Attribute) and target.attr.value in (
                        "require_backward_grad_sync", "require_forward_param_sync"):
                    self._infer_ddp(dotted(target.value), class_name, small)
                if isinstance(target, cst.Attribute) and target.attr.value == "gradient_accumulation_steps":
                    obj = self.scoped(dotted(target.value), class_name)
                    if obj:
                        self.framework_setattrs.append((obj, "gradient_accumulation_steps", small))
            self._fact_expr(small.value, class_name, conds)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self._fact_assign(small.target, small.value, class_name, conds)
            self._fact_expr(small.value, class_name, conds)
        elif isinstance(small, cst.Expr):
            self._fact_expr(small.value, class_name, conds)

    def _fact_expr(self, expr, class_name, conds) -> None:
        """Wrapping done by a bare call (``fully_shard(model)``) and sync calls that reveal a wrapper."""
        for call in self._calls(expr):
            func = dotted(call.func)
            q = self.qualify(func)
            if WRAPPER_CALLS.get(q) == "fsdp2" and call.args:
                self._add_wrapped(self.scoped(dotted(call.args[0].value), class_name), "fsdp2", call, conds)
            if isinstance(call.func, cst.Attribute):
                attr = call.func.attr.value
                obj = dotted(call.func.value)
                args = [a.value for a in call.args if a.keyword is None]
                owner = self.scoped(obj, class_name)
                if attr in ("no_sync", "no_backward_sync", "accumulate"):
                    self._own(call)
                if attr == "no_sync" and not call.args:
                    self.sync_calls.append((call, owner, f"{obj}.no_sync()"))
                    self._infer_ddp(obj, class_name, call)
                elif attr in ("no_sync", "no_backward_sync") and args and self.framework_kind(owner):
                    target = self.scoped(dotted(args[0]), class_name)
                    self.sync_calls.append((call, target, f"{obj}.{attr}({dotted(args[0]) or '...'})"))
                elif attr == "accumulate" and self.framework_kind(owner) == "accelerate":
                    self.accumulate_calls.append((call, owner))
                elif attr == "set_requires_gradient_sync":
                    key = self.scoped(obj, class_name)
                    if key and not self.lookup(key):
                        self._add_wrapped(key, "fsdp2", call, (), inferred=True)

    def _infer_ddp(self, name: Optional[str], class_name, node) -> None:
        key = self.scoped(name, class_name)
        # ``model.module.no_sync()`` names the unwrapped module: SC104's business, not a wrapper.
        if key and not self.lookup(key) and not key.endswith(".module") and key not in self.framework \
                and key not in self.originals:
            self._add_wrapped(key, "ddp", node, (), inferred=True)

    def _fact_assign(self, target, value, class_name, conds) -> None:
        if isinstance(value, cst.IfExp):
            # model = DDP(model) if distributed else model
            self._fact_assign(target, value.body, class_name, conds + ((value.test, True),))
            self._fact_assign(target, value.orelse, class_name, conds + ((value.test, False),))
            return
        if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) \
                and len(target.elements) == len(value.elements):
            # a, b = DDP(a), DDP(b)
            for t, v in zip(target.elements, value.elements):
                self._fact_assign(t.value, v.value, class_name, conds)
            return
        names = _target_names(target)
        keys = [self.scoped(n, class_name) if n else None for n in names]
        if isinstance(value, (cst.Name, cst.Attribute)):
            # an alias of a wrapped model is the wrapped model (``model = model`` adds nothing)
            src = self.scoped(dotted(value), class_name)
            if len(keys) == 1 and keys[0] and keys[0] != src and self.lookup(src):
                for w in list(self.lookup(src)):
                    self._add_wrapped(keys[0], w.kind, w.node, (), w.options, w.inferred)
                    self.wrapped[keys[0]][-1].conds = w.conds + self._cond_lits(conds)
            return
        if not isinstance(value, cst.Call):
            return
        func = dotted(value.func)
        q = self.qualify(func)
        kind = WRAPPER_CALLS.get(q)
        if kind is None and len(keys) == 1 and keys[0] and func in self.defs:
            # model = build_model(args), where build_model returns a wrapper it made
            fdef = self.defs[func][0]
            for small in _small_statements(_block(fdef.body)):
                if isinstance(small, cst.Return) and isinstance(small.value, (cst.Name, cst.Attribute)):
                    for w in list(self.lookup(self.scoped(dotted(small.value), None, fn=func))):
                        self._add_wrapped(keys[0], w.kind, w.node, (), w.options, w.inferred)
            return
        if kind == "deepspeed":
            if keys and keys[0]:
                self._add_wrapped(keys[0], "deepspeed", value, conds)
            if len(keys) > 1 and keys[1]:
                self.optimizers[keys[1]] = value
                self.managed_optimizers.add(keys[1])
            return
        if kind:
            options = {}
            for arg in value.args:
                if arg.keyword is not None and arg.keyword.value == "static_graph":
                    options["static_graph"] = arg.value
            if len(keys) == 1:
                self._add_wrapped(keys[0], kind, value, conds, options)
                source = self.scoped(dotted(value.args[0].value), class_name) if value.args else None
                if source and keys[0] and source != keys[0] and kind != "fsdp2":
                    self.originals[source] = keys[0]
            if kind == "fsdp2" and value.args:
                self._add_wrapped(self.scoped(dotted(value.args[0].value), class_name), kind, value, conds)
            return
        if last_part(q) in ("GradientAccumulator", "LocalSGD") and (q.startswith("synccheck") or "." not in q):
            # synccheck's own fix: sync handled by the object (accumulate()) or off by design (local SGD)
            model_key = self.scoped(dotted(value.args[0].value), class_name) if value.args else None
            if last_part(q) == "LocalSGD" and model_key:
                self.local_sgd_models.add(model_key.split(":", 1)[-1])
            elif len(keys) == 1 and keys[0]:
                self.accumulators[keys[0]] = model_key
            return
        if q in ACCELERATOR_CLASSES or q in FABRIC_CLASSES:
            if len(keys) == 1 and keys[0]:
                kw = {a.keyword.value: a.value for a in value.args if a.keyword is not None}
                self.framework[keys[0]] = FrameworkObject(
                    keys[0], "accelerate" if q in ACCELERATOR_CLASSES else "fabric", value, kw)
            return
        if last_part(q).endswith(GRADSCALER_NAMES):
            for k in keys:
                if k:
                    self.scalers.add(k)
            return
        if last_part(q) == "DistributedSampler" or last_part(q).endswith("DistributedSampler"):
            for k in keys:
                if k:
                    self.samplers[k] = value
                    self._own(value)
            return
        if isinstance(value.func, cst.Attribute):
            attr = value.func.attr.value
            owner = self.scoped(dotted(value.func.value), class_name)
            fkind = self.framework_kind(owner)
            if fkind == "accelerate" and attr in ("prepare", "prepare_model", "prepare_optimizer"):
                args = [a.value for a in value.args if a.keyword is None]
                for i, k in enumerate(keys):
                    arg_key = self.scoped(dotted(args[i]), class_name) if i < len(args) else None
                    if attr == "prepare_optimizer" or (arg_key and arg_key in self.optimizers) or \
                            (k and "optim" in last_part(k).lower()):
                        if k:
                            self.optimizers[k] = value
                            self.managed_optimizers.add(k)
                        continue
                    self._add_wrapped(k, "accelerate", value, conds)
                    if arg_key and k and arg_key != k:
                        self.originals[arg_key] = k
                return
            if fkind == "fabric" and attr in ("setup", "setup_module", "setup_optimizers"):
                args = [a.value for a in value.args if a.keyword is None]
                for i, k in enumerate(keys):
                    if attr == "setup_optimizers" or (attr == "setup" and i > 0):
                        if k:
                            self.optimizers[k] = value
                    else:
                        self._add_wrapped(k, "fabric", value, conds)
                        arg_key = self.scoped(dotted(args[i]), class_name) if i < len(args) else None
                        if arg_key and k and arg_key != k:
                            self.originals[arg_key] = k
                return
        if q.startswith("torch.optim.") or last_part(q).endswith(OPTIMIZER_SUFFIXES):
            if len(keys) == 1 and keys[0] and not last_part(q).endswith("LR") and "lr_scheduler" not in q:
                self.optimizers[keys[0]] = value
                first = value.args[0].value if value.args else None
                # SGD(model.parameters(), ...) / SGD(model.module.parameters()) / SGD([{"params": ...}])
                if isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute) and \
                        first.func.attr.value in ("parameters", "named_parameters"):
                    owner = self.scoped(dotted(first.func.value), class_name)
                    if owner:
                        owner = owner[:-7] if owner.endswith(".module") else owner
                        self.optimizer_model[keys[0]] = self.originals.get(owner, owner)

    # -- IR ------------------------------------------------------------------------------------------
    def _build_functions(self) -> list[Function]:
        top: list = []
        for stmt in self.module.body:
            top.extend(self._stmt(stmt, _Ctx(None, owner=stmt)))
        functions = [Function("<module>", self.module, None, top)]
        for qual, (fdef, class_name) in self.defs.items():
            functions.append(Function(qual, fdef, class_name,
                                      self._block(_block(fdef.body), _Ctx(class_name, stack=(qual,), owner=fdef)),
                                      is_contextmanager=_is_contextmanager(fdef)))
        return functions

    def _block(self, stmts, ctx: "_Ctx") -> list:
        out: list = []
        for stmt in stmts:
            out.extend(self._stmt(stmt, ctx))
        return out

    def _stmt(self, stmt, ctx: "_Ctx") -> list:
        if isinstance(stmt, cst.SimpleStatementLine):
            out: list = []
            for small in stmt.body:
                out.extend(self._small(small, stmt, ctx))
            return out
        if isinstance(stmt, cst.If):
            out = self._expr_events(stmt.test, ctx)
            body = self._block(_block(stmt.body), ctx)
            orelse: list = []
            if isinstance(stmt.orelse, cst.If):
                orelse = self._stmt(stmt.orelse, ctx)
            elif isinstance(stmt.orelse, cst.Else):
                orelse = self._block(_block(stmt.orelse.body), ctx)
            if body or orelse:
                out.append(If(stmt.test, body, orelse, stmt))
            return out
        if isinstance(stmt, cst.For):
            body = self._block(_block(stmt.body), ctx)
            names = _target_names(stmt.target)
            target = names[0] if names else None
            out = self._expr_events(stmt.iter, ctx)
            if body:
                out.append(Loop(stmt, body, target=target, iter=stmt.iter))
            return out
        if isinstance(stmt, cst.While):
            body = self._block(_block(stmt.body), ctx)
            return [Loop(stmt, body, test=stmt.test)] if body else []
        if isinstance(stmt, cst.With):
            items = [item.item for item in stmt.items]
            no_grad = any(self._is_no_grad(item) for item in items)
            body = self._block(_block(stmt.body), ctx)
            pre: list = []
            for item in items:
                if isinstance(item, cst.Call) and not self._is_control_call(item, ctx):
                    pre.extend(self._expr_events(item, ctx, skip_self=True))
            self.owner[id(stmt)] = ctx.owner
            return pre + [With(items, body, stmt, no_grad, ctx)]
        if isinstance(stmt, cst.Try):
            out = self._block(_block(stmt.body), ctx)
            if stmt.orelse is not None:
                out.extend(self._block(_block(stmt.orelse.body), ctx))
            if stmt.finalbody is not None:
                out.extend(self._block(_block(stmt.finalbody.body), ctx))
            return out
        return []   # nested defs and classes are functions of their own; match statements are rare here

    def _small(self, small, line, ctx: "_Ctx") -> list:
        if isinstance(small, cst.Expr):
            if isinstance(small.value, cst.Yield):
                return self._expr_events(small.value.value, ctx) + [Event("yield", small)]
            return self._expr_events(small.value, ctx)
        if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
            value = small.value
            if value is None:
                return []
            out = self._expr_events(value, ctx)
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
            for target in targets:
                if isinstance(target, cst.Name) and isinstance(small, cst.AugAssign):
                    # ``loss /= n``: remembered as ``loss = loss / n`` for rules that trace the loss
                    out.append(Assign(target.value, cst.BinaryOperation(target, _binop(small.operator), value), line))
                elif isinstance(target, cst.Name):
                    out.append(Assign(target.value, value, line))
                elif isinstance(target, cst.Attribute) and target.attr.value == "require_backward_grad_sync":
                    key = self.resolve(target.value, ctx)
                    if key:
                        self.owner[id(line)] = ctx.owner
                        out.append(Flag(key, value, line))
                elif isinstance(target, (cst.Tuple, cst.List)):
                    for name in _target_names(target):
                        if name and "." not in name:
                            out.append(Assign(name, cst.Name("__unknown__"), line))
            return out
        if isinstance(small, cst.Return):
            out = self._expr_events(small.value, ctx) if small.value is not None else []
            return out + [Exit("return", line, small.value)]
        if isinstance(small, cst.Continue):
            return [Exit("continue", line)]
        if isinstance(small, cst.Break):
            return [Exit("break", line)]
        if isinstance(small, cst.Raise):
            return [Exit("raise", line)]
        return []

    def resolve(self, expr, ctx: "_Ctx") -> Optional[str]:
        """The key an expression names, following parameters of inlined calls to the caller's names."""
        name = dotted(expr) if expr is not None else None
        if not name:
            return None
        head, _, rest = name.partition(".")
        if head in ctx.aliases:
            base = ctx.aliases[head]
            if base is None:
                return None
            return f"{base}.{rest}" if rest else base
        return self.scoped(name, ctx.class_name, fn=ctx.stack[-1] if ctx.stack else None)

    def _is_no_grad(self, item) -> bool:
        if isinstance(item, cst.Call):
            q = self.qualify(dotted(item.func))
            if q in NO_GRAD_CONTEXTS:
                return True
            if q in ("torch.set_grad_enabled", "torch.enable_grad") and item.args:
                v = item.args[0].value
                return isinstance(v, cst.Name) and v.value == "False"
        return False

    def _is_control_call(self, call: cst.Call, ctx) -> bool:
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in (
                "no_sync", "accumulate", "no_backward_sync"):
            return True
        return self._local_def(call, ctx) is not None

    def _local_def(self, call: cst.Call, ctx: "_Ctx"):
        name = dotted(call.func)
        if not name:
            return None
        if name.startswith("self.") and ctx.class_name and name.count(".") == 1:
            qual = f"{ctx.class_name}.{name[5:]}"
        elif "." not in name and name not in ctx.aliases:
            qual = name
        else:
            return None
        found = self.defs.get(qual)
        return (qual, found) if found else None

    def _expr_events(self, expr, ctx: "_Ctx", skip_self: bool = False) -> list:
        out: list = []
        if expr is None:
            return out
        for call in self._calls(expr):
            if skip_self and call is expr:
                continue
            events = self._call_events(call, ctx)
            if events:
                self.owner[id(call)] = ctx.owner
            out.extend(events)
        return out

    def _call_events(self, call: cst.Call, ctx: "_Ctx") -> list:
        func = call.func
        key = self.resolve(func, ctx)
        if isinstance(func, cst.Attribute):
            attr = func.attr.value
            obj_key = self.resolve(func.value, ctx)
            if attr == "backward" and obj_key in self.accumulators:
                # GradientAccumulator.backward divides by the window and runs the backward itself
                return [Event("backward", call, via="accumulator.backward",
                              arg=call.args[0].value if call.args else None)]
            if attr == "backward":
                engine = None
                via = "loss.backward"
                fk = self.framework_kind(obj_key)
                if fk:
                    via = f"{fk}.backward"
                elif obj_key and self.lookup(obj_key):
                    engine, via = obj_key, "engine.backward"
                elif isinstance(func.value, cst.Call) and isinstance(func.value.func, cst.Attribute) \
                        and func.value.func.attr.value == "scale":
                    via = "scaler.scale(loss).backward"
                loss = call.args[0].value if (fk or engine) and call.args else func.value
                return [Event("backward", call, model=engine, via=via, arg=loss)]
            if attr == "step":
                if obj_key and any(w.kind == "deepspeed" for w in self.lookup(obj_key)):
                    return [Event("step", call, model=obj_key, target=obj_key)]
                if self.is_scaler(obj_key) and call.args:
                    return [Event("step", call, target=self.resolve(call.args[0].value, ctx))]
                if self.is_optimizer(obj_key):
                    return [Event("step", call, target=obj_key)]
                if isinstance(func.value, cst.Subscript) and "optim" in self.code(func.value):
                    return [Event("step", call, target=self.code(func.value).strip())]   # state["optimizer"]
                return []
            if attr == "zero_grad":
                return [Event("zero_grad", call, target=obj_key)]
            if attr == "set_requires_gradient_sync" and obj_key and call.args:
                return [Flag(obj_key, call.args[0].value, call)]
            if attr in COLLECTIVES and self.qualify(dotted(func.value)) in ("torch.distributed",):
                return [Event("collective", call, target=attr)]
            if attr in FRAMEWORK_COLLECTIVES and self.framework_kind(obj_key):
                return [Event("collective", call, target=f"{last_part(obj_key)}.{attr}")]
            if attr == "average_parameters":
                # torch.distributed.algorithms.model_averaging: local SGD averages parameters by design
                return [Event("collective", call, target="average_parameters")]
            if attr == "forward" and obj_key and self.lookup(obj_key):
                return [Event("forward", call, model=obj_key)]
        q = self.qualify(dotted(func))
        if q == "torch.autograd.backward":
            return [Event("backward", call, via="torch.autograd.backward",
                          arg=call.args[0].value if call.args else None)]
        if q.startswith("torch.distributed.") and last_part(q) in COLLECTIVES and q.count(".") == 2:
            return [Event("collective", call, target=last_part(q))]
        if key and self.lookup(key):
            return [Event("forward", call, model=key)]
        local = self._local_def(call, ctx)
        if local is not None:
            return self._inline(call, local, ctx)
        return []

    def _inline(self, call: cst.Call, local, ctx: "_Ctx") -> list:
        qual, (fdef, class_name) = local
        if qual in ctx.stack or len(ctx.stack) >= 6:
            return []
        params = [p for p in fdef.params.params]
        if class_name and params and params[0].name.value in ("self", "cls") and \
                dotted(call.func).startswith("self."):
            params = params[1:]
        aliases: dict[str, Optional[str]] = {}
        binds: list = []
        positional = [a for a in call.args if a.keyword is None and not a.star]
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        all_params = params + list(fdef.params.kwonly_params)
        for i, p in enumerate(all_params):
            pname = p.name.value
            arg = positional[i].value if i < len(positional) and p in params else keywords.get(pname, p.default)
            if arg is None:
                aliases[pname] = None
                continue
            aliases[pname] = self.resolve(arg, ctx) if isinstance(arg, (cst.Name, cst.Attribute)) else None
            binds.append(Assign(pname, arg, call))
        inner = _Ctx(class_name if class_name else ctx.class_name, aliases, ctx.stack + (qual,), owner=fdef)
        body = binds + self._block(_block(fdef.body), inner)
        return [Inline(qual, call, body)] if len(body) > len(binds) else []


@dataclass
class _Ctx:
    class_name: Optional[str]
    aliases: dict = field(default_factory=dict)
    stack: tuple = ()
    owner: Optional[cst.CSTNode] = None      # the function (or top-level statement) being built


# ---------------------------------------------------------------------------------------------------
# small libcst helpers

def _assigned_names(fdef: cst.FunctionDef) -> set:
    """Names a function binds: parameters, assignment and loop targets, ``with ... as`` names."""
    names = {p.name.value for p in list(fdef.params.params) + list(fdef.params.kwonly_params)
             + list(fdef.params.posonly_params)}
    for extra in (fdef.params.star_arg, fdef.params.star_kwarg):
        if isinstance(extra, cst.Param):
            names.add(extra.name.value)

    def visit(stmts) -> None:
        for stmt in stmts:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else \
                        [small.target] if isinstance(small, (cst.AnnAssign, cst.AugAssign)) else []
                    for t in targets:
                        names.update(n.split(".")[0] for n in _target_names(t) if n and "." not in n)
            elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                names.add(stmt.name.value)
            elif isinstance(stmt, cst.With):
                for item in stmt.items:
                    if item.asname is not None:
                        names.update(n for n in _target_names(item.asname.name) if n and "." not in n)
                visit(_block(stmt.body))
            elif isinstance(stmt, cst.For):
                names.update(n for n in _target_names(stmt.target) if n and "." not in n)
                visit(_block(stmt.body))
            elif isinstance(stmt, cst.If):
                visit(_block(stmt.body))
                for orelse in _orelse_blocks(stmt):
                    visit(orelse)
            elif isinstance(stmt, (cst.While, cst.Try)):
                visit(_block(stmt.body))
                if isinstance(stmt, cst.Try):
                    for handler in stmt.handlers:
                        visit(_block(handler.body))

    visit(_block(fdef.body))
    del visit    # the recursive closure's cycle through its own cell (see engine._analyse)
    return names


def _holds_loop(stmts) -> bool:
    for stmt in stmts:
        if isinstance(stmt, (cst.For, cst.While)):
            return True
        if isinstance(stmt, (cst.If, cst.With, cst.Try)) and _holds_loop(_block(stmt.body)):
            return True
    return False


def _binop(aug) -> cst.BaseBinaryOp:
    names = {"DivideAssign": cst.Divide, "MultiplyAssign": cst.Multiply, "FloorDivideAssign": cst.FloorDivide,
             "AddAssign": cst.Add, "SubtractAssign": cst.Subtract}
    return names.get(type(aug).__name__, cst.Add)()


def _block(body) -> Sequence:
    if isinstance(body, cst.IndentedBlock):
        return body.body
    if isinstance(body, cst.SimpleStatementSuite):
        return [cst.SimpleStatementLine(body=body.body)]
    return getattr(body, "body", ())


def _orelse_blocks(stmt: cst.If):
    orelse = stmt.orelse
    while orelse is not None:
        if isinstance(orelse, cst.If):
            yield _block(orelse.body)
            orelse = orelse.orelse
        else:
            yield _block(orelse.body)
            orelse = None


def _target_names(target) -> list:
    if isinstance(target, (cst.Tuple, cst.List)):
        out = []
        for el in target.elements:
            out.extend(_target_names(el.value))
        return out
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return [dotted(target)]


def _is_contextmanager(fdef: cst.FunctionDef) -> bool:
    return any(last_part(dotted(d.decorator)) in ("contextmanager",) for d in fdef.decorators)


_SKIP_FIELDS = ("lpar", "rpar", "comma", "semicolon", "whitespace", "operator", "equal", "star", "colon",
                "dot", "lbracket", "rbracket", "lbrace", "rbrace", "header", "footer", "leading_lines")
_FIELDS: dict = {}


def _fields(node) -> tuple:
    names = _FIELDS.get(type(node))
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(node)
                      if not any(f.name.startswith(s) or f.name.endswith(s) for s in _SKIP_FIELDS))
        _FIELDS[type(node)] = names
    return names


def _calls(expr) -> list:
    """Calls in evaluation order: arguments before the call that takes them. Lambdas are skipped.

    A direct walk over the dataclass fields: libcst's visitor rebuilds every node it passes, which
    made this the hottest function of the analyzer.
    """
    if expr is None:
        return []
    out: list = []
    _walk_calls(expr, out)
    return out


def _walk_calls(node, out: list) -> None:
    # A module-level function, not a closure: a recursive closure refers to itself through its cell,
    # a reference cycle that only the cyclic collector frees (see engine._analyse).
    if type(node) in _LEAVES:
        return
    for name in _fields(node):
        value = getattr(node, name)
        if _is_node(value):
            _walk_calls(value, out)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if _is_node(item):
                    _walk_calls(item, out)
    if type(node) is cst.Call:
        out.append(node)


_LEAVES = frozenset((cst.Lambda, cst.SimpleString, cst.Name, cst.Integer, cst.Float))
_NODE_TYPES: dict = {}


def _is_node(value) -> bool:
    """isinstance(value, cst.CSTNode), decided once per type."""
    t = type(value)
    known = _NODE_TYPES.get(t)
    if known is None:
        known = _NODE_TYPES[t] = isinstance(value, cst.CSTNode)
    return known



def _small_statements(stmts):
    """Every small statement (imports, assignments, ...) at any depth, without entering expressions."""
    for stmt in stmts:
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif isinstance(stmt, cst.If):
            yield from _small_statements(_block(stmt.body))
            for orelse in _orelse_blocks(stmt):
                yield from _small_statements(orelse)
        elif isinstance(stmt, (cst.For, cst.While, cst.With, cst.FunctionDef, cst.ClassDef, cst.Try)):
            yield from _small_statements(_block(stmt.body))
            if isinstance(stmt, cst.Try):
                for handler in stmt.handlers:
                    yield from _small_statements(_block(handler.body))
