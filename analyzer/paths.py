"""The accumulation loops of a module, walked micro-step by micro-step.

For each loop whose body runs a backward pass, every path through one iteration (one *micro-step*) is
followed symbolically. ``if`` tests, conditional contexts (``ctx = model.no_sync() if c else
nullcontext()``) and flag values fork the path on their condition; a path remembers what it assumed
(its *literals*), so contradictory branches never meet, and two conditions of the form
``(i + c) % n == 0`` over the same ``i`` and ``n`` are known to exclude each other.

A path whose micro-step is followed by the optimizer step is a *boundary* micro-step; the others
accumulate. Along each path we record, for every forward and backward of a wrapped model, whether
gradient sync was on at that moment -- DDP decides at forward time (``_pre_forward`` /
``reducer.prepare_for_backward``), FSDP during backward. Rules read these records.

Gate atoms are the conditions that decide whether the step runs. A verdict about a boundary (or
accumulating) micro-step is only drawn when it holds on every path that agrees on the gate atoms: a
condition unrelated to the gate (``if log_this_step:``) never produces a finding on its own.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Optional

import libcst as cst

from synccheck.analyzer.model import (DP_KINDS, FORWARD_DECIDES, Assign, Event, Exit, Flag, Function, If, Inline,
                                      Loop, ModuleModel, With, dotted, has_event, walk_ir)

MAX_PATHS = 512


@dataclass
class Control:
    """An active sync control (a ``with`` that turns sync off, or hands it to accelerate)."""
    model: Optional[str]
    effect: str                    # off | managed
    node: cst.CSTNode              # the ``with`` statement
    how: str                       # "model.no_sync()", "accelerator.accumulate(model)", ...


@dataclass
class SyncState:
    value: str                     # on | off | managed | unknown
    node: Optional[cst.CSTNode] = None    # what set it: a ``with`` or a flag assignment
    how: str = ""


@dataclass
class Forward:
    model: str
    kind: str
    state: SyncState
    node: cst.CSTNode


@dataclass
class Backward:
    model: Optional[str]
    kind: Optional[str]
    forward: Optional[Forward]     # the forward this backward differentiates through
    state: SyncState               # sync state while backward runs
    node: cst.CSTNode
    via: str
    flag_after_forward: Optional[cst.CSTNode] = None
    arg: Optional[cst.BaseExpression] = None
    env: dict = field(default_factory=dict)
    candidates: list = field(default_factory=list)   # (forward, state, kind) of every forward it may be for


@dataclass
class Step:
    node: cst.CSTNode
    target: Optional[str]
    model: Optional[str] = None    # deepspeed engine.step()


@dataclass
class Collective:
    node: cst.CSTNode
    target: Optional[str]


# collectives that synchronize gradients or parameters by hand (manual all-reduce, local SGD)
GRAD_SYNC = {"all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
             "all_gather_into_tensor", "reduce", "average_parameters", "broadcast"}


@dataclass
class ZeroGrad:
    node: cst.CSTNode
    target: Optional[str]


@dataclass
class Path:
    lits: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    controls: tuple = ()
    flags: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    no_grad: int = 0
    ended: Optional[str] = None    # continue | break | return | raise

    def fork(self) -> "Path":
        return Path(dict(self.lits), dict(self.env), self.controls, dict(self.flags), list(self.records),
                    self.no_grad, self.ended)

    @property
    def backwards(self) -> list:
        return [r for r in self.records if isinstance(r, Backward)]

    def steps_before_backward(self) -> bool:
        first_bwd = next((i for i, r in enumerate(self.records) if isinstance(r, Backward)), None)
        return first_bwd is not None and any(isinstance(r, Step) for r in self.records[:first_bwd])


@dataclass
class AccumulationLoop:
    """One loop that accumulates gradients, with every micro-step path through it."""
    model: ModuleModel
    loop: Loop                     # the micro-step loop
    function: Function
    nested: bool                   # micro-steps are an inner loop; the step follows it (nanoGPT)
    paths: list
    gate_atoms: set
    controls: dict                 # model key -> list of (node, how): every sync control in the loop
    step_first: bool = False       # the step runs at the top of the next iteration
    too_complex: bool = False
    atom_text: dict = field(default_factory=dict)
    mod_forms: dict = field(default_factory=dict)
    manual_sync: bool = False      # gradients all-reduced by hand (or parameters averaged) in the loop

    def first_micro_step_possible(self, path: "Path") -> bool:
        """Can this path be the loop's very first micro-step (counter 0, not the last one)?"""
        for atom, value in path.lits.items():
            form = self.mod_forms.get(atom)
            if form is not None and value != (form[2] == 0):   # (0 + c) % n == r  <=>  r - c == 0
                return False
            if atom.startswith("LAST(") and value:
                return False
        return True

    def steps_model(self, step: "Step", key: Optional[str]) -> bool:
        """Does this optimizer step update ``key``'s parameters? Unknown optimizers step everything."""
        if step.model is not None:
            return bare(step.model) == bare(key)
        owner = self.model.optimizer_model.get(step.target or "")
        if owner is None:
            owner = next((v for k, v in self.model.optimizer_model.items() if bare(k) == bare(step.target)), None)
        return owner is None or key is None or bare(owner) == bare(key)

    def boundary_of(self, path: "Path", b: "Backward") -> bool:
        """The optimizer of b's model steps after b, before the next micro-step."""
        return self.stepped_after(path, next(i for i, r in enumerate(path.records) if r is b), b.model)

    def stepped_after(self, path: "Path", index: int, key: Optional[str]) -> bool:
        return any(isinstance(r, Step) and self.steps_model(r, key) for r in path.records[index + 1:])

    def micro_steps(self, boundary: bool) -> list:
        return [p for p in self.paths if any(self.boundary_of(p, b) == boundary for b in p.backwards)]

    def groups(self, boundary: bool) -> list:
        """Micro-step paths of one kind, grouped by what they assume about the gate atoms."""
        groups: dict = {}
        for p in self.micro_steps(boundary):
            key = tuple(sorted((a, v) for a, v in p.lits.items() if a in self.gate_atoms))
            groups.setdefault(key, []).append(p)
        return list(groups.items())

    def dp_backwards(self, path: "Path", boundary: Optional[bool] = None) -> list:
        """The backward passes of a data-parallel model (not DeepSpeed: its engine handles this)."""
        return [b for b in path.backwards if b.kind in DP_KINDS
                and (boundary is None or self.boundary_of(path, b) == boundary)]

    def has_controls(self, key: Optional[str]) -> bool:
        return bool(self.controls.get(key)) or bool(self.controls.get(None))

    def unsynced(self, b: "Backward") -> bool:
        """This backward leaves its gradients un-reduced."""
        if self.manual_sync:
            return False
        if b.kind in FORWARD_DECIDES:
            return b.forward is not None and b.forward.state.value == "off"
        return b.state.value == "off"

    def wasteful(self, b: "Backward") -> bool:
        """This backward all-reduces its gradients."""
        if b.kind in FORWARD_DECIDES:
            if b.forward is not None:
                return b.forward.state.value == "on"
            return b.state.value == "on" and not self.has_controls(b.model)
        return b.state.value == "on"

    def all_groups(self, boundary: bool, predicate) -> list:
        """Groups (by gate literals) in which every micro-step path has a backward matching predicate."""
        out = []
        for lits, paths in self.groups(boundary):
            hits = []
            for p in paths:
                mine = self.dp_backwards(p, boundary)
                matching = [b for b in mine if predicate(b)]
                if not mine or not matching:
                    hits = []
                    break
                hits.extend(matching)
            if hits:
                out.append((lits, hits))
        return out

    @property
    def is_accumulating(self) -> bool:
        """Some micro-steps end without an optimizer step, and some with one."""
        return bool(self.micro_steps(False)) and (bool(self.micro_steps(True)) or self.step_first)


