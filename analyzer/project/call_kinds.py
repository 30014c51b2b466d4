"""What a call is, read off its targets before it is followed: a part of the events stage
(event_calls.py), which asks these questions of a call it is about to analyse."""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project.values import Bound, Func, Inst, Obj

# a LightningModule's hooks Fabric sends through the wrapper's forward when called on the module it set
# up (``_FabricModule``), so that DDP's hooks run
FABRIC_REDIRECTED = frozenset(("training_step", "validation_step", "test_step", "predict_step"))

# a training step's words: a function that says none of them only computes
_EVENT_TEXT = re.compile(r"\bbackward\s*\(|\.step\s*\(|zero_grad|no_sync|require_backward_grad_sync|\.accumulate\s*\(|"
                         r"set_requires_gradient_sync|no_backward_sync")


def forward_dispatch(flow, targets, args, kws) -> bool:
    """Is a call over many project methods handed a model, none of which says a training step's words
    (UER's ``self.forward_propagation(batch, model)`` filled by a dozen trainers)? Then it is that
    model's forward."""
    if not any(flow.program.wrappers(a.values) for a in list(args) + list(kws.values())):
        return False
    for v in targets:
        if not isinstance(v, (Func, Bound)):
            return False
        text = v.fn.module.segment(v.fn.node) or ""
        if _EVENT_TEXT.search(text):
            return False
    return True


def sum_reduced(node) -> bool:
    """``F.cross_entropy(..., reduction="sum")``: a loss summed over its examples."""
    return isinstance(node, ast.Call) and any(
        kw.arg == "reduction" and isinstance(kw.value, ast.Constant) and kw.value.value == "sum" for kw in node.keywords)


def sum_criterion(flow, func, scope) -> bool:
    """``self.criterion(logits, y)`` where the criterion was made ``nn.CrossEntropyLoss(reduction="sum")``
    (flair): a loss summed over its examples, as ``sum_reduced`` says of a call that writes it."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if "loss" not in name.lower() and "crit" not in name.lower():
        return False
    made = [v for v in flow.values.expr(func, scope) if isinstance(v, Obj)]
    return bool(made) and all(any(map(sum_reduced, calls_at(flow.program, v.site))) for v in made)


def calls_at(program, site) -> list:
    """The calls an object known by where it was made (``site``: path, line, column) was made by: one,
    or several starting there (``GPT(...).cuda()``)."""
    if len(site) != 3 or not isinstance(site[1], int):
        return []
    table = program.calls_at
    calls = table.get(site[0])
    if calls is None:
        calls = table[site[0]] = {}
        module = program.project.module_at(site[0])
        for n in ast.walk(module.tree) if module is not None else ():
            if isinstance(n, ast.Call):
                calls.setdefault((n.lineno, n.col_offset), []).append(n)
    return calls.get(site[1:], [])


def clears_grads(flow, func, scope) -> bool:
    """Is ``func`` a project function that clears the gradients of the parameters it loops over
    (``p.grad = None``, ``p.grad.zero_()``)?"""
    for v in flow.values.expr(func, scope):
        if isinstance(v, Func):
            text = v.fn.module.segment(v.fn.node) or ""
            if ".grad = None" in text or ".grad.zero_()" in text or ".grad.data.zero_()" in text:
                return True
    return False


def library_training_step(flow, vals) -> bool:
    """Is ``training_step`` on these objects transformers' ``Trainer.training_step`` (a project subclass
    of ``transformers.Trainer`` that does not define its own)?"""
    project = flow.project
    return any(isinstance(v, Inst) and project.attribute(v.cls, "training_step") is None and any(
        q.startswith("transformers.") and q.endswith("Trainer") for q in project.external_bases(v.cls))
        for v in vals)


_TOKEN_COUNT = re.compile(r"(?i)(?:^|_)(?:n_?tokens|num_\w*tokens|(?:global|total|valid)_\w*tokens|num_items\w*|"
                          r"token_count|normali[sz]er|denominator)$")


def handed_a_token_count(node: ast.Call) -> bool:
    """``self.loss_fn(pred, labels, global_valid_tokens)``, ``compute_loss(model, inputs,
    num_items_in_batch=n)``: a loss call handed the window's token count."""
    for a in list(node.args) + [kw.value for kw in node.keywords]:
        name = a.id if isinstance(a, ast.Name) else a.attr if isinstance(a, ast.Attribute) else ""
        if name and _TOKEN_COUNT.search(name):
            return True
    return False
