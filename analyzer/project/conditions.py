"""Conditions in the source -> guards (see guards.py).

``cond(test)`` gives two guards: the assignments under which the test may be true and those under
which it may be false. For a test made of atoms and ``and`` / ``or`` / ``not`` they are exact
complements; a part we do not model (a call we cannot see into, a test no event depends on) makes
both sides ``TRUE`` for that part, which is a sound *may* answer.

Atoms are canonical: ``a != b`` is ``not (a == b)``, ``(i + c) % n == r`` is keyed by ``(i, n, r - c)``,
the loop counter's ``t == n - 1`` / ``t + 1 == n`` / ``i == len(loader) - 1`` is the loop's LAST atom, and
every atom carries the definitions of the names it reads (so ``i`` before and after ``i += 1`` differ).
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.first_turn import FirstTurn
from synccheck.analyzer.project.type_tests import TypeTests, _text
from synccheck.analyzer.project.guards import COMPARISONS, FALSE, TRUE, last_form, mod_form, mod_parts
from synccheck.analyzer.parse import dotted as _dotted
from synccheck.analyzer.project.state import origin_of
from synccheck.analyzer.project.traversal import children, walk

BOTH = (TRUE, TRUE)


def free_names(node) -> list:
    """Names and dotted attribute chains an expression reads, outermost chains only."""
    out = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name):
            out.append(n.id)
            continue
        if isinstance(n, ast.Attribute):
            chain = _dotted(n)
            if chain is not None:
                out.append(chain)
                continue
        stack.extend(children(n))
    return out


def volatile(node) -> bool:
    """A test whose value may change without any name being rebound (a call, an item of a batch)."""
    return any(isinstance(n, (ast.Call, ast.Subscript, ast.Await)) for n in walk(node))


class Conditions(FirstTurn, TypeTests):
    """Evaluates tests for one Flow; knows the atoms table and how to read the local environment."""

    def __init__(self, flow) -> None:
        self.flow = flow
        self.atoms = flow.atoms
        self._read: dict = {}      # id(test) -> (test, module, text, mod form, names, dump, volatile)
        self._calls: dict = {}     # id(expression) -> (expression, whether it holds a call)
        self._stable_seen: set = set()   # (atom, id(function)) already asked whether it is written

    def cond(self, node, st, fr, relevant: bool = True) -> tuple:
        """(may be true, may be false) guards of a test."""
        t = type(node)
        if t is ast.BoolOp:
            parts = [self.cond(v, st, fr, relevant) for v in node.values]
            if isinstance(node.op, ast.And):
                true, false = TRUE, FALSE
                for pt, pf in parts:
                    true &= pt
                    false |= pf
            else:
                true, false = FALSE, TRUE
                for pt, pf in parts:
                    true |= pt
                    false &= pf
            return true, false
        if t is ast.UnaryOp and isinstance(node.op, ast.Not):
            pt, pf = self.cond(node.operand, st, fr, relevant)
            return pf, pt
        if t is ast.Constant:
            return (TRUE, FALSE) if node.value else (FALSE, TRUE)
        if t is ast.NamedExpr:
            self.flow.expr(node, st, fr)
            return self.cond(node.value, st, fr, relevant)
        if t is ast.Name:
            known = st.env.get(node.id)
            if known is not None:
                if known.cond is not None:
                    return known.cond
                const = _constant(known)
                if const is not None:
                    return (TRUE, FALSE) if const else (FALSE, TRUE)
            else:
                const = self.flow.constant(node.id, fr)
                if const is not None:
                    return (TRUE, FALSE) if const else (FALSE, TRUE)
        if t is ast.Attribute and type(node.value) is ast.Name:
            # ``if self.at_boundary:`` through a property that returns a test (events._property_test)
            value = self.flow.expr(node, st, fr)
            if value.cond is not None:
                return value.cond
        if t is ast.Call:
            decided = self._type_test_by_paths(node, st, fr)
            if decided is not None:
                return decided
            value = self.flow.expr(node, st, fr)
            if value.cond is not None:
                return value.cond
            const = _constant(value)
            if const is not None:
                return (TRUE, FALSE) if const else (FALSE, TRUE)
        elif t is ast.Compare:
            # events inside a comparison (a call in ``if step(x) == 0``) still happen
            for sub in [node.left] + list(node.comparators):
                if self._calls_in(sub):
                    self.flow.expr(sub, st, fr)
            folded = self._fold(node, fr)
            if folded is None:
                folded = self._none_test(node, st, fr)
            if folded is not None:
                return (TRUE, FALSE) if folded else (FALSE, TRUE)
        if not relevant:
            return BOTH
        return self.literal(node, st, fr)

    def _calls_in(self, node) -> bool:
        """Does the expression hold a call? (Read once per node: a loop's tests are read every turn.)"""
        found = self._calls.get(id(node))
        if found is None or found[0] is not node:
            found = self._calls[id(node)] = (node, any(isinstance(n, ast.Call) for n in walk(node)))
        return found[1]

    def literal(self, node, st, fr) -> tuple:
        polarity = True
        written = node
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            # ``if step % accum:`` is ``step % accum != 0``, one atom with the step's ``% accum == 0``
            node = ast.copy_location(ast.Compare(node, [ast.Eq()], [ast.Constant(0)]), node)
            polarity = False
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.NotEq):
            node = ast.copy_location(ast.Compare(node.left, [ast.Eq()], node.comparators), node)
            polarity = False
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.NotIn):
            node = ast.copy_location(ast.Compare(node.left, [ast.In()], node.comparators), node)
            polarity = False
        last = self._last(node, st, fr)
        if isinstance(last, bool):
            # ``i < len(samples)`` in ``for i, s in enumerate(samples)``: true on every turn
            return (TRUE, FALSE) if last == polarity else (FALSE, TRUE)
        if isinstance(last, _Negated):
            atom, polarity = last.atom, not polarity
        else:
            atom = last
        if atom is None and isinstance(node, ast.Attribute) and node.attr == "sync_gradients":
            # ``if accelerator.sync_gradients:``: the very test accelerate's gated step and zero_grad
            # are made of (micro_step._sync_gradients_atom), one atom for both
            from synccheck.analyzer.project.micro_step import _sync_gradients_atom
            atom = _sync_gradients_atom(self.flow)
            if atom is None:
                return (TRUE, TRUE)
        if atom is None:
            # what the test's syntax says, read once per test (a loop's tests are read every turn)
            read = self._read.get(id(written))
            if read is None or read[0] is not written or read[1] is not fr.module:
                parts = mod_parts(node) if isinstance(node, ast.Compare) else None
                read = self._read[id(written)] = (
                    written, fr.module, _text(fr, node),
                    None if parts is None else (ast.dump(parts[0]), ast.dump(parts[1]), parts[2], parts),
                    free_names(node), ast.dump(node), volatile(node))
            _, _, text, mod, names, dump, changes = read
            versions = tuple(self.flow.version(n, st) for n in names)
            if mod is not None:
                # the counter and the modulus by what they are copies of: one count read under
                # several names (a parameter, ``accum = self.accum``, a dict's entry) is one atom
                base, modulus, residue = mod[3]
                counted = (self._canonical(base, st), self._canonical(modulus, st))
                shift = 0
                if counted[0][0] == "shift":
                    # ``step += 1`` since: ``step % n == r`` is ``(step_before + 1) % n == r``
                    shift = counted[0][2]
                    residue -= shift
                    counted = (counted[0][1], counted[1])
                if isinstance(modulus, ast.Constant) and type(modulus.value) is int and modulus.value > 0:
                    residue %= modulus.value        # ``% 4 == 3`` and ``(i + 1) % 4 == 0`` are one test
                key = ("MOD", counted, residue)
                atom = self.atoms.get(key, text, (counted[0], counted[1], residue))
                if atom is not None and shift and not atom.after and atom.text == text and \
                        isinstance(base, (ast.Name, ast.Attribute)):
                    # the same words before and after ``step += 1`` are two tests: said so
                    atom.after = f" (after `{ast.unparse(base)} += {shift}`)" if shift > 0 else \
                        f" (after `{ast.unparse(base)} -= {-shift}`)"
            else:
                stable = self._stable(names, st) if fr.depth and not changes else None
                if stable is not None:
                    # ``if self.accum_count == 1:`` in a method the loop calls: the attributes of the
                    # caller's own objects, by what the receiver is a copy of, hold between calls
                    versions = tuple(origin[2] for origin, _ in stable)
                    atom = self.atoms.get(("STABLE", dump, stable), text, bound=_bound(node, ("STABLE", stable)))
                    seen = (atom.index, id(fr.scope)) if atom is not None else None
                    if seen is not None and seen not in self._stable_seen and all(v == 0 for v in versions):
                        # (still tested afresh each turn, unless it turns out to guard a zero_grad:
                        # Flow.if_ makes such a switch hold all run; asked once per test and function)
                        self._stable_seen.add(seen)
                        if not self._written(stable, fr):
                            self.flow.stable_atoms.add(atom.index)
                else:
                    atom = self.atoms.get((dump, versions), text, bound=_bound(node, versions))
                    window = _below_last(node)
                    if atom is not None and window is not None:
                        # ``i < accum_steps - 1`` beside ``(i + 1) % accum_steps == 0``: never both
                        self.atoms.window_bound(atom, (self._canonical(window[0], st), self._canonical(window[1], st)))
            if atom is None:
                return BOTH
            if not polarity and atom.negated is None:
                atom.negated = _text(fr, written)       # `i % n != 0`, as the code says it
            if atom.counter is None and mod is not None:
                atom.counter = self.flow.counter_loop(mod[0], fr)
            if atom.first is None and mod is None and isinstance(node, ast.Compare):
                self._first(atom, node, fr)
            self.flow.note_atom(atom, versions, changes or fr.depth > 0, names, not changes and fr.depth > 0)
        true, false = self.atoms.formula(atom, True), self.atoms.formula(atom, False)
        return (true, false) if polarity else (false, true)

    @staticmethod
    def _stable(names, st):
        """((origin of the receiver, attribute path), ...) when every name the test reads is an
        attribute chain (``self.accum_count``) not written on these paths, on an object we know by
        what it is a copy of; None otherwise."""
        out = []
        for name in names:
            root, dot, rest = name.partition(".")
            if not dot or name in st.env:
                return None
            known = st.env.get(root)
            origin = None if known is None else known.origin     # (a comprehension's name is not here)
            if origin is None or origin[0] != "name":
                return None
            out.append((origin, rest))
        return tuple(out) or None

    def _written(self, stable, fr) -> bool:
        """Is one of these attributes written in the loop's function or in this one?"""
        texts = [fr.module.segment(fr.scope.node) if hasattr(fr.scope, "node") else fr.module.text]
        root = self.flow.root
        texts.append(root.module.segment(root.node) if hasattr(root, "node") else root.text)
        for _, rest in stable:
            store = re.compile(r"\." + re.escape(rest) + r"\s*(?:[-+*/%|&]|//)?=(?!=)")
            if any(text and store.search(text) for text in texts):
                return True
        return False

    def _canonical(self, node, st):
        origin = origin_of(node, st)
        if origin is not None and origin[0] in ("name", "shift"):
            return origin
        return ("expr", ast.dump(node), tuple(self.flow.version(n, st) for n in free_names(node)))

    def _last(self, node, st, fr):
        """The LAST atom of an enclosing counted loop, when the test reads its counter that way (or
        True / False for a test every turn passes / fails: ``i < len(samples)``)."""
        if not isinstance(node, ast.Compare):
            return None
        for loop in reversed(fr.loops):
            if loop.counter is None or loop.bound is None:
                continue
            is_last = last_form(node, loop.counter, loop.bound)
            if is_last is None:
                named = self._bound_named(node, loop.bound, fr)
                is_last = last_form(named, loop.counter, loop.bound) if named is not None else None
            if is_last is None:
                whole = _whole_range(named if named is not None else node, loop)
                if whole is not None:
                    return whole
                continue
            atom = self.flow.last_atom(loop)
            if atom is None:
                return None
            if not is_last:
                return _Negated(atom)
            return atom
        return None

    def _bound_named(self, node, bound: str, fr):
        """The test with a name bound once to the loop's bound written as that bound:
        ``n = len(microbatches)`` ... ``idx != n - 1`` inside ``for idx, x in enumerate(microbatches)``."""
        if not isinstance(fr.scope, Function):
            return None
        assigns = self.flow.values.info(fr.scope).assigns
        swapped = [False]
        out = ast.copy_location(ast.Compare(_swap(node.left, assigns, bound, swapped), node.ops,
                                            [_swap(c, assigns, bound, swapped) for c in node.comparators]), node)
        return out if swapped[0] else None

    def _record_field(self, attribute: ast.Attribute, fr) -> bool:
        """Is ``cfg.grad_accum`` a field of a record class (a dataclass) on every value of ``cfg``? Only
        there is a default every builder left alone the value (a constructor parameter's default of 1,
        in a trainer meant to be configured by whoever builds it, is not folded)."""
        from synccheck.analyzer.project.values import Inst
        owners = self.flow.values.expr(attribute.value, fr.scope)
        values = self.flow.values
        return bool(owners) and all(isinstance(v, Inst) and any(name == attribute.attr
                                                                  for name, _ in values.record_fields(v.cls))
                                    for v in owners)

    def _none_test(self, node, st, fr) -> Optional[bool]:
        """``loss_scaler is not None`` where every value the name may hold is None (each caller passes
        None: that branch never runs), or none is (and none is unknown)."""
        if not (len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) and
                isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None and
                isinstance(node.left, ast.Name)):
            return None
        from synccheck.analyzer.project.values import Const
        vals = self.flow.expr(node.left, st, fr).values
        if not vals:
            return None
        if all(isinstance(v, Const) and v.value is None for v in vals):
            is_none = True
        elif all(type(v).__name__ in _NEVER_NONE for v in vals):
            is_none = False
        else:
            return None
        return is_none if isinstance(node.ops[0], ast.Is) else not is_none

    def _fold(self, node, fr) -> Optional[bool]:
        """``x % 1 == 0`` where the modulus is a constant 1 (accumulation that cannot happen)."""
        mod = mod_form(node)
        if mod is None:
            return None
        try:
            modulus = ast.literal_eval(_parse_dump(mod[1]))
        except Exception:
            modulus = None
        if modulus is None:
            name = _name_in_dump(mod[1])
            modulus = self.flow.constant(name, fr) if name else None
        # ``cfg.grad_accum`` back from its dump, placed at the test (None for a plain name)
        made = _attribute_from_dump(mod[1]) if modulus is None else None
        if made is not None:
            for part in ast.walk(made):
                ast.copy_location(part, node)
        if modulus is None and fr.ones:
            # inside ``else:`` of ``if cfg.ACCUMULATION_STEPS > 1:`` the count is 1 (Swin's trainer)
            text = ast.unparse(made) if made is not None else _name_in_dump(mod[1])
            modulus = 1 if text in fr.ones else None
        if modulus is None and made is not None and self._record_field(made, fr):
            # ``(i + 1) % cfg.grad_accum == 0`` with a record field left to its default of 1
            from synccheck.analyzer.project.values import Const
            vals = self.flow.values.expr(made, fr.scope)
            if len(vals) == 1:
                (v,) = tuple(vals)
                modulus = v.value if isinstance(v, Const) and isinstance(v.value, int) else None
        if modulus == 1:
            return True
        return None


