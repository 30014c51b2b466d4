"""What a call is, read off its targets before it is followed: a part of the events stage
(event_calls.py), which asks these questions of a call it is about to analyse."""
from __future__ import annotations

import ast
import re

from synccheck.analyzer.project.value_helpers import _class_attrs
from synccheck.analyzer.project.values import Bound, Func, Inner, Inst, Obj

def sets_sync_flag(call: ast.Call) -> bool:
    """``setattr(net, "require_backward_grad_sync", sync)``: DDP's flag, written as an assignment would."""
    return isinstance(call.func, ast.Name) and call.func.id == "setattr" and len(call.args) == 3 and \
        isinstance(call.args[1], ast.Constant) and call.args[1].value == "require_backward_grad_sync"


# a LightningModule's hooks Fabric sends through the wrapper's forward when called on the module it set
# up (``_FabricModule``), so that DDP's hooks run
FABRIC_REDIRECTED = frozenset(("training_step", "validation_step", "test_step", "predict_step"))

# a training step's words: a function that says none of them only computes
_EVENT_TEXT = re.compile(r"\bbackward\s*\(|\.step\s*\(|zero_grad|no_sync|require_backward_grad_sync|\.accumulate\s*\(|"
                         r"set_requires_gradient_sync|no_backward_sync|disable_allreduce")


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


def sum_reduced(node, defaults=None) -> bool:
    """``F.cross_entropy(..., reduction="sum")``: a loss summed over its examples. ``defaults``: the
    literal defaults of the enclosing function's parameters (``reduction=reduction`` with
    ``def forward(self, x, reduction="sum")``)."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute) and _SUMMED_LOSS.search(node.func.attr):
        return True         # ``loss_obj.get_summed_loss()`` (RETURNN): a loss summed over its frames
    for kw in node.keywords:
        if kw.arg != "reduction":
            continue
        value = kw.value
        if isinstance(value, ast.Name) and defaults:
            value = defaults.get(value.id, value)
        return isinstance(value, ast.Constant) and value.value == "sum"
    return False


_SUMMED_LOSS = re.compile(r"^(?:get_)?summed_loss(?:es)?$|^(?:get_)?loss_sum$")


def literal_defaults(fn_node) -> dict:
    """A function's parameters with a literal default: name -> the ``ast.Constant``."""
    args = fn_node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults)) + \
        [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg: d for a, d in pairs if isinstance(d, ast.Constant)}


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
    return _hands_a_name(node, _TOKEN_COUNT)


def handed_the_accumulation_count(node: ast.Call) -> bool:
    """``batch.normalize(loss, n_accumulation=self.args.batch_multiplier)``: a call handed the number
    of micro-steps (by keyword or by the name of what is passed), which may well divide by it."""
    return any(kw.arg and _ACCUMULATION_COUNT.search(kw.arg) for kw in node.keywords) or \
        _hands_a_name(node, _ACCUMULATION_COUNT)


def _hands_a_name(node: ast.Call, pattern) -> bool:
    """Is a name or attribute the call is handed (by position or keyword) one ``pattern`` finds?"""
    for a in list(node.args) + [kw.value for kw in node.keywords]:
        name = a.id if isinstance(a, ast.Name) else a.attr if isinstance(a, ast.Attribute) else ""
        if name and pattern.search(name):
            return True
    return False


_ACCUMULATION_COUNT = re.compile(r"accum|grad_acc|update_freq|batch_multiplier|iters_to_acc|micro_batches|"
                                 r"num_micro|n_micro", re.I)


# -- calls of the module inside a wrapper, and of a model's methods ----------------------------------

def _inner_wrappers(values) -> frozenset:
    """The DDP / accelerate wrappers whose inner module (``model.module``) is among these values."""
    return frozenset(v.wrapper for v in values if isinstance(v, Inner) and v.wrapper.kind in ("ddp", "accelerate"))


# methods that compute a loss from the model they are handed
_LOSS_METHOD = re.compile(r"loss|^forward|^compute_|^p_losses$|^run_model$")
# methods of a model that run its forward (not ``parameters``, ``state_dict``, ``eval``, ``to``)
# (not a hook or an optimizer's: ``model.on_before_optimizer_step(optimizer)``, ``scheduler_step``)
# (an autoencoder's ``encode`` / ``decode``: ``vae.module.encode(x).latent_dist``, AUDIT_v2)
_FORWARD_METHOD = re.compile(r"^(?!on_|before_|after_)(?:forward\w*|train_step|training_step|compute_loss|encode|decode|"
                             r"(?!\w*(?:optimizer|optim|scheduler|lr|ema|zero_grad)_step$)\w*_step)$")


# what a module's submodules are called, when its class is not one of the project's (SAM's
# ``image_encoder``, ``prompt_encoder``, ``mask_decoder``; ``backbone``, ``lm_head``, ``text_model``)
_SUBMODULE_NAME = re.compile(r"(?:^|_)(?:encoders?|decoders?|heads?|backbone|neck|trunk|embeddings?|embedder|blocks?|"
                             r"layers?|transformer|unet|vae|projector|proj|text_model|vision_model|model|net)(?:$|_)")


def _submodule(flow, wrappers: frozenset, attr: str) -> bool:
    """Is ``attr`` of the module inside these wrappers one of its submodules: an attribute a class of
    it stores (``self.encoder = Encoder()``), not a method; or, for a class we cannot read, a name
    submodules have? (``model.module.visualize(...)``, ``model_without_ddp.flops()`` are not.)"""
    known = False
    for w in wrappers:
        for v in flow.values.wrapped_by(w):
            if not isinstance(v, Inst):
                continue
            known = True
            for klass in flow.project.mro(v.cls):
                if attr in klass.methods:
                    return False
                if attr in _class_attrs(flow.values, klass):
                    return True
    return not known and bool(_SUBMODULE_NAME.search(attr)) and not _HOUSEKEEPING.match(attr)


# methods of a module (nn.Module's, transformers') named like a submodule: ``resize_token_embeddings``,
# ``get_input_embeddings``, ``set_decoder``, ``freeze_encoder``
_HOUSEKEEPING = re.compile(r"_|get_|set_|resize_|tie_|init_|freeze|unfreeze|enable_|disable_|prune_|save|load|"
                           r"register|reset|print|num_")
