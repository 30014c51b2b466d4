"""Stage 5 of the pipeline (values), part 2: the syntax the value analysis reads.

Plain functions over the ``ast``: the call sites of a name found from the text first (``CALL_WORD``,
``_call_lines``, ``_calls_named``: in call_sites.py), call arguments matched to parameters (``_argument``,
``parameter_default``), the options a constructor was given (``Accelerator(gradient_accumulation_steps=...)``,
``Fabric(devices=1)``), ``self.attr = value`` stores of a class, the receivers of ``.parameters()`` an
optimizer was built from, and integer arithmetic on known constants.
"""
from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

# the call sites of a name, found from the text first: in call_sites.py, re-exported here
from synccheck.analyzer.project.call_sites import CALL_WORD, _call_lines, _calls_named, call_lines  # noqa: F401
from synccheck.analyzer.project.definitions import Class, External, Function, Module, ModuleRef, called_name  # noqa: F401
from synccheck.analyzer.project.scopes import scope_attribute_stores
from synccheck.analyzer.project.traversal import walk
from synccheck.analyzer.project.value_types import ONE_UNKNOWN, Bag, Cls, Const, Ext, Mod, Tup, _cap

if TYPE_CHECKING:
    from synccheck.analyzer.project.values import Values

# ``obj.attr = value`` (or ``a.b.attr = value``) where obj is not ``self``: a store from outside a class
_OUTSIDE_STORE = re.compile(r"(?<![\w.])(?!self\.\w+[ \t]*=)[A-Za-z_]\w*(?:\.\w+)+[ \t]*(?:=(?!=)|,)")


