"""What a call is, read off its targets before it is followed: a part of the events stage
(event_calls.py), which asks these questions of a call it is about to analyse."""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project.values import Bound, Func

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


def clears_grads(flow, func, scope) -> bool:
    """Is ``func`` a project function that clears the gradients of the parameters it loops over
    (``p.grad = None``, ``p.grad.zero_()``)?"""
    for v in flow.values.expr(func, scope):
        if isinstance(v, Func):
            text = v.fn.module.segment(v.fn.node) or ""
            if ".grad = None" in text or ".grad.zero_()" in text or ".grad.data.zero_()" in text:
                return True
    return False