# ---------------------------------------------------------------------------------------------------
# Conditions

def _mod_form(node: ast.AST):
    """``(x + c) % n == r`` -> (x, n, residue) with residue = r - c; None for anything else."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        return None
    left, right = node.left, node.comparators[0]
    if isinstance(left, ast.Constant) and isinstance(right, ast.BinOp):
        left, right = right, left
    if not (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod)):
        return None
    modulus = ast.dump(left.right)
    base, offset = left.left, 0
    if isinstance(base, ast.BinOp) and isinstance(base.op, (ast.Add, ast.Sub)) and \
            isinstance(base.right, ast.Constant) and isinstance(base.right.value, int):
        offset = base.right.value if isinstance(base.op, ast.Add) else -base.right.value
        base = base.left
    if isinstance(right, ast.Constant) and isinstance(right.value, int):
        residue = right.value
    elif isinstance(right, ast.BinOp) and isinstance(right.op, ast.Sub) and \
            ast.dump(right.left) == modulus and isinstance(right.right, ast.Constant):
        residue = -right.right.value          # x % n == n - 1
    else:
        return None
    return ast.dump(base), modulus, residue - offset


def _last_form(node: ast.AST, target: str, bound: str):
    """``t == n - 1`` / ``t + 1 == n`` for the loop ``for t in range(n)``: the last micro-step."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return None
    op = node.ops[0]
    left, right = node.left, node.comparators[0]

    def is_t(n):
        return isinstance(n, ast.Name) and n.id == target

    def minus_one(n):
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and ast.dump(n.left) == bound and \
            isinstance(n.right, ast.Constant) and n.right.value == 1

    def plus_one(n):
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and is_t(n.left) and \
            isinstance(n.right, ast.Constant) and n.right.value == 1

    if is_t(left) and minus_one(right) or plus_one(left) and ast.dump(right) == bound:
        if isinstance(op, ast.Eq):
            return True
        if isinstance(op, ast.Lt):
            return False
    if is_t(left) and ast.dump(right) == bound and isinstance(op, ast.Lt):
        return None
    return None


