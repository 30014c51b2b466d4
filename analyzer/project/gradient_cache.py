"""The gradient-cache idiom (open_clip's ``accum_freq``, GradCache), read off a function's syntax: a loop
whose micro-steps each compute the whole window's loss from cached outputs, so that nothing is to be
divided (Records asks ``window_cache`` about the loop around a backward)."""
from __future__ import annotations

import ast

from synccheck.analyzer.project.traversal import children, walk

_GROW = ("append", "extend", "insert")


def window_cache(module, loop) -> bool:
    """The gradient-cache idiom (open_clip's ``accum_freq``, GradCache): the outputs of a window's
    micro-batches are cached without gradient, then ``loop`` re-runs each micro-batch and computes the
    loss over the whole window, its own slot of the cache replaced by the fresh output
    (``torch.cat(cache[:j] + [out] + cache[j + 1:])``). Each such loss is the whole window's loss,
    so the micro-steps' gradients add up to the window's gradient: nothing to divide.

    Read off the syntax of the function holding ``loop``: a container grown (``append``, ``extend``,
    ``c[k] = v``, ``+=``) outside the loop with values computed under ``torch.no_grad()`` or
    ``.detach()``ed, which the loop slices or overwrites at its own counter."""
    counters = {n.id for n in walk(loop.target) if isinstance(n, ast.Name)} if isinstance(loop, (ast.For, ast.AsyncFor)) else set()
    if not counters or not (any(_at_counter(node, counters) for node in walk(loop)) or
                            _spliced_in_callee(module, loop, counters, None)):
        return False                # (the last test below, without the caches: one walk of the loop alone)
    scope = _enclosing_scope(module, loop)
    if scope is None:
        return False
    inside = {id(n) for n in walk(loop)}
    # filled for each window: in the loop around ``loop`` (or in a function that runs one window),
    # not once before the epochs (a feature bank read by every micro-step)
    around = _enclosing_loop(scope, loop)
    window = {id(n) for n in walk(around)} if around is not None else None
    detached = _detached_names(scope, inside)
    caches = set()
    for node, under_no_grad in _walk_scope(scope):
        if id(node) in inside or (window is not None and id(node) not in window):
            continue
        grown = value = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _GROW \
                and node.args:
            grown, value = node.func.value, node.args[-1]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
            grown, value = node.targets[0], node.value
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
            grown, value = node.target, node.value
        if grown is None:
            continue
        root = _root(grown)
        if root is not None and (under_no_grad or _is_detached(value, detached)):
            caches.add(root)
    if not caches:
        return False
    # names the loop binds to something read from a cache (``accumulated = accum_features[key]``)
    aliases = set(caches)
    for _ in range(2):
        for stmt in walk(loop):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                    and any(_root(n) in aliases for n in walk(stmt.value) if isinstance(n, (ast.Name, ast.Attribute))):
                aliases.add(stmt.targets[0].id)
        aliases |= _iterated_from(loop, aliases)
    # the slots before or after its own (``cache[:j]``, ``cache[j + 1:]``), or its own slot
    # overwritten (``feats[j] = out``); not its own slot read (``teacher[j]``, ``x[j * b:(j + 1) * b]``)
    return any(_at_counter(node, counters) and _root(node.value) in aliases for node in walk(loop)) or \
        _spliced_in_callee(module, loop, counters, aliases)


def _spliced_in_callee(module, loop, counters, caches) -> bool:
    """The splice done by a function of the same module the loop hands the counter and the caches to
    (Chinese-CLIP's ``get_loss(model, ..., accum_image_features, ..., j)``). ``caches`` None: any."""
    by_name = {fn.node.name: fn for fn in module.functions.values() if fn.cls is None}
    for call in walk(loop):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in by_name):
            continue
        fn = by_name[call.func.id]
        params = [a.arg for a in fn.node.args.posonlyargs + fn.node.args.args]
        given = [(params[i], a.id) for i, a in enumerate(call.args[:len(params)]) if isinstance(a, ast.Name)]
        given += [(k.arg, k.value.id) for k in call.keywords if k.arg in params and isinstance(k.value, ast.Name)]
        at = {p for p, name in given if name in counters}
        held = {p for p, name in given if caches is None or name in caches}
        if at and any(_at_counter(node, at) and _root(node.value) in held for node in walk(fn.node)):
            return True
    return False


