"""Fast traversals of the stdlib ``ast``, in exactly the orders its own helpers visit.

``ast.iter_child_nodes`` is two generators and a ``getattr`` per field; the analysis walks the same
trees many times, and those walks were a quarter of a lint of the torch package. ``children`` gets
a node's children with one call of a function made for its class (its fields read directly, the
fields that hold names and constants skipped), in the order ``ast.iter_child_nodes`` yields them.
``walk`` is ``ast.walk`` (breadth first) and ``walk_no_defs`` the depth-first walk that leaves out
nested functions, classes and lambdas, each returned as a list.

The trees are never changed once parsed, so what is derived from a subtree may be kept with it.
"""
from __future__ import annotations

import ast
from ast import AST

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)

# (class, field) -> how the field holds nodes, for the grammar of Python 3.9 to 3.11 (Parser/Python.asdl).
# "one": a node or None; "many": a list of nodes; "some": a list of nodes and None; "none": no node
# (a name, a constant, a number). A field not listed here is checked value by value, as ast does.
_NONE = "none"
_SHAPES = {
    "Module": {"body": "many", "type_ignores": "many"},
    "Interactive": {"body": "many"},
    "Expression": {"body": "one"},
    "FunctionType": {"argtypes": "many", "returns": "one"},
    "FunctionDef": {"name": _NONE, "args": "one", "body": "many", "decorator_list": "many", "returns": "one",
                    "type_comment": _NONE},
    "AsyncFunctionDef": {"name": _NONE, "args": "one", "body": "many", "decorator_list": "many", "returns": "one",
                         "type_comment": _NONE},
    "ClassDef": {"name": _NONE, "bases": "many", "keywords": "many", "body": "many", "decorator_list": "many"},
    "Return": {"value": "one"},
    "Delete": {"targets": "many"},
    "Assign": {"targets": "many", "value": "one", "type_comment": _NONE},
    "AugAssign": {"target": "one", "op": "one", "value": "one"},
    "AnnAssign": {"target": "one", "annotation": "one", "value": "one", "simple": _NONE},
    "For": {"target": "one", "iter": "one", "body": "many", "orelse": "many", "type_comment": _NONE},
    "AsyncFor": {"target": "one", "iter": "one", "body": "many", "orelse": "many", "type_comment": _NONE},
    "While": {"test": "one", "body": "many", "orelse": "many"},
    "If": {"test": "one", "body": "many", "orelse": "many"},
    "With": {"items": "many", "body": "many", "type_comment": _NONE},
    "AsyncWith": {"items": "many", "body": "many", "type_comment": _NONE},
    "Match": {"subject": "one", "cases": "many"},
    "Raise": {"exc": "one", "cause": "one"},
    "Try": {"body": "many", "handlers": "many", "orelse": "many", "finalbody": "many"},
    "TryStar": {"body": "many", "handlers": "many", "orelse": "many", "finalbody": "many"},
    "Assert": {"test": "one", "msg": "one"},
    "Import": {"names": "many"},
    "ImportFrom": {"module": _NONE, "names": "many", "level": _NONE},
    "Global": {"names": _NONE},
    "Nonlocal": {"names": _NONE},
    "Expr": {"value": "one"},
    "BoolOp": {"op": "one", "values": "many"},
    "NamedExpr": {"target": "one", "value": "one"},
    "BinOp": {"left": "one", "op": "one", "right": "one"},
    "UnaryOp": {"op": "one", "operand": "one"},
    "Lambda": {"args": "one", "body": "one"},
    "IfExp": {"test": "one", "body": "one", "orelse": "one"},
    "Dict": {"keys": "some", "values": "many"},
    "Set": {"elts": "many"},
    "ListComp": {"elt": "one", "generators": "many"},
    "SetComp": {"elt": "one", "generators": "many"},
    "DictComp": {"key": "one", "value": "one", "generators": "many"},
    "GeneratorExp": {"elt": "one", "generators": "many"},
    "Await": {"value": "one"},
    "Yield": {"value": "one"},
    "YieldFrom": {"value": "one"},
    "Compare": {"left": "one", "ops": "many", "comparators": "many"},
    "Call": {"func": "one", "args": "many", "keywords": "many"},
    "FormattedValue": {"value": "one", "conversion": _NONE, "format_spec": "one"},
    "JoinedStr": {"values": "many"},
    "Constant": {"value": _NONE, "kind": _NONE},
    "Attribute": {"value": "one", "attr": _NONE, "ctx": "one"},
    "Subscript": {"value": "one", "slice": "one", "ctx": "one"},
    "Starred": {"value": "one", "ctx": "one"},
    "Name": {"id": _NONE, "ctx": "one"},
    "List": {"elts": "many", "ctx": "one"},
    "Tuple": {"elts": "many", "ctx": "one"},
    "Slice": {"lower": "one", "upper": "one", "step": "one"},
    "comprehension": {"target": "one", "iter": "one", "ifs": "many", "is_async": _NONE},
    "ExceptHandler": {"type": "one", "name": _NONE, "body": "many"},
    "arguments": {"posonlyargs": "many", "args": "many", "vararg": "one", "kwonlyargs": "many",
                  "kw_defaults": "some", "kwarg": "one", "defaults": "many"},
    "arg": {"arg": _NONE, "annotation": "one", "type_comment": _NONE},
    "keyword": {"arg": _NONE, "value": "one"},
    "alias": {"name": _NONE, "asname": _NONE},
    "withitem": {"context_expr": "one", "optional_vars": "one"},
    "match_case": {"pattern": "one", "guard": "one", "body": "many"},
    "MatchValue": {"value": "one"},
    "MatchSingleton": {"value": _NONE},
    "MatchSequence": {"patterns": "many"},
    "MatchMapping": {"keys": "many", "patterns": "many", "rest": _NONE},
    "MatchClass": {"cls": "one", "patterns": "many", "kwd_attrs": _NONE, "kwd_patterns": "many"},
    "MatchStar": {"name": _NONE},
    "MatchAs": {"pattern": "one", "name": _NONE},
    "MatchOr": {"patterns": "many"},
    "TypeIgnore": {"lineno": _NONE, "tag": _NONE},
}