class _Negated:
    """Stands for ``not LAST``: literal() turns it back into guards."""
    def __init__(self, atom) -> None:
        self.atom = atom


def _swap(n, assigns: dict, bound: str, swapped: list):
    """``n`` with each name bound once to the expression dumped as ``bound`` written as it.
    (A plain function, not a closure: a recursive closure keeps the trees alive in a cycle.)"""
    if isinstance(n, ast.Name):
        found = assigns.get(n.id, ())
        if len(found) == 1 and not found[0][1] and ast.dump(found[0][0]) == bound:
            swapped[0] = True
            return found[0][0]
        return n
    if isinstance(n, ast.BinOp):
        return ast.BinOp(_swap(n.left, assigns, bound, swapped), n.op, _swap(n.right, assigns, bound, swapped))
    return n


def _whole_range(node, loop) -> Optional[bool]:
    """``t < n`` (always) or ``t >= n`` / ``t == n`` (never) for a loop counting ``t`` from 0 to ``n``."""
    if len(node.ops) != 1 or loop.info.start != 0:
        return None
    left, right, op = node.left, node.comparators[0], node.ops[0]
    if not (isinstance(left, ast.Name) and left.id == loop.counter):
        return None
    if ast.dump(right) == loop.bound:
        # ``t < n`` / ``t != n`` / ``t <= n`` always hold; ``t == n`` (an off-by-one: ``sync = micro ==
        # accum``), ``t >= n`` and ``t > n`` never do
        return True if isinstance(op, (ast.Lt, ast.NotEq, ast.LtE)) else \
            False if isinstance(op, (ast.GtE, ast.Eq, ast.Gt)) else None
    # ``t <= n - 1`` (always: the ExitStack's no_sync entered on the last chunk too), ``t > n - 1`` (never)
    if isinstance(right, ast.BinOp) and isinstance(right.op, ast.Sub) and ast.dump(right.left) == loop.bound and \
            isinstance(right.right, ast.Constant) and right.right.value == 1:
        return True if isinstance(op, ast.LtE) else False if isinstance(op, ast.Gt) else None
    return None


