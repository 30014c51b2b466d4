"""Find the user's source line on the current Python stack (standard library only).

A DDP forward, a `no_sync()` call or a collective is reported at the line of the user's script that
caused it, not at the torch/accelerate internals in between, so the walk skips every frame whose file
lives in the standard library or in an installed package.
"""
from __future__ import annotations

import os
import sys
import sysconfig

_LIBRARY_ROOTS: tuple[str, ...] = ()
_is_library_cache: dict[str, bool] = {}

# Frames from these torch folders tell what a collective is for (see hooks._classify).
MODEL_AVERAGING_MARK = os.sep + os.path.join("distributed", "algorithms", "model_averaging") + os.sep
FSDP_MARK = os.sep + os.path.join("distributed", "fsdp") + os.sep
DDP_MARK = os.sep + os.path.join("nn", "parallel", "distributed.py")


def _library_roots() -> tuple[str, ...]:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            path = sysconfig.get_paths().get(key)
        except Exception:
            path = None
        if path:
            roots.add(os.path.realpath(path) + os.sep)
    for path in sys.path:
        if path.endswith(("site-packages", "dist-packages")):
            roots.add(os.path.realpath(path) + os.sep)
    # This package (also when installed in editable mode from a work tree) is never "user code".
    roots.add(os.path.realpath(os.path.dirname(os.path.abspath(__file__))) + os.sep)
    return tuple(roots)


def is_library(filename: str) -> bool:
    cached = _is_library_cache.get(filename)
    if cached is not None:
        return cached
    global _LIBRARY_ROOTS
    if not _LIBRARY_ROOTS:
        _LIBRARY_ROOTS = _library_roots()
    if filename.startswith("<"):
        # "<frozen runpy>", "<string>": frozen modules are library, `python -c` code is the user's.
        result = filename.startswith("<frozen")
    else:
        real = os.path.realpath(filename)
        result = real.startswith(_LIBRARY_ROOTS)
    _is_library_cache[filename] = result
    return result


def user_frame(frame) -> tuple[str | None, int | None]:
    """(path, line) of the innermost frame at or above `frame` that belongs to user code."""
    first_non_torch = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library(filename):
            return filename, frame.f_lineno
        if first_non_torch is None and (os.sep + "torch" + os.sep) not in filename \
                and (os.sep + "synccheck" + os.sep) not in filename and not filename.startswith("<"):
            first_non_torch = (filename, frame.f_lineno)
        frame = frame.f_back
    # Training code installed as a package: the first frame outside torch is the best we have.
    return first_non_torch if first_non_torch else (None, None)


def scan_stack(frame) -> tuple[str | None, int | None, str]:
    """user_frame plus what torch machinery is on the stack: 'avg' (model averaging), 'fsdp', 'ddp' or ''."""
    path = line = None
    via = ""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not via:
            if MODEL_AVERAGING_MARK in filename:
                via = "avg"
            elif FSDP_MARK in filename:
                via = "fsdp"
            elif filename.endswith(DDP_MARK):
                via = "ddp"
        if path is None and not is_library(filename):
            path, line = filename, frame.f_lineno
            break
        frame = frame.f_back
    return path, line, via
