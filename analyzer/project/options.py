"""What a switch is when nobody passes it: a literal, a parameter's default or what every caller hands
it, and the defaults of a script's argparse options (``--no-static-graph`` stored false: the option is
on by default; ``static_graph=not args.find_unused`` with a store_true flag: on too).

Used for options that change a rule's verdict only when they are on (DDP's ``static_graph``): an
option we cannot read is not known to be on.
"""
from __future__ import annotations

import ast
from typing import Optional

from synccheck.analyzer.project.definitions import Function
from synccheck.analyzer.project.value_helpers import _argument, parameter_default

MAX_DEPTH = 4


def known_bool(values, node, scope, depth: int = 0) -> Optional[bool]:
    """True / False when the code says what ``node`` is on a run with default options, else None."""
    if depth > MAX_DEPTH or node is None:
        return None
    if isinstance(node, ast.Constant):
        return bool(node.value) if isinstance(node.value, (bool, int, str, type(None))) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = known_bool(values, node.operand, scope, depth + 1)
        return None if inner is None else not inner
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls"):
        return option_default(values, node.attr)
    if not isinstance(node, ast.Name):
        return None
    bound = values.bound_expressions(node.id, scope)
    if bound:
        found = {known_bool(values, value, where, depth + 1) for value, where in bound}
        return found.pop() if len(found) == 1 else None
    if not (isinstance(scope, Function) and node.id in scope.params):
        return None
    default = parameter_default(scope.node, node.id)
    if default is not None and not (isinstance(default, ast.Constant) and default.value is None):
        return known_bool(values, default, scope, depth + 1)
    # a parameter without a default: what every caller hands it
    index = scope.params.index(node.id)
    found = set()
    for caller, call, shift in values.callers(scope):
        arg = _argument(call, scope, node.id, index, shift)
        found.add(known_bool(values, arg, caller, depth + 1) if arg is not None else None)
        if None in found or len(found) > 1:
            return None
    return found.pop() if len(found) == 1 else None


def option_default(values, dest: str) -> Optional[bool]:
    """The default of the argparse option stored under ``dest`` in the parsed modules of the project
    (or of the dataclass field, ``static_graph: bool = True`` in a ``@dataclass`` config), when they
    agree and say it (``action="store_false"``: True; ``default=True``); else None."""
    table = getattr(values, "_option_defaults", None)
    if table is None:
        table = values._option_defaults = {}
    found = set()
    for module in list(values.project.by_path.values()):
        if "add_argument" not in module.text and "dataclass" not in module.text:
            continue
        options = table.get(module.path)
        if options is None:
            options = table[module.path] = _defaults(module.tree)
        if dest in options:
            found.add(options[dest])
    return found.pop() if len(found) == 1 else None


def _defaults(tree) -> dict:
    out: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                        isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, bool):
                    name = stmt.target.id
                    out[name] = stmt.value.value if out.get(name, stmt.value.value) == stmt.value.value else None
            continue
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
                node.func.attr == "add_argument"):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        dest = keywords.get("dest")
        if isinstance(dest, ast.Constant) and isinstance(dest.value, str):
            name = dest.value
        else:
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            long = [f for f in flags if f.startswith("--")]
            if not long:
                continue
            name = long[0][2:].replace("-", "_")
        action = keywords.get("action")
        action = action.value if isinstance(action, ast.Constant) else \
            ast.unparse(action).rsplit(".", 1)[-1] if action is not None else None
        default = keywords.get("default")
        value: Optional[bool] = None
        if isinstance(default, ast.Constant) and isinstance(default.value, bool):
            value = default.value
        elif default is None and action == "store_false":
            value = True
        elif default is None and action == "store_true":
            value = False
        if name in out and out[name] != value:
            value = None
        out[name] = value
    return out


def keyword_argument(call: ast.Call, name: str, info, depth: int = 0):
    """The expression given for keyword ``name``: spelled out, or inside a ``**cfg`` whose dict is
    built in this function (``dict(...)`` or ``{...}``, then ``cfg.update(more)``), or a ``**{...}`` literal."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Name):
            found = _dict_entry(k.value.id, name, info, depth)
            if found is not None:
                return found
        elif k.arg is None and isinstance(k.value, ast.Dict):      # ``**{"shuffle": False}``
            found = _literal_entry(k.value, name)
            if found is not None:
                return found
    return None


def _dict_entry(var: str, key: str, info, depth: int):
    if depth > 3:
        return None
    for stored, value in getattr(info, "item_stores", {}).get(var, ()):
        # ``trainer_kwargs["strategy"] = DDPStrategy(static_graph=True)`` (latent-diffusion's main.py)
        if stored == key:
            return value
    sources = [value for value, path in info.assigns.get(var, ()) if not path]
    sources += [c.args[0] for c in info.calls if c.args and isinstance(c.func, ast.Attribute) and
                c.func.attr == "update" and isinstance(c.func.value, ast.Name) and c.func.value.id == var]
    for value in sources:
        if isinstance(value, ast.Dict):
            found = _literal_entry(value, key)
            if found is not None:
                return found
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            found = keyword_argument(value, key, info, depth + 1)
            if found is not None:
                return found
        elif isinstance(value, ast.Name):
            found = _dict_entry(value.id, key, info, depth + 1)
            if found is not None:
                return found
    return None


def _literal_entry(value: ast.Dict, key: str):
    for k, v in zip(value.keys, value.values):
        if isinstance(k, ast.Constant) and k.value == key:
            return v
    return None