def _bound(node, versions) -> Optional[tuple]:
    """(what is compared, operator, number) of ``x == 1``, ``cfg.accum > 1``, ``n >= 2`` (Atoms.get)."""
    if type(node) is not ast.Compare or len(node.ops) != 1 or type(node.ops[0]) not in COMPARISONS:
        return None
    right = node.comparators[0]
    if type(right) is not ast.Constant or type(right.value) not in (int, float):
        return None
    return (ast.dump(node.left), versions), type(node.ops[0]), right.value



# values that are an object, never None (a parameter every caller hands a wrapper, an optimizer, a scaler)
_NEVER_NONE = frozenset(("Wrapper", "Optim", "Framework", "Scaler", "NativeScaler", "Sampler", "Loader", "Inner"))


def _constant(value) -> Optional[bool]:
    from synccheck.analyzer.project.values import Const
    vals = value.values
    if len(vals) == 1:
        (v,) = tuple(vals)
        if isinstance(v, Const) and isinstance(v.value, (bool, int)) or (isinstance(v, Const) and v.value is None):
            return bool(v.value)
    return None


def _parse_dump(dump: str):
    # mod_form keys the modulus by ast.dump; a constant's dump is "Constant(value=1)"
    if dump.startswith("Constant(value=") and dump.endswith(")"):
        return dump[len("Constant(value="):-1]
    raise ValueError(dump)


