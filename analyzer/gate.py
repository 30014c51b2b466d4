"""Stage 2 of the pipeline, part 2: which files the analysis wants, read from their bytes and text.

A file is decoded only if its bytes hold one of ``PROJECT_WORDS`` or ``DRIVER_WORDS`` (most of a code
base does not), and parsed up front only if it may hold a finding (``eager``); the other files of a
component are parsed only if the analysis needs them (an import, a caller, a base class). ``_read``
makes the ``_Entry`` of one file: its content key, whether it is wanted, its import lines, its text.
"""
from __future__ import annotations

import re
from typing import Sequence

from synccheck.analyzer.source import decode_source, read_bytes

# A file is parsed only if it holds one of these: what a training loop, a wrapper, a sync control, a
# sampler or a collective is spelled with. The rest of a code base (most of it) is never parsed.
PROJECT_WORDS = (b"backward", b"DistributedDataParallel", b"FullyShardedDataParallel", b"fully_shard", b"DDP",
                 b"no_sync", b"require_backward_grad_sync", b"set_requires_gradient_sync", b"Accelerator",
                 b".prepare(", b"Fabric", b"deepspeed", b"DistributedSampler", b"barrier", b"all_reduce",
                 b"wait_for_everyone", b"broadcast", b"all_gather", b"GradientAccumulator", b"accumulate(",
                 b"rank", b"main_process", b"is_master", b"master_process")


class _Entry:
    """One discovered file: its content key, whether the analysis wants it (gated: it may matter;
    eager: it may hold a finding, so it is parsed up front), its imports, its text."""
    __slots__ = ("path", "key", "gated", "imports", "text", "notebook", "linted", "eager")

    def __init__(self, path, key, gated, imports, text=None, notebook=None, linted=True, eager=False) -> None:
        self.path = path
        self.key = key
        self.gated = gated
        self.imports = imports
        self.text = text
        self.notebook = notebook
        self.linted = linted
        self.eager = eager


def eager(text: str, rules: Sequence) -> bool:
    """Can this file hold a finding? A rule wants its words, or it runs a training loop whose
    backward or step may be in another file. Other files of a component are parsed only if the
    analysis needs them (an import, a caller, a base class)."""
    if any(r.code != "SC000" and (r.wants(text) or r.reaches(text)) for r in rules):
        return True
    return ("for " in text or "while " in text) and (any(w in text for w in LOOP_WORDS) or _driver_call(text))


LOOP_WORDS = (".backward(", "zero_grad(", "no_sync", "accumulate(", "require_backward_grad_sync")
# a script whose loop drives a trainer defined elsewhere: ``trainer.mlm_step(batch)``, ``train_one_epoch(...)``.
# The same calls twice on purpose: substrings on the raw bytes of every file (cheap), the regex only on
# the decoded text of the files that pass them.
# (``model_engine.step(batch)``: a training engine's step, which runs the micro-step: cramming)
_DRIVERS = ("fit_batch(", "train_batch(", "train_one_epoch(", "train_epoch(", "engine.step(", "trainer.step(",
            "learner.step(")
DRIVER_WORDS = (b"_step(",) + tuple(w.encode() for w in _DRIVERS)
DRIVER_CALL = re.compile(r"\w_step\(|" + "|".join(map(re.escape, _DRIVERS)))
_WORD_CHAR = re.compile(r"\w")


# ``*_step(`` calls that never run a training step: torch_xla's ``xm.mark_step()`` closes a lazy graph
# in every diffusers pipeline (265 of its files would be parsed for it)
NOT_DRIVERS = frozenset({"mark_step"})


def _driver_call(text: str) -> bool:
    """``DRIVER_CALL.search(text) is not None``, with str.find (a regex whose every branch may start at
    any word character is tried at every position of the text), less the calls of NOT_DRIVERS."""
    if any(w in text for w in _DRIVERS):
        return True
    at = text.find("_step(", 1)
    while at != -1:
        if _WORD_CHAR.match(text, at - 1):
            start = at
            while start > 0 and _WORD_CHAR.match(text, start - 1):
                start -= 1
            if text[start:at + 5] not in NOT_DRIVERS:
                return True
        at = text.find("_step(", at + 1)
    return False


def _no_key(data: bytes) -> str:
    return ""


def _read(path: str, content_key, imported_names, rules, force: bool = False):
    if path.endswith(".ipynb"):
        from synccheck.analyzer.notebook import read_notebook
        notebook, error = read_notebook(path)
        if error is not None:
            return None, error
        data = notebook.text.encode()
        return _Entry(path, content_key(data), True, imported_names(data), notebook.text, notebook,
                      eager=True), None
    data, error = read_bytes(path)
    if data is None:
        return None, error
    key = content_key(data)
    if not force and not any(w in data for w in PROJECT_WORDS) and not any(w in data for w in DRIVER_WORDS) and \
            b"\0" not in data[:8192]:
        # nothing here a rule could use: not even decoded. It may still join two files that are (a
        # ``class Trainer(TrainingLoopMixin, DeviceMixin)``; a ``main.py`` that builds the model with
        # one module's factory and hands it to another's trainer): its imports are kept for that
        # (engine._joined)
        joins = imported_names(data) if b"import" in data else []
        return _Entry(path, key, False, joins), None
    text, error = decode_source(path, data)
    if error is not None:
        return None, error
    return _Entry(path, key, True, imported_names(data), text, eager=force or eager(text, rules)), None