def _strings(node, info, depth: int = 0) -> list:
    """The string constants an expression can be: a literal, a conditional of literals, or a local
    name bound only to those."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.IfExp):
        body, orelse = _strings(node.body, info, depth), _strings(node.orelse, info, depth)
        return body + orelse if body and orelse else []
    if isinstance(node, ast.Name) and depth < 3 and node.id in info.assigns and node.id not in info.for_names:
        out = []
        for value, path in info.assigns[node.id]:
            found = _strings(value, info, depth + 1) if not path else []
            if not found:
                return []
            out.extend(found)
        return out
    return []


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _arithmetic(op, left: frozenset, right: frozenset) -> frozenset:
    """Integer arithmetic on constants we know (``batch_size // MAX_GPU_BATCH_SIZE``), and lists joined
    (``create_sampler(...) + [None, None]``: the elements of both), else unknown."""
    if isinstance(op, ast.Add) and any(isinstance(v, (Tup, Bag)) for v in left) and \
            any(isinstance(v, (Tup, Bag)) for v in right):
        joined = set()
        for a in left:
            for b in right:
                if isinstance(a, Tup) and isinstance(b, Tup):
                    joined.add(Tup(a.items + b.items))
                elif isinstance(a, (Tup, Bag)) and isinstance(b, (Tup, Bag)) and not getattr(a, "keyed", False) and \
                        not getattr(b, "keyed", False):
                    items = [frozenset(x.items) if isinstance(x, Bag) else frozenset().union(*x.items) for x in (a, b)]
                    joined.add(Bag(_cap(items[0] | items[1]), False))
        if joined:
            return _cap(joined)
    fn = _ARITHMETIC.get(type(op))
    out = set()
    for a in left:
        for b in right:
            if fn is None or not (isinstance(a, Const) and isinstance(b, Const)) or \
                    type(a.value) is not int or type(b.value) is not int or abs(a.value) > 1 << 32 or \
                    abs(b.value) > 1 << 32:
                return ONE_UNKNOWN
            try:
                out.add(Const(fn(a.value, b.value)))
            except ZeroDivisionError:
                return ONE_UNKNOWN
    return _cap(out) if out and len(out) <= 8 else ONE_UNKNOWN


def _reaching(assigns, reach) -> list:
    """The bindings a use can see (``ScopeInfo.reaching``): all of them when ``reach`` is None."""
    if reach is None:
        return list(assigns)
    return [assigns[i] for i in reach[0]]


def _mentions(node, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in walk(node))


def _class_attrs(values: "Values", klass: Class) -> dict:
    """attr -> [(scope, value, unpack path)] for ``self.attr = value`` in the class's methods and
    ``attr = value`` in its body, indexed once per class."""
    if klass.attrs is None:
        table: dict = {}
        for method in klass.methods.values():
            # (the stores alone: the methods' whole ScopeInfo is read only where it is needed)
            for attr, items in scope_attribute_stores(method).self_attrs.items():
                table.setdefault(attr, []).extend((method, value, path) for value, path in items)
        for stmt in klass.node.body:
            if isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        table.setdefault(t.id, []).append((klass.module, stmt.value, ()))
        klass.attrs = table
    return klass.attrs


def _symbol_of(v):
    if isinstance(v, Mod):
        return ModuleRef(v.module)
    if isinstance(v, Ext):
        return External(v.qualname)
    if isinstance(v, Cls):
        return v.cls
    return None


def parameter_default(node, name: str):
    """The default expression of parameter ``name`` of a function node, or None."""
    args = node.args
    positional = args.posonlyargs + args.args
    offset = len(positional) - len(args.defaults)
    for i, a in enumerate(positional):
        if a.arg == name:
            return args.defaults[i - offset] if i >= offset else None
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if a.arg == name:
            return d
    return None


def _argument(call: ast.Call, fn: Function, name: str, index: int, shift: int):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    position = index - shift
    positional = []
    for a in call.args:
        if isinstance(a, ast.Starred):
            return None
        positional.append(a)
    if 0 <= position < len(positional) and name not in [a.arg for a in fn.node.args.kwonlyargs]:
        return positional[position]
    return None


def _first_arg(call: ast.Call, keyword: str):
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return _kw(call, keyword)


def _kw(call: ast.Call, keyword: str):
    return next((kw.value for kw in call.keywords if kw.arg == keyword), None)


def _truthy(node) -> bool:
    return not (isinstance(node, ast.Constant) and node.value in (False, None, 0))


def _accumulates(call: ast.Call) -> str:
    names = {kw.arg for kw in call.keywords}
    if "gradient_accumulation_steps" in names or "gradient_accumulation_plugin" in names:
        steps = _kw(call, "gradient_accumulation_steps")
        if isinstance(steps, ast.Constant) and steps.value == 1:
            return "no"
        return "yes"
    if None in names or any(isinstance(a, ast.Starred) for a in call.args):
        return "unknown"       # Accelerator(**kwargs)
    if "deepspeed_plugin" in names or "deepspeed_plugins" in names:
        return "unknown"       # the DeepSpeed config (or ``accelerate launch``) says how many micro-steps
    return "no"


def _single_device(call: ast.Call) -> bool:
    devices = _kw(call, "devices")
    strategy = _kw(call, "strategy")
    if isinstance(devices, ast.Constant) and devices.value == 1:
        return True
    if isinstance(strategy, ast.Constant) and strategy.value in ("single_device", "dp"):
        return True
    accelerator = _kw(call, "accelerator")
    return devices is None and isinstance(accelerator, ast.Constant) and accelerator.value == "cpu"


def _sharded(call: ast.Call) -> bool:
    """``Fabric(strategy="fsdp")`` / ``Fabric(strategy=FSDPStrategy(...))``: Fabric's module is FSDP's."""
    strategy = _kw(call, "strategy")
    if isinstance(strategy, ast.Constant) and isinstance(strategy.value, str):
        return strategy.value.startswith("fsdp")
    return isinstance(strategy, ast.Call) and called_name(strategy) == "FSDPStrategy"


def _named(node, words: tuple) -> bool:
    """Does the name (or the called function's name: ``build_optimizer(model)``) say what it is?"""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        text = node.slice.value     # ``model_dict["optimizer"]``: the key says it
    else:
        text = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    text = text.lower()
    return any(w in text for w in words)


def _text(module: Module, node) -> str:
    return module.segment(node)


def _parameter_sources(arg, scope, values: Values, depth: int = 0) -> list:
    """The receivers of ``.parameters()`` / ``.named_parameters()`` in an optimizer's first argument,
    following a local name to its assignments once or twice (``params = model.parameters()``)."""
    out = []
    for node in walk(arg):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("parameters", "named_parameters"):
            receiver = node.func.value
            if isinstance(receiver, ast.Attribute) and receiver.attr == "module":
                receiver = receiver.value
            out.append(receiver)
        elif isinstance(node, ast.Name) and depth < 2 and isinstance(scope, Function):
            info = values.info(scope)
            for value, _ in info.assigns.get(node.id, ()):
                out.extend(_parameter_sources(value, scope, values, depth + 1))
            # a list grown in place: ``params = [p for p in unet.parameters() if p.requires_grad]``,
            # then ``params.extend(controlnet.parameters())`` (TailorEdit)
            for call in info.calls:
                func = call.func
                if type(func) is ast.Attribute and func.attr in ("extend", "append") and call.args and \
                        type(func.value) is ast.Name and func.value.id == node.id:
                    out.extend(_parameter_sources(call.args[0], scope, values, depth + 1))
    return out


def module_or_itself(inside, plain, test) -> bool:
    """Is ``inside`` ``x.module`` and ``plain`` ``x``, for the name ``x`` that ``test`` reads (one side of
    an unwrap: ``x.module if is_parallel(x) else x``)?"""
    return isinstance(plain, ast.Name) and is_module_of(inside, plain) and \
        any(isinstance(n, ast.Name) and n.id == plain.id for n in ast.walk(test))


def is_module_of(inside, outer) -> bool:
    """Is ``inside`` written ``<outer>.module``?"""
    return isinstance(inside, ast.Attribute) and inside.attr == "module" and ast.dump(inside.value) == ast.dump(outer)


def views_of_the_inner_module(a, b) -> bool:
    """``m.module`` and ``m`` (either order), or two views of the one module inside ``m``
    (``m.module._orig_mod`` and ``m.module``, LlamaGen's compiled model)."""
    def inside(node):
        while isinstance(node, ast.Attribute):
            if node.attr == "module":
                return ast.dump(node.value)
            node = node.value
        return None
    return is_module_of(a, b) or is_module_of(b, a) or (inside(a) is not None and inside(a) == inside(b))


def a_sequence(values, scope, node) -> bool:
    """Is ``node`` a list or tuple: written out, or a name bound only to lists and tuples in its scope
    (``models_to_accumulate = [transformer]``, then ``.extend([text_encoder])``)?"""
    if isinstance(node, (ast.List, ast.Tuple, ast.ListComp)):
        return True
    if not isinstance(node, ast.Name) or scope is None:
        return False
    bound = values.info(scope).assigns.get(node.id, ())
    return bool(bound) and all(not path and isinstance(value, (ast.List, ast.Tuple, ast.ListComp))
                               for value, path in bound)
