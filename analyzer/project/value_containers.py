"""Stage 5 of the pipeline (values), part 3: containers and iteration.

Lists grown by ``append`` / ``extend``, dicts filled by ``d[k] = v``, tuples unpacked, and what one
turn of ``for x in ...`` binds (``enumerate``, ``zip``, ``.values()``, ``.items()``): a loop over a list
of optimizers or models carries their elements. ``ContainerValues`` is the part of ``values.Values``
that does this.
"""
from __future__ import annotations

import ast

from synccheck.analyzer.project.value_types import ONE_UNKNOWN, UNKNOWN, Bag, Tup, _cap


class ContainerValues:
    """What lists, dicts and tuples hold, and what iterating over them binds (a part of Values)."""

    def _grown(self, name: str, out: set, info, scope) -> set:
        """A list or dict the scope fills in place (``models.append(unet)``, ``opts["g"] = opt``)
        holds what was put in it too."""
        stores = info.item_stores.get(name, ())
        added = [value for key, value in stores if key is None]
        keyed = [(key, value) for key, value in stores if key is not None]     # ``config["epochs"] = 2``
        spread = []
        for call in info.calls:
            func = call.func
            if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == name:
                if func.attr in ("append", "add") and call.args:
                    added.append(call.args[0])
                elif func.attr in ("insert", "setdefault") and len(call.args) > 1:
                    added.append(call.args[1])
                elif func.attr in ("extend", "update") and call.args:
                    spread.append(call.args[0])
        if not added and not spread and not keyed:
            return out
        items, is_dict, rest, fields = set(), False, set(), ()
        for v in out:
            if isinstance(v, Tup):
                items.update(x for part in v.items for x in part)
            elif isinstance(v, Bag):
                items |= v.items
                is_dict = is_dict or v.keyed
                fields = fields or v.fields      # the literal's entries still hold, with more beside them
            else:
                rest.add(v)
        if len(rest) == len(out):
            return out
        for node in added:
            items |= self.expr(node, scope)
        for node in spread:
            items |= self.elements(self.expr(node, scope), values_of_dict=True)
        if keyed:
            # a store under a key the literal has, or a new one, is that entry's: writing
            # ``config["num_epochs"]`` leaves ``config["batch_size"]`` what the literal says. So does a
            # dict that starts empty and is filled only by keys (``train_args = {}``, then
            # ``train_args["optimizer"] = optimizer``, ``train_args["lr_scheduler"] = scheduler``)
            named = bool(fields) or (is_dict and not items and not added and not spread and
                                     all(isinstance(key, str) for key, _ in keyed))
            entries = dict(fields)
            for key, node in keyed:
                vals = self.expr(node, scope)
                items |= vals
                if named:
                    entries[key] = _cap(entries.get(key, frozenset()) | vals)
            fields = tuple(entries.items())
        return rest | {Bag(_cap(items), is_dict, fields)}

    def _iterated(self, name: str, info, scope) -> frozenset:
        """What ``for name in expr`` binds: the elements of a list or tuple we know, else unknown."""
        out = set()
        for node, path in info.fors.get(name, ()):
            out |= self.unpack(self.iteration(node, scope), path, node, scope)
        return frozenset(out) or ONE_UNKNOWN

    def iteration(self, node, scope) -> frozenset:
        """The values one turn of ``for x in node`` gives ``x``."""
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id == "enumerate":
                return frozenset((Tup((ONE_UNKNOWN, self.iteration(node.args[0], scope))),))
            if isinstance(func, ast.Name) and func.id == "zip":
                return frozenset((Tup(tuple(self.iteration(a, scope) for a in node.args)),))
            if isinstance(func, ast.Name) and func.id in ("list", "tuple", "reversed", "sorted", "iter"):
                return self.iteration(node.args[0], scope)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            if node.func.attr == "values":
                return self.elements(self.expr(node.func.value, scope), values_of_dict=True)
            if node.func.attr == "items":
                return frozenset((Tup((ONE_UNKNOWN, self.elements(self.expr(node.func.value, scope),
                                                                   values_of_dict=True))),))
        return self.elements(self.expr(node, scope))

    @staticmethod
    def elements(values: frozenset, values_of_dict: bool = False) -> frozenset:
        out = set()
        for v in values:
            if isinstance(v, Tup):
                out.update(x for part in v.items for x in part)
            elif isinstance(v, Bag) and (values_of_dict or not v.keyed):
                out |= v.items
            else:
                out.add(UNKNOWN)
        return frozenset(out) or ONE_UNKNOWN