_ATTRIBUTE_DUMP = re.compile(r"Attribute\(value=(.*), attr='(\w+)', ctx=Load\(\)\)$")


def _attribute_from_dump(dump: str):
    """``cfg.grad_accum`` (or ``self.cfg.grad_accum``) back from its ``ast.dump``; None for anything else."""
    match = _ATTRIBUTE_DUMP.match(dump)
    if match is None:
        return None
    inner, attr = match.groups()
    if inner.startswith("Name(id='"):
        value = ast.Name(_name_in_dump(inner), ast.Load())
    else:
        value = _attribute_from_dump(inner)
        if value is None:
            return None
    return ast.Attribute(value, attr, ast.Load())


def _name_in_dump(dump: str) -> Optional[str]:
    if dump.startswith("Name(id='"):
        return dump[len("Name(id='"):].split("'", 1)[0]
    if dump.startswith("Attribute("):
        return None
    return None


def _below_last(node):
    """(counter, modulus) of ``i < n - 1`` (a Name counter), else None."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Lt) and \
            isinstance(node.left, ast.Name):
        right = node.comparators[0]
        if isinstance(right, ast.BinOp) and isinstance(right.op, ast.Sub) and isinstance(right.right, ast.Constant) \
                and right.right.value == 1 and isinstance(right.left, (ast.Name, ast.Attribute)):
            return node.left, right.left
    return None
