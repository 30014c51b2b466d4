"""Conditions as formulas: which micro-steps does a branch, a sync control or an optimizer step run on?

The sync analysis keeps, beside each state, the set of *assignments* of the conditions that matter
under which the state is reached. A condition that matters is an *atom*: ``(i + 1) % n == 0``, a
counter test ``micro == accum``, the loop's last iteration ``i == len(loader) - 1``, a helper's
``is_last`` parameter bound to one of those. With at most ``MAX_ATOMS`` atoms an assignment is a
number below ``2 ** MAX_ATOMS`` and a set of assignments is a Python int used as a bit set (a truth
table): and, or and not are single integer operations, equal formulas are equal ints, and the cost
does not grow with the number of paths through the code.

Two kinds of knowledge prune assignments that cannot happen:
* ``(i + c) % n == r`` forms over the same ``i`` and ``n`` exclude each other unless ``r - c`` agree
  (so an off-by-one between a sync condition and the step's condition is visible);
* an atom is keyed by its expression *and* the definitions of the names it reads, so
  ``i % n == 0`` before and after ``i += 1`` are different atoms.
Conditions beyond the budget, or that no event depends on, are not atoms: both branches are taken
under the same assignments (a *may* answer), and the rules only report verdicts that hold on every
assignment of the step's own conditions.
"""
from __future__ import annotations

import ast
from typing import Optional

MAX_ATOMS = 10
WIDTH = 1 << MAX_ATOMS
TRUE = (1 << WIDTH) - 1
FALSE = 0


def _atom_mask(k: int) -> int:
    """The assignments in which atom ``k`` is true: blocks of 2**k ones every 2**(k+1) bits."""
    block = ((1 << (1 << k)) - 1) << (1 << k)
    period = 1 << (k + 1)
    mask = 0
    for start in range(0, WIDTH, period):
        mask |= block << start
    return mask


MASKS = [_atom_mask(k) for k in range(MAX_ATOMS)]


def exists(formula: int, k: int) -> int:
    """Forget atom ``k``: the assignments that agree with some member of ``formula`` on every other atom."""
    shift = 1 << k
    low = formula & ~MASKS[k] & TRUE
    high = formula & MASKS[k]
    return low | (low << shift) | high | (high >> shift)


def depends_on(formula: int, k: int) -> bool:
    shift = 1 << k
    return (formula & ~MASKS[k] & TRUE) != ((formula & MASKS[k]) >> shift)


def assignments(formula: int):
    """The assignment numbers in a formula."""
    while formula:
        low = formula & -formula
        yield low.bit_length() - 1
        formula ^= low


class Atom:
    __slots__ = ("index", "key", "text", "mod", "loop", "counter", "negated", "first", "after")

    def __init__(self, index: int, key, text: str, mod=None) -> None:
        self.index = index
        self.key = key
        self.text = text
        self.mod = mod            # (counter key, modulus key, residue) for ``(i + c) % n == r``
        self.loop = None          # the loop whose last iteration this is (LAST atoms)
        self.counter = None       # the loop whose counter a mod form reads (first-iteration values)
        self.negated = None       # the text of the code's own negation (``i % n != 0``), if it wrote one
        self.first = None         # (loop, holds on its first iteration) for ``i == 0`` on the loop's counter
        self.after = ""           # `` (after `step += 1`)``: a test of a count moved on since its other tests

    def says(self, value: bool) -> str:
        """A true statement about this atom's value, in the code's own words where it has them."""
        if self.loop is not None:
            return f"on {self.text}" if value else f"before {self.text}"
        if not value and self.negated:
            return f"`{self.negated}` is true{self.after}"
        return f"`{self.text}` is {'true' if value else 'false'}{self.after}"


# a comparison's operator -> what it says of two numbers (conditions.py reads tests with it too)
COMPARISONS = {ast.Eq: lambda x, n: x == n, ast.Lt: lambda x, n: x < n, ast.LtE: lambda x, n: x <= n,
               ast.Gt: lambda x, n: x > n, ast.GtE: lambda x, n: x >= n}