def _at_counter(node, counters) -> bool:
    """``c[j] = v`` or ``c[:j]`` / ``c[j + 1:]`` at one of the loop's counters."""
    if not isinstance(node, ast.Subscript):
        return False
    sl = node.slice
    if isinstance(node.ctx, ast.Store) and _mentions(sl, counters):
        return True
    return isinstance(sl, ast.Slice) and sl.step is None and (
        (sl.lower is None and sl.upper is not None and _mentions(sl.upper, counters)) or
        (sl.upper is None and sl.lower is not None and _mentions(sl.lower, counters)))


def _enclosing_scope(module, target):
    """The function (or module) whose own body holds the loop ``target``."""
    scopes = module.derived.get("loop scopes")
    if scopes is None:
        # every loop of the tree, with the function (or module) around it: one walk of the statements
        # (and handlers and cases), kept with the module; a loop is a statement, never in an expression
        tree = module.tree
        scopes = module.derived["loop scopes"] = {}
        stack = [(tree, tree)]
        while stack:
            node, scope = stack.pop()
            if isinstance(node, _LOOPS):
                scopes.setdefault(id(node), scope)
            for field in _BLOCKS:
                for child in getattr(node, field, None) or ():
                    if isinstance(child, _BLOCK_TYPES):
                        stack.append((child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                                      else scope))
    return scopes.get(id(target))


_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_BLOCKS = ("body", "handlers", "orelse", "finalbody", "cases")
_BLOCK_TYPES = (ast.stmt, ast.excepthandler) + ((ast.match_case,) if hasattr(ast, "match_case") else ())


def _enclosing_loop(scope, target):
    """The innermost loop of ``scope``'s own body that holds ``target``, or None."""
    found = None
    stack = [(child, None) for child in children(scope)]
    while stack:
        node, loop = stack.pop()
        if node is target:
            found = loop
            break
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        inner = node if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) else loop
        stack.extend((child, inner) for child in children(node))
    return found


def _walk_scope(scope):
    """(node, under a no_grad block?) for the nodes of a scope's own body (nested functions left out)."""
    stack = [(child, False) for child in children(scope)]
    while stack:
        node, no_grad = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node, no_grad
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_no_grad(i.context_expr) for i in node.items):
            no_grad = True
        stack.extend((child, no_grad) for child in children(node))


def _is_no_grad(expr) -> bool:
    func = expr.func if isinstance(expr, ast.Call) else expr
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("no_grad", "inference_mode")


def _detached_names(scope, inside) -> set:
    """Names bound under ``torch.no_grad()`` (outside the loop), or to a ``.detach()``ed value."""
    out = set()
    for node, no_grad in _walk_scope(scope):
        if id(node) in inside or not isinstance(node, (ast.Assign, ast.For, ast.AnnAssign)):
            continue
        value = node.iter if isinstance(node, ast.For) else node.value
        if no_grad or (value is not None and _is_detached(value, set())):
            targets = [node.target] if isinstance(node, (ast.For, ast.AnnAssign)) else node.targets
            out.update(n.id for t in targets for n in walk(t) if isinstance(n, ast.Name))
    return out


def _is_detached(value, detached: set) -> bool:
    for n in walk(value):
        if isinstance(n, ast.Name) and n.id in detached:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "detach":
            return True
    return False


def _root(node):
    """``cache`` for ``cache``, ``cache[k]``, ``cache[k][m]``; ``self.cache`` for ``self.cache[k]``."""
    while isinstance(node, ast.Subscript) or _setdefault(node):
        # (``cache.setdefault(k, []).append(v)``: the cache's list for that key)
        node = node.value if isinstance(node, ast.Subscript) else node.func.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        try:
            return ast.unparse(node)
        except Exception:     # pragma: no cover - unparse of a plain name or attribute
            return None
    return None


def _setdefault(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"


def _iterated_from(loop, aliases: set) -> set:
    """The names a ``for`` of ``loop`` binds to a cache's entries (``for key, val in cache.items():``)."""
    out = set()
    for stmt in walk(loop):
        if isinstance(stmt, ast.For):
            it = stmt.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "values"):
                it = it.func.value
            if _root(it) in aliases:
                out.update(n.id for n in walk(stmt.target) if isinstance(n, ast.Name))
    return out


def _mentions(node, names: set) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in walk(node))