class Walker:
    """Runs the micro-step paths of one accumulation loop."""

    def __init__(self, model: ModuleModel, function: Function, micro_loop: Loop) -> None:
        self.model = model
        self.function = function
        self.micro_loop = micro_loop
        self.gate_atoms: set = set()
        self.atom_text: dict = {}
        self.mod_forms: dict = {}     # atom -> (i, n, residue) for ``(i + c) % n == r``
        self.exploded = False
        self.last_atom: Optional[str] = None
        self.last_bound: Optional[str] = None
        self._loop_bound(micro_loop)
        self.flagged_models = {n.model for n in walk_ir(micro_loop.body) if isinstance(n, Flag)}
        self.guard_atoms: set = set()
        self._scope = None

    def _loop_bound(self, loop: Loop) -> None:
        """``for t in range(n)`` / ``for t, _ in enumerate(x)``: what ``t == n - 1`` means."""
        if loop.target is None or not isinstance(loop.iter, cst.Call):
            return
        func = dotted(loop.iter.func)
        args = loop.iter.args
        bound = None
        if func == "range" and len(args) == 1:
            bound = self.model.atom(args[0].value)
        elif func == "range" and len(args) == 2:
            first = args[0].value
            if isinstance(first, cst.Integer) and first.value == "0":
                bound = self.model.atom(args[1].value)
        elif func == "enumerate" and args:
            try:
                bound = ast.dump(ast.parse(f"len({self.model.code(args[0].value).strip()})", mode="eval").body)
            except SyntaxError:
                bound = None
        if bound is not None:
            self.last_bound = bound
            self.last_atom = f"LAST({loop.target})"

    # -- conditions -------------------------------------------------------------------------------
    def literal(self, expr) -> tuple:
        """(atom, polarity) for a leaf condition: ``a != b`` is ``not (a == b)``."""
        key = self.model.atom(expr)
        node = self.model.expr_ast(expr)
        if node is None:
            return key, True
        polarity = True
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.NotEq):
            node = ast.Compare(node.left, [ast.Eq()], node.comparators)
            polarity = False
            key = ast.dump(node)
        if self.last_atom and isinstance(node, ast.Compare):
            target = self.micro_loop.target.split(".")[0] if self.micro_loop.target else ""
            last = _last_form(node, target, self.last_bound)
            if last is not None:
                return self.last_atom, polarity if last else not polarity
        mod = _mod_form(node)
        if mod is not None:
            key = "MOD" + repr(mod)
            self.mod_forms[key] = mod
        self.atom_text.setdefault(key, self.model.code(expr).strip())
        return key, polarity

    def _excluded(self, path: Path, atom: str) -> bool:
        """``(i + c) % n == 0`` is false on a path that assumed ``(i + d) % n == 0`` with c != d."""
        form = self.mod_forms.get(atom)
        if form is None:
            return False
        for other, value in path.lits.items():
            o = self.mod_forms.get(other)
            if value and o is not None and o[:2] == form[:2] and o[2] != form[2]:
                return True
        return False

    def assume(self, path: Path, atom: str, value: bool) -> bool:
        """Add a literal; False when it contradicts what the path already assumed."""
        if atom in path.lits:
            return path.lits[atom] == value
        if value and self._excluded(path, atom):
            return False
        path.lits[atom] = value
        return True

    def fixed(self, path: Path, atom: str) -> Optional[bool]:
        if atom in path.lits:
            return path.lits[atom]
        return False if self._excluded(path, atom) else None

    def cond(self, expr, path: Path, depth: int = 0) -> list:
        """Fork ``path`` on a condition: [(path, truth), ...]."""
        if depth > 12:
            return [(path, True), (path.fork(), False)]
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
            return [(p, not v) for p, v in self.cond(expr.expression, path, depth + 1)]
        if isinstance(expr, cst.BooleanOperation):
            is_and = isinstance(expr.operator, cst.And)
            out = []
            for p, v in self.cond(expr.left, path, depth + 1):
                if v == is_and:          # and: left true -> right decides; or: left false -> right decides
                    out.extend(self.cond(expr.right, p, depth + 1))
                else:
                    out.append((p, v))
            return out
        if isinstance(expr, cst.Name):
            if expr.value in ("True", "False"):
                return [(path, expr.value == "True")]
            bound = path.env.get(expr.value)
            if bound is not None and not (isinstance(bound, cst.Name) and bound.value == "__unknown__"):
                return self.cond(bound, path, depth + 1)
        if isinstance(expr, cst.Integer):
            return [(path, expr.value not in ("0",))]
        atom, polarity = self.literal(expr)
        if atom in self.guard_atoms:
            return [(path, polarity)]
        known = self.fixed(path, atom)
        if known is not None:
            return [(path, known == polarity)]
        if self.exploded:
            return [(path, True)]
        out = []
        for value in (True, False):
            p = path.fork()
            if self.assume(p, atom, value):
                out.append((p, value == polarity))
        return out

    def collect_gate_atoms(self, nodes) -> None:
        """Atoms of the conditions that decide whether the optimizer steps.

        An ``if`` that decides the step *inside* another one that does (``if sync: if
        torch.isfinite(norm): optimizer.step()``) is a guard that may skip a step, not the
        accumulation schedule: its condition is assumed true.
        """
        def visit(block, inside_gate: bool) -> None:
            for n in block:
                if isinstance(n, If):
                    body_step, else_step = has_event(n.body, "step"), has_event(n.orelse, "step")
                    exits = any(isinstance(x, Exit) and x.kind in ("continue", "break", "return")
                                for x in walk_ir(n.body + n.orelse))
                    gate = body_step != else_step or exits
                    if gate and inside_gate:
                        before = set(self.gate_atoms)
                        self._atoms_of(n.test, set(), nodes)
                        self.guard_atoms |= self.gate_atoms - before
                        self.gate_atoms = before
                    elif gate:
                        self._atoms_of(n.test, set(), nodes)
                    visit(n.body, inside_gate or gate)
                    visit(n.orelse, inside_gate or gate)
                elif isinstance(n, (With, Inline, Loop)):
                    visit(n.body, inside_gate)

        visit(nodes, False)
        # The recursive closure refers to itself through its cell, and to self: left alone, that cycle
        # would keep this walker, the module's model and its libcst tree for the cyclic collector,
        # which engine._analyse keeps off while a file is analysed.
        del visit
        if self.last_atom:
            self.gate_atoms.add(self.last_atom)

    def _atoms_of(self, expr, seen: set, scope) -> None:
        if isinstance(expr, cst.UnaryOperation):
            return self._atoms_of(expr.expression, seen, scope)
        if isinstance(expr, cst.BooleanOperation):
            self._atoms_of(expr.left, seen, scope)
            return self._atoms_of(expr.right, seen, scope)
        if isinstance(expr, cst.Name) and expr.value not in seen:
            seen.add(expr.value)
            values = [a.value for a in walk_ir(scope) if isinstance(a, Assign) and a.name == expr.value]
            values += [a.value for a in walk_ir(self.function.body, into_loops=False)
                       if isinstance(a, Assign) and a.name == expr.value]
            if values:
                for v in values:
                    self._atoms_of(v, seen, scope)
                return None
        atom, _ = self.literal(expr)
        self.gate_atoms.add(atom)
        return None

    def related_to_gate(self, atom: str) -> bool:
        if atom in self.gate_atoms:
            return True
        form = self.mod_forms.get(atom)
        return form is not None and any(self.mod_forms.get(g, (None, None))[:2] == form[:2]
                                        for g in self.gate_atoms)

    # -- sync controls ------------------------------------------------------------------------------
    def controls_of(self, expr, path: Path, with_node, depth: int = 0, scope=None) -> list:
        """[(path, Control | None)] for one with-item expression.

        A context synccheck cannot see into (``ExitStack``, ``functools.partial``, a lambda, a function
        defined elsewhere) is an *unknown* control when the file uses ``no_sync`` at all: the
        micro-step then gets no verdict rather than a wrong one.
        """
        if depth > 8:
            return [(path, None)]
        m = self.model
        self._scope = scope
        if isinstance(expr, cst.Name):
            bound = path.env.get(expr.value)
            if bound is not None and not (isinstance(bound, cst.Name) and bound.value == "__unknown__"):
                return self.controls_of(bound, path, with_node, depth + 1, scope)
            return [(path, self._unknown(expr, with_node))]
        if isinstance(expr, cst.IfExp):
            out = []
            for p, v in self.cond(expr.test, path):
                out.extend(self.controls_of(expr.body if v else expr.orelse, p, with_node, depth + 1, scope))
            return out
        if isinstance(expr, cst.Attribute) and expr.attr.value == "no_sync":
            # the callable form: ``sync_ctx = model.no_sync if c else nullcontext``; ``with sync_ctx():``
            key = self._key(expr.value, path)
            return [(path, Control(key, "off", with_node, f"{m.code(expr).strip()}()"))]
        if not isinstance(expr, cst.Call):
            return [(path, self._unknown(expr, with_node))]
        func = expr.func
        if isinstance(func, cst.Attribute):
            attr = func.attr.value
            owner = self._key(func.value, path)
            args = [a for a in expr.args if a.keyword is None]
            if attr == "no_sync":
                key = self._key(args[0].value, path) if args else owner
                return [(path, Control(key, "off", with_node, m.code(expr).strip()))]
            if attr == "accumulate" and owner in m.accumulators:
                # synccheck.runtime.GradientAccumulator: syncs exactly at the boundary
                return [(path, Control(m.accumulators[owner], "managed", with_node, m.code(expr).strip()))]
            if attr == "accumulate" and m.framework_kind(owner) == "accelerate":
                key = self._key(args[0].value, path) if args else None
                return [(path, Control(key, "managed", with_node, m.code(expr).strip()))]
            if attr == "no_backward_sync":
                key = self._key(args[0].value, path) if args else None
                enabled = next((a.value for a in expr.args if a.keyword is not None
                                and a.keyword.value == "enabled"), args[1].value if len(args) > 1 else None)
                control = Control(key, "off", with_node, m.code(expr).strip())
                if enabled is None:
                    return [(path, control)]
                return [(p, control if v else None) for p, v in self.cond(enabled, path)]
        if isinstance(func, (cst.Name, cst.IfExp)) and not (isinstance(func, cst.Name) and
                                                             func.value in m.defs):
            # ``ctx()`` where ctx holds a callable control
            target = path.env.get(func.value) if isinstance(func, cst.Name) else func
            if target is not None and not isinstance(target, cst.Call):
                return self.controls_of(target, path, with_node, depth + 1, scope)
        helper = self._helper(expr)
        if helper is not None:
            return self._helper_controls(helper, expr, path, with_node, depth)
        return [(path, self._unknown(expr, with_node))]

    def _unknown(self, expr, with_node) -> Optional[Control]:
        """A context we cannot resolve: harmless ones are named; others may hide a no_sync."""
        func = expr.func if isinstance(expr, cst.Call) else expr
        q = self.model.qualify(dotted(func)) if dotted(func) else ""
        harmless = ("torch.", "contextlib.nullcontext", "nullcontext", "open", "tqdm", "warnings.",
                    "accelerate.", "autocast", "record_function", "profile", "Timer", "timer")
        if any(q.startswith(h) or q.endswith(h) for h in harmless) or "no_sync" not in self.model.source:
            return None
        if isinstance(func, cst.Attribute) and func.attr.value in ("autocast", "no_grad", "profile", "timer",
                                                                    "record_function", "inference_mode"):
            return None
        return Control(None, "unknown", with_node, self.model.code(expr).strip())

    def _key(self, expr, path: Optional[Path] = None) -> Optional[str]:
        """The key a control's model expression names, in the scope of the ``with`` it stands in."""
        name = dotted(expr)
        if not name:
            return None
        head = name.split(".")[0]
        bound = path.env.get(head) if path is not None else None
        if isinstance(bound, (cst.Name, cst.Attribute)) and dotted(bound) != head and self._scope is None:
            # a parameter of a helper: the caller's name for it
            outer = dotted(bound)
            return self._key(cst.parse_expression(outer + name[len(head):]), None) if outer else None
        if self._scope is not None:
            return self.model.resolve(expr, self._scope)
        return self.model.key_for(name, self.function.class_name)

    def _helper(self, call: cst.Call):
        name = dotted(call.func)
        if not name:
            return None
        if name.startswith("self.") and self.function.class_name:
            name = f"{self.function.class_name}.{name[5:]}"
        return self.model.function_named.get(name)

    def _helper_controls(self, helper: Function, call: cst.Call, path: Path, with_node, depth) -> list:
        """A same-file helper that returns (or yields inside) a sync control."""
        fdef = helper.node
        p0 = path.fork()
        positional = [a.value for a in call.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        params = list(fdef.params.params)
        if helper.class_name and params and params[0].name.value == "self":
            params = params[1:]
        for i, param in enumerate(params):
            value = positional[i] if i < len(positional) else keywords.get(param.name.value, param.default)
            if value is not None:
                p0.env[param.name.value] = value
        out = []
        if helper.is_contextmanager:
            for p in self.run(helper.body, [p0], stop_at_yield=True):
                controls = p.controls[len(path.controls):]
                p.controls = path.controls
                out.append((p, controls[-1] if controls else None))
        else:
            for p in self.run(helper.body, [p0], stop_at_return=True):
                value = p.env.pop("__return__", None)
                if value is None:
                    out.append((p, None))
                else:
                    out.extend(self.controls_of(value, p, with_node, depth + 1))
        for p, _ in out:
            # back in the caller: its names, not the helper's parameters; only the assumptions stay
            p.env = dict(path.env)
            p.ended = None
        return [(p, c) for p, c in out if p.ended is None] or [(path, None)]

    # -- state --------------------------------------------------------------------------------------
    def kind_of(self, key: Optional[str], path: Path) -> Optional[str]:
        """The wrapper kind of ``key`` on this path (None: not wrapped here)."""
        for w in self.model.lookup(key):
            if all(path.lits.get(atom, pol) == pol for atom, pol in w.conds):
                return w.kind
        return None

    def sync_state(self, key: str, path: Path) -> SyncState:
        if bare(key) in self.model.local_sgd_models:
            return SyncState("managed", None, "LocalSGD")     # gradient sync off by design
        # A control names its model as written where it stands (a helper's parameter, say); forwards
        # are resolved to where the model was made. Their bare names are what can be compared.
        mine = [c for c in path.controls if c.model is None or bare(c.model) == bare(key)]
        for effect in ("managed", "unknown", "off"):
            for control in reversed(mine):
                if control.effect == effect:
                    return SyncState(effect if effect != "off" else "off", control.node, control.how)
        flag = path.flags.get(key)
        if flag is not None:
            return flag
        if key in self.flagged_models:
            # the flag is written somewhere in this loop but not yet on this path: its value is
            # whatever the previous micro-step left behind
            return SyncState("unknown")
        return SyncState("on")

    # -- execution ----------------------------------------------------------------------------------
    def run(self, nodes, paths: list, stop_at_return: bool = False, stop_at_yield: bool = False) -> list:
        """Execute IR nodes on every live path; returns all paths (ended ones keep ``ended``)."""
        for node in nodes:
            live = [p for p in paths if p.ended is None]
            done = [p for p in paths if p.ended is not None]
            if not live:
                break
            if len(paths) > MAX_PATHS:
                self.exploded = True
            nxt = []
            for p in live:
                nxt.extend(self.step(node, p, stop_at_return, stop_at_yield))
            paths = done + nxt
        return paths

    def step(self, node, path: Path, stop_at_return: bool, stop_at_yield: bool) -> list:
        m = self.model
        if isinstance(node, Assign):
            path.env[node.name] = node.value
            return [path]
        if isinstance(node, If):
            out = []
            for p, v in self.cond(node.test, path):
                out.extend(self.run(node.body if v else node.orelse, [p], stop_at_return, stop_at_yield))
            return out
        if isinstance(node, With):
            base = path.controls
            paths = [path]
            for item in node.items:
                nxt = []
                for p in paths:
                    for p2, control in self.controls_of(item, p, node.node, scope=node.ctx):
                        if control is not None:
                            p2.controls = p2.controls + (control,)
                        nxt.append(p2)
                paths = nxt
            if node.no_grad:
                for p in paths:
                    p.no_grad += 1
            paths = self.run(node.body, paths, stop_at_return, stop_at_yield)
            for p in paths:
                if p.ended is None or p.ended == "yield":
                    if node.no_grad:
                        p.no_grad -= 1
                    if p.ended is None:
                        p.controls = base
            return paths
        if isinstance(node, Inline):
            paths = self.run(node.body, [path], True, stop_at_yield)
            for p in paths:
                if p.ended == "return":
                    p.ended = None
                p.env.pop("__return__", None)
            return paths
        if isinstance(node, Exit):
            if node.kind == "return" and stop_at_return and node.value is not None:
                path.env["__return__"] = node.value
            path.ended = node.kind
            return [path]
        if isinstance(node, Flag):
            out = []
            for p, v in self.cond(node.value, path):
                p.flags[node.model] = SyncState("on" if v else "off", node.node,
                                                f"{m.code(node.node).strip()}")
                p.records.append(node)
                out.append(p)
            return out
        if isinstance(node, Loop):
            if node is self.micro_loop:
                return self.run_micro_loop(node, path)
            # an inner loop that is not the micro-step loop: run its body once
            return [p if p.ended in (None, "return", "raise") else _reopen(p)
                    for p in self.run(node.body, [path], stop_at_return, stop_at_yield)]
        if isinstance(node, Event):
            return [self.event(node, path, stop_at_yield)]
        return [path]

    def run_micro_loop(self, loop: Loop, path: Path) -> list:
        """Nested accumulation (nanoGPT): one micro-step of the inner loop, last or not."""
        out = []
        atom = self.last_atom or f"LAST({id(loop)})"
        self.gate_atoms.add(atom)
        for is_last in (False, True):
            p = path.fork()
            p.lits[atom] = is_last
            for q in self.run(loop.body, [p]):
                if q.ended == "continue":
                    q.ended = None
                if not is_last and q.ended is None:
                    q.ended = "next-micro-step"     # the rest of the outer body runs after the last one
                out.append(q)
        return out

    def event(self, ev: Event, path: Path, stop_at_yield: bool) -> Path:
        if ev.kind == "yield":
            if stop_at_yield:
                path.ended = "yield"
            return path
        if ev.kind == "forward":
            if path.no_grad:
                return path
            kind = self.kind_of(ev.model, path)
            if kind is None:
                return path
            path.records.append(Forward(ev.model, kind, self.sync_state(ev.model, path), ev.node))
            return path
        if ev.kind == "backward":
            forward = None
            flag_after = None
            pending = []          # forwards since the previous backward: this backward runs through them
            for r in reversed(path.records):
                if isinstance(r, Backward):
                    break
                if isinstance(r, Flag) and not pending:
                    flag_after = r
                if isinstance(r, Forward) and (ev.model is None or r.model == ev.model):
                    pending.append(r)
            if pending:
                forward = pending[0]
            else:
                for r in reversed(path.records):
                    if isinstance(r, Forward) and (ev.model is None or r.model == ev.model):
                        forward = r
                        break
            key = ev.model or (forward.model if forward else self._only_model(path))
            kind = self.kind_of(key, path) if key else None
            if flag_after is not None and (forward is None or flag_after.model != forward.model):
                flag_after = None
            state = self.sync_state(key, path) if key else SyncState("on")
            record = Backward(key, kind, forward, state, ev.node, ev.via,
                              flag_after.node if flag_after else None, ev.arg, dict(path.env))
            # a GAN's generator loss runs through D's forward too: which model the backward is for is
            # settled once the path is complete (the one whose optimizer steps after it)
            record.candidates = [(f, self.sync_state(f.model, path), self.kind_of(f.model, path)) for f in pending]
            path.records.append(record)
            return path
        if ev.kind == "step":
            path.records.append(Step(ev.node, ev.target, ev.model))
            return path
        if ev.kind == "zero_grad":
            path.records.append(ZeroGrad(ev.node, ev.target))
            return path
        if ev.kind == "collective":
            path.records.append(Collective(ev.node, ev.target))
        return path

    def _only_model(self, path: Path) -> Optional[str]:
        """A backward with no forward in sight: the file's one data-parallel model, if it has one."""
        keys = {k for k, ws in self.model.wrapped.items() if any(not w.inferred for w in ws)
                and (":" not in k or k.startswith(self.function.name + ":"))}
        return next(iter(keys)) if len(keys) == 1 else None


def bare(key: Optional[str]) -> Optional[str]:
    """``train:model`` -> ``model``: a key without the function it is local to."""
    return key.split(":", 1)[-1] if key else key


def _reopen(path: Path) -> Path:
    if path.ended in ("continue", "break"):
        path.ended = None
    return path


# ---------------------------------------------------------------------------------------------------

def accumulation_loops(model: ModuleModel) -> list:
    """Every loop of the module that runs backward on each micro-step, walked path by path."""
    found = []
    seen_loops: set = set()
    for function in model.functions:
        for micro, container, nested, conds in _micro_loops(function.body, None):
            if id(micro.node) in seen_loops and function.name != "<module>":
                continue
            acc = _walk(model, function, micro, container, nested, conds)
            if acc is not None:
                seen_loops.add(id(micro.node))
                found.append(acc)
    # a loop found while analysing an inlining caller has its parameters bound: prefer that one
    by_node: dict = {}
    for acc in found:
        prev = by_node.get(id(acc.loop.node))
        if prev is None or _score(acc) > _score(prev):
            by_node[id(acc.loop.node)] = acc
    return list(by_node.values())


def _score(acc: AccumulationLoop) -> int:
    return sum(len(p.records) for p in acc.paths)


def _direct_backward(nodes) -> bool:
    return has_event(nodes, "backward", into_loops=False)


def _micro_loops(nodes, enclosing: Optional[tuple], conds: tuple = ()):
    """(micro-step loop, the nodes to execute, nested?, enclosing if-conditions) for every candidate."""
    for i, node in enumerate(nodes):
        if isinstance(node, Loop):
            if _direct_backward(node.body):
                if has_event(node.body, "step"):
                    yield node, [node], False, conds
                elif any(has_event([n], "step", into_loops=False) for n in nodes[i + 1:]):
                    # the step follows the loop: in the enclosing loop's body or after it
                    yield node, list(nodes[i:]), True, conds
                elif enclosing is not None:
                    yield node, [node], False, conds
            else:
                yield from _micro_loops(node.body, (node,), conds)
        elif isinstance(node, If):
            yield from _micro_loops(node.body, enclosing, conds + ((node.test, True),))
            yield from _micro_loops(node.orelse, enclosing, conds + ((node.test, False),))
        elif isinstance(node, (With, Inline)):
            yield from _micro_loops(node.body, enclosing, conds)


def _walk(model: ModuleModel, function: Function, micro: Loop, container: list, nested: bool, conds=()):
    walker = Walker(model, function, micro)
    scope = micro.body + container[1:] if nested else micro.body
    walker.collect_gate_atoms(scope)
    start = Path()
    for n in walk_ir(function.body, into_loops=False):
        if isinstance(n, Assign):
            start.env[n.name] = n.value
    starts = [start]
    for test, polarity in conds:     # the loop runs only where its enclosing ifs hold
        starts = [p for s in starts for p, v in walker.cond(test, s) if v == polarity]
    paths = walker.run(container if nested else micro.body, starts)
    paths = [p for p in paths if p.ended != "raise"]
    controls: dict = {}
    for p in paths:
        for r in p.records:
            if isinstance(r, Backward) and r.state.value in ("off", "managed") and r.state.node is not None:
                controls.setdefault(r.model, []).append(r.state.node)
            if isinstance(r, Forward) and r.state.value in ("off", "managed", "unknown") and r.state.node is not None:
                controls.setdefault(r.model, []).append(r.state.node)
            if isinstance(r, Flag):
                controls.setdefault(r.model, []).append(r.node)
    for n in walk_ir(scope):
        if isinstance(n, With) and any(_mentions_sync(model, item) for item in n.items):
            controls.setdefault(None, []).append(n.node)
    # conditions of the form (i + c) % n == 0 over the step's own i and n are as good as the gate
    gate = set(walker.gate_atoms) | {a for p in paths for a in p.lits if walker.related_to_gate(a)}
    # gradients all-reduced by hand (or parameters averaged) somewhere in the loop: intended, not SC103
    manual = any(isinstance(n, Event) and n.kind == "collective" and n.target in GRAD_SYNC for n in walk_ir(scope))
    acc = AccumulationLoop(model, micro, function, nested, paths, gate, controls,
                           step_first=any(p.steps_before_backward() for p in paths),
                           too_complex=walker.exploded, atom_text=walker.atom_text,
                           mod_forms=walker.mod_forms, manual_sync=manual)
    for p in paths:
        for i, r in enumerate(p.records):
            if isinstance(r, Backward) and len(r.candidates) > 1 and not acc.stepped_after(p, i, r.model):
                for forward, state, kind in r.candidates:
                    if acc.stepped_after(p, i, forward.model):
                        r.model, r.kind, r.forward, r.state = forward.model, kind, forward, state
                        break
    return acc


def _mentions_sync(model: ModuleModel, expr) -> bool:
    text = model.code(expr)
    return any(w in text for w in ("no_sync", "accumulate", "no_backward_sync", "sync"))


def describe_lits(acc: AccumulationLoop, lits: tuple) -> str:
    """``when `(i + 1) % n == 0` is false`` for a group's gate literals, for messages."""
    parts = []
    for atom, value in lits:
        if atom.startswith("LAST("):
            parts.append("on the last micro-step" if value else "on the other micro-steps")
            continue
        text = acc.atom_text.get(atom)
        if text:
            parts.append(f"`{text}` is {'true' if value else 'false'}")
    return ", ".join(parts)