class Atoms:
    """The atom table of one analysis (one training loop and everything it calls)."""

    def __init__(self) -> None:
        self.by_key: dict = {}
        self.atoms: list = []
        self.universe = TRUE
        self.overflowed = False
        self.bounds: dict = {}       # what is compared -> [(atom, operator, number)] (get's ``bound``)
        self.windows: dict = {}      # (counter, modulus) -> the atoms of ``i < n - 1`` (window_bound)

    def window_bound(self, atom: Atom, counted: tuple) -> None:
        """``atom`` is ``i < n - 1`` on (counter, modulus) ``counted``: with ``i`` counting from 0 it
        never holds together with ``(i + 1) % n == 0`` (``i % n == n - 1``), whichever is made first."""
        known = self.windows.setdefault(counted, [])
        if atom in known:
            return
        known.append(atom)
        for other in self.atoms:
            if other.mod is not None and other.mod[:2] == counted and _last_of_window(other.mod):
                self.universe &= ~(MASKS[atom.index] & MASKS[other.index]) & TRUE

    def get(self, key, text: str, mod=None, bound=None) -> Optional[Atom]:
        """The atom of ``key``, made on first use. ``mod``: (counter, modulus, residue) of a modular
        test; ``bound``: (what is compared, operator, number) of ``x == 1``, ``x > 1``, ``x >= 2``: two
        tests of one value against numbers that cannot both hold, or one that implies the other,
        are said so in the universe."""
        atom = self.by_key.get(key)
        if atom is not None:
            return atom
        if len(self.atoms) >= MAX_ATOMS:
            self.overflowed = True
            return None
        atom = Atom(len(self.atoms), key, text, mod)
        self.atoms.append(atom)
        self.by_key[key] = atom
        if mod is not None and _last_of_window(mod):
            for other in self.windows.get(mod[:2], ()):
                self.universe &= ~(MASKS[atom.index] & MASKS[other.index]) & TRUE
        if mod is not None:
            for other in self.atoms[:-1]:
                if other.mod is not None and other.mod[:2] == mod[:2] and not _compatible(other.mod, mod):
                    # both true is impossible: (i + c) % n == 0 and (i + d) % n == 0 with c != d
                    self.universe &= ~(MASKS[atom.index] & MASKS[other.index]) & TRUE
        if bound is not None:
            self.bounds.setdefault(bound[0], []).append((atom, bound[1], bound[2]))
            for other, op, number in self.bounds[bound[0]][:-1]:
                self._relate(atom, bound[1], bound[2], other, op, number)
        return atom

    def _relate(self, a: Atom, op_a, num_a, b: Atom, op_b, num_b) -> None:
        # the number line splits at the two numbers: a point on each side and between decides
        points = [n + d for n in (num_a, num_b) for d in (-1, -0.5, 0, 0.5, 1)]
        both = [(COMPARISONS[op_a](p, num_a), COMPARISONS[op_b](p, num_b)) for p in points]
        a_mask, b_mask = MASKS[a.index], MASKS[b.index]
        if not any(x and y for x, y in both):
            self.universe &= ~(a_mask & b_mask) & TRUE
        if all(y for x, y in both if x):
            self.universe &= ~(a_mask & ~b_mask) & TRUE
        if all(x for x, y in both if y):
            self.universe &= ~(b_mask & ~a_mask) & TRUE

    def formula(self, atom: Atom, value: bool = True) -> int:
        mask = MASKS[atom.index]
        return (mask if value else ~mask & TRUE) & self.universe

    def describe_assignment(self, assignment: int, among) -> str:
        """Words for one assignment of some atoms: `(i + 1) % n == 0` is false, ..."""
        return _and([self.atoms[index].says(bool(assignment >> index & 1)) for index in among])

    def describe(self, formula: int, among: Optional[set] = None) -> str:
        """Words for a conjunction: ``(i + 1) % n == 0`` is false, on the last micro-step, ..."""
        parts = []
        for atom in self.atoms:
            if among is not None and atom.index not in among:
                continue
            on = formula & MASKS[atom.index]
            off = formula & ~MASKS[atom.index] & TRUE
            if bool(on) != bool(off):
                parts.append(atom.says(bool(on)))
        return _and(parts)


def _and(parts: list) -> str:
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def _compatible(a, b) -> bool:
    """Two mod forms over the same counter and modulus can both hold only with the same residue."""
    return a[2] == b[2]


def mod_form(node: ast.AST):
    """``(x + c) % n == r`` (or ``x % n == n - 1``) -> (x dump, n dump, r - c); None otherwise."""
    parts = mod_parts(node)
    return None if parts is None else (ast.dump(parts[0]), ast.dump(parts[1]), parts[2])


def mod_parts(node: ast.AST):
    """``(x + c) % n == r`` -> (x, n, r - c) with x and n the expressions; None otherwise."""
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
    if isinstance(right, ast.Constant) and isinstance(right.value, int) and not isinstance(right.value, bool):
        residue = right.value
    elif isinstance(right, ast.BinOp) and isinstance(right.op, ast.Sub) and \
            ast.dump(right.left) == modulus and isinstance(right.right, ast.Constant):
        residue = -right.right.value
    else:
        return None
    return base, left.right, residue - offset


def _last_of_window(mod: tuple) -> bool:
    """Is the modular test (counter, modulus, residue) ``(i + 1) % n == 0`` on a modulus that is not a
    number (a number's residue is kept modulo it: those are never ``i < n - 1``'s, see _below_last)?"""
    return mod[2] == -1


def last_form(node: ast.AST, target: str, bound: str) -> Optional[bool]:
    """``t == n - 1`` / ``t + 1 == n`` / ``t >= n - 1`` for ``for t in range(n)``: True when the test means
    "this is the last iteration", False when it means "not the last" (``t < n - 1``), else None."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return None
    op = node.ops[0]
    left, right = node.left, node.comparators[0]

    def is_t(n) -> bool:
        return isinstance(n, ast.Name) and n.id == target

    def minus_one(n) -> bool:
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and ast.dump(n.left) == bound and \
            isinstance(n.right, ast.Constant) and n.right.value == 1

    def plus_one(n) -> bool:
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and is_t(n.left) and \
            isinstance(n.right, ast.Constant) and n.right.value == 1

    if (is_t(left) and minus_one(right)) or (plus_one(left) and ast.dump(right) == bound):
        if isinstance(op, (ast.Eq, ast.GtE)):
            return True
        if isinstance(op, (ast.Lt, ast.NotEq)):
            return False
    if is_t(left) and ast.dump(right) == bound and isinstance(op, ast.Lt):
        return None
    return None


def first_value(atom: Atom) -> Optional[bool]:
    """The value of a mod-form atom on its loop's first iteration (counter 0): ``(0 + c) % n == r``
    holds exactly when ``r - c`` is 0 (n > 1)."""
    if atom.mod is None:
        return None
    return atom.mod[2] == 0
