"""Values of record fields: a dataclass, a ``typing.NamedTuple`` or an attrs class gets its fields from
the calls that build it (``State(model=DDP(net), opt=opt)``), not from ``self.x = ...`` stores. A part
of Values (values.py)."""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project.definitions import called_name
from synccheck.analyzer.project.value_types import Cls, Const, Framework, Inst, Obj, Unknown, Wrapper

_RECORD_DECORATORS = frozenset(("dataclass", "define", "frozen", "mutable", "s", "attrs"))


class RecordValues:
    def record_fields(self, klass) -> tuple:
        """The field names of a record class in the order its constructor takes them (bases' first);
        () for any other class."""
        key = ("record", klass.uid)
        if key not in self._plain:
            self._plain[key] = ()
            chain = [k for k in reversed(self.project.mro(klass)) if k.node is not None]
            record = any(called_name(d) in _RECORD_DECORATORS for k in chain for d in k.node.decorator_list) or any(
                called_name(b) == "NamedTuple"
                for k in chain for b in k.node.bases)
            fields = {}
            if record and "__init__" not in klass.methods:
                for k in chain:
                    for stmt in k.node.body:
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                                stmt.target.id not in fields and "ClassVar" not in ast.unparse(stmt.annotation):
                            fields[stmt.target.id] = (k.module, stmt)
            self._plain[key] = tuple(fields.items())
        return self._plain[key]

    def record_field(self, klass, attr: str) -> frozenset:
        """What the calls that build ``klass`` pass for field ``attr`` (by keyword or by position)."""
        fields = [name for name, _ in self.record_fields(klass)]
        if attr not in fields:
            return frozenset()
        index = fields.index(attr)
        out = set()
        builders, spread = 0, False
        for scope, call in self.calls(klass.node.name):
            if not any(isinstance(v, Cls) and v.cls is klass for v in self.expr(call.func, scope)):
                continue
            builders += 1
            # ``TrainConfig(**vars(args))``: any field may be given
            spread = spread or any(kw.arg is None for kw in call.keywords) or \
                any(isinstance(a, ast.Starred) for a in call.args)
            given = next((kw.value for kw in call.keywords if kw.arg == attr), None)
            if given is None and index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args):
                given = call.args[index]
            if given is not None:
                out |= self.expr(given, scope)
        if not out and builders and not spread:
            # every builder in view leaves the field to its default (``grad_accum: int = 1``): that is
            # its value, unless the class is also handed to something that may fill it (a CLI parser)
            default = self._field_default(klass, attr)
            if default is not None:
                return default
        if not out or not any(isinstance(v, (Wrapper, Framework)) for v in out):
            # built out of view (a CLI parser, a config loader), or given a value made out of view
            # (``TrainState(model=init_and_wrap(net))``): what its annotation says it holds
            module, stmt = dict(self.record_fields(klass))[attr]
            made, named = self.annotated(module, stmt.annotation, stmt)
            if made:
                # (what was given is made out of view: the annotation says what it is)
                out = {v for v in out if not isinstance(v, (Obj, Unknown))}
            out |= made | ({Inst(named)} if named is not None and not out else set())
        return frozenset(out)

    def _field_default(self, klass, attr: str):
        """The literal default of field ``attr``, where the class's name is only ever called, annotated,
        imported or defined in the parsed modules (not given to ``tyro.cli``, ``HfArgumentParser``,
        ``dataclasses.replace``...) and no code outside stores the field; else None."""
        module, stmt = dict(self.record_fields(klass))[attr]
        if not isinstance(stmt.value, ast.Constant) or not isinstance(stmt.value.value, (int, bool)):
            return None
        name = klass.node.name
        uses = re.compile(r"(?<![\w.])" + re.escape(name) + r"\b(?!\s*[(:\]])")
        fine = re.compile(r"^\s*(?:from\s+\S+\s+)?import\b|^\s*class\s+" + re.escape(name) + r"\b|[:>]\s*\"?" +
                          re.escape(name) + r"\b")
        for m in self.project.modules():
            if name not in m.text:
                continue
            if "replace(" in m.text or f".{attr} =" in m.text or f'"{attr}"' in m.text or f"'{attr}'" in m.text:
                return None
            for line in m.text.splitlines():
                if name in line and uses.search(line) and not fine.search(line):
                    return None
        return frozenset((Const(stmt.value.value),))