def _children_source(cls, name: str) -> list:
    """The lines of a function ``name`` that lists the children of a node of this class, in
    ``_fields`` order; none for a class without fields that hold nodes."""
    shapes = _SHAPES.get(cls.__name__, {})
    lines = []
    for field in cls._fields:
        shape = shapes.get(field)
        if shape == _NONE:
            continue
        if shape == "one":
            lines += [f"    v = n.{field}", "    if v is not None: out.append(v)"]
        elif shape == "many":
            lines.append(f"    out += n.{field}")
        elif shape == "some":
            lines.append(f"    out += [x for x in n.{field} if x is not None]")
        else:        # a field of a newer grammar: checked as ast.iter_child_nodes does
            lines += [f"    v = getattr(n, {field!r}, None)",
                      "    if isinstance(v, AST): out.append(v)",
                      "    elif isinstance(v, list): out += [x for x in v if isinstance(x, AST)]"]
    if not lines:
        return []
    return [f"def {name}(n):", "    out = []"] + lines + ["    return out"]


def _no_children(node) -> list:
    return []


def _checked(node) -> list:
    """The children of a node whose class is not in the table: ast's own way."""
    return list(ast.iter_child_nodes(node))


_CHILDREN: dict = {}        # every class of the ast module -> its children function


def _build() -> None:
    """One function per class of the ast module, made from one source text (compiled once)."""
    classes, todo = [], [AST]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__ == "ast" and getattr(cls, "_fields", None) is not None:
            classes.append(cls)
    source = []
    for i, cls in enumerate(classes):
        source += _children_source(cls, f"_children_{i}")
    namespace = {"AST": AST}
    exec("\n".join(source), namespace)   # noqa: S102 - code made above from the classes' field names
    for i, cls in enumerate(classes):
        _CHILDREN[cls] = namespace.get(f"_children_{i}", _no_children)


_build()


def children(node) -> list:
    """``list(ast.iter_child_nodes(node))``."""
    try:
        return _CHILDREN[node.__class__](node)
    except (KeyError, AttributeError):      # a node made by hand, without all of its fields
        return _checked(node)


def walk(node) -> list:
    """``list(ast.walk(node))``: breadth first, the node itself first."""
    out = [node]
    table = _CHILDREN
    i = 0
    try:
        while i < len(out):
            n = out[i]
            i += 1
            out += table[n.__class__](n)
    except (KeyError, AttributeError):
        return list(ast.walk(node))
    return out


def walk_no_defs(node) -> list:
    """Depth first from ``node`` (the last child first), not entering the functions, classes and lambdas
    below it (``node`` itself may be one: its own fields are walked)."""
    out = []
    stack = [node]
    table = _CHILDREN
    defs = _DEFS
    pop, push = stack.pop, stack.append
    try:
        while stack:
            n = pop()
            out.append(n)
            for child in table[n.__class__](n):
                if not isinstance(child, defs):
                    push(child)
    except (KeyError, AttributeError):
        return list(_slow_walk_no_defs(node))
    return out


# the fields that hold statements (or the handlers and cases that do): expressions never hold one
_BLOCKS = ("body", "handlers", "orelse", "finalbody", "cases")
_BLOCK_FIELDS: dict = {}
_BLOCK_TYPES = (ast.stmt, ast.excepthandler) + ((ast.match_case,) if hasattr(ast, "match_case") else ())


def block_nodes(node) -> list:
    """The statements (and ``except`` handlers and ``case`` blocks) under ``node``, nested functions
    and classes included: every node of ``walk(node)`` that is or holds a statement (in another order)."""
    if isinstance(node, (ast.Module, ast.Interactive)):      # a tree: its statements
        out, stack = [node], list(node.body)
    else:
        out, stack = [], [node]
    fields_of = _BLOCK_FIELDS
    while stack:
        n = stack.pop()
        out.append(n)
        fields = fields_of.get(n.__class__)
        if fields is None:
            fields = _block_fields(n.__class__)
        for field in fields:
            stack.extend(getattr(n, field, None) or ())
    return out


def _block_fields(cls) -> tuple:
    """The fields of a node class that hold statements (``body``, ``orelse``, ...), read once."""
    fields = _BLOCK_FIELDS[cls] = tuple(f for f in cls._fields if f in _BLOCKS) \
        if issubclass(cls, _BLOCK_TYPES) else ()
    return fields


def block_nodes_no_defs(node) -> list:
    """The statements (and ``except`` handlers and ``case`` blocks) of ``walk_no_defs(node)``, in its
    order: the same walk, not entering the expressions, where no statement can be."""
    out = []
    stack = [node]
    fields_of = _BLOCK_FIELDS
    defs = _DEFS
    pop, push = stack.pop, stack.append
    while stack:
        n = pop()
        out.append(n)
        fields = fields_of.get(n.__class__)
        if fields is None:
            fields = _block_fields(n.__class__)
        for field in fields:
            for child in getattr(n, field, None) or ():
                if not isinstance(child, defs):
                    push(child)
    return out


def _slow_walk_no_defs(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        for child in ast.iter_child_nodes(n):
            if isinstance(child, _DEFS):
                continue
            stack.append(child)
