"""The accelerate launch configurations a project ships (``accelerate launch --config_file
ds_zero3.yaml train.py``): YAML files beside a script or above it that say ``distributed_type:``.
Read as text, never imported. A script whose project ships only DeepSpeed configurations runs under
DeepSpeed, though its own code never says so (kamalkraj/e5-mistral-7b-instruct's ds_zero3_cpu.yaml)."""
from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Optional

# YAML (``distributed_type: DEEPSPEED``) or JSON (``"distributed_type": "DEEPSPEED"``, DASCO's
# ``accelerate launch --config_file deepspeed_ddp.json``)
_DISTRIBUTED_TYPE = re.compile(r"^[ \t]*[\"']?distributed_type[\"']?[ \t]*:[ \t]*['\"]?(\w+)", re.M)
_LEVELS = 3                 # the script's folder and this many above it
_MAX_FILES = 64             # YAML files read per folder, at most
_MAX_BYTES = 64_000
_CONFIG_FOLDER = re.compile(r"(?i)([a-z0-9]+[_-])?(configs?|configurations?|cfgs?)([_-][a-z0-9]+)?$")
_CROWDED = 256              # entries: a folder this full holds many projects, not one


def ships_only_deepspeed(path: Optional[str]) -> bool:
    """Do the accelerate configurations found beside ``path`` (its folder, the folders above it, and
    their sub-folders named for configs) all launch DeepSpeed, at least one of them?"""
    kinds = set().union(*(found for found, _ in _configs_around(path)))
    return bool(kinds) and kinds == {"DEEPSPEED"}


def deepspeed_leaves_accumulation_to_accelerate(path: Optional[str]) -> bool:
    """Do the DeepSpeed launch configurations beside ``path`` all leave the number of micro-steps to
    accelerate (no ``gradient_accumulation_steps`` of their own, or ``"auto"`` in the DeepSpeed JSON they
    name)? Then it is the Accelerator's (LMFlow-distill: ``Accelerator()`` and ``"auto"``: one)."""
    verdicts = set().union(*(steps for found, steps in _configs_around(path) if "DEEPSPEED" in found))
    return verdicts == {"auto"}


def _configs_around(path: Optional[str]) -> list:
    """(the ``distributed_type`` values, the DeepSpeed micro-step verdicts) of the configurations of
    ``path``'s folder and of each folder above it (``_LEVELS``), up to a repository's root; what was
    read to say so is consulted. Empty for a text checked on its own (no folder around it)."""
    if not path or not os.path.isfile(path):
        return []
    out = []
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(_LEVELS + 1):
        found, read, top, steps = _kinds_in(folder)
        _CONSULTED.update(read)
        out.append((found, steps))
        parent = os.path.dirname(folder)
        if top or parent == folder:
            break
        folder = parent
    return out


def _micro_steps(text: str, where: str, folder: str, read_paths: list) -> str:
    """A DeepSpeed launch configuration's number of micro-steps: "set" when it or the DeepSpeed JSON it
    names writes one out (even one: the user's choice), "auto" when neither does, "unknown" when the
    JSON it names cannot be read. The JSON read is recorded in ``read_paths``."""
    if _STEPS_GIVEN.search(text):
        return "set"
    named = _DS_CONFIG_FILE.search(text)
    if named is None:
        return "auto"
    for base in (where, folder):
        target_path = os.path.normpath(os.path.join(base, named.group(1)))
        target = _head(target_path)
        if target:
            read_paths.append(target_path)
            return "set" if _STEPS_GIVEN.search(target) else "auto"
    return "unknown"


def _head(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


# a number of micro-steps written out (YAML ``gradient_accumulation_steps: 2``, JSON ``"...": 2``), not "auto"
_STEPS_GIVEN = re.compile(r"""["']?gradient_accumulation_steps["']?[ \t]*:[ \t]*(\d+)""")
_DS_CONFIG_FILE = re.compile(r"""["']?deepspeed_config_file["']?[ \t]*:[ \t]*["']?([^"'\s,}]+)""")


# the folders listed and the files read since reset(): a results cache's entry depends on them
_CONSULTED: set = set()


def reset() -> None:
    """Forget what was read (a new lint: the files may have changed since)."""
    _CONSULTED.clear()
    _kinds_in.cache_clear()
    _pin_in.cache_clear()


def consulted() -> list:
    return sorted(_CONSULTED)


@lru_cache(maxsize=256)
def _kinds_in(folder: str) -> tuple:
    """(the ``distributed_type`` values of the YAML and JSON files of ``folder`` and of its sub-folders whose name
    says they hold configurations, the folders and files read, whether the search stops here, the
    micro-step verdicts of its DeepSpeed configurations: _micro_steps). It stops
    at a repository's root (a ``.git``); a folder of hundreds of entries is a workspace, not a project
    (pytest's temporary folders, a folder of checkouts): neither it nor anything above it is read."""
    out, steps = set(), set()
    read_paths = []
    try:
        entries = os.listdir(folder)
    except OSError:
        entries = []
    if len(entries) > _CROWDED:
        return frozenset(), (), True, frozenset()
    for where in [folder] + _config_folders(folder):
        try:
            names = sorted(os.listdir(where))[:_MAX_FILES * 4]
        except OSError:
            continue
        read_paths.append(where)
        read = 0
        for name in names:
            if not name.endswith((".yaml", ".yml", ".json")) or read >= _MAX_FILES:
                continue
            read += 1
            text = _head(os.path.join(where, name))
            found = [m.upper() for m in _DISTRIBUTED_TYPE.findall(text)]
            if found:
                read_paths.append(os.path.join(where, name))
            if "DEEPSPEED" in found:
                steps.add(_micro_steps(text, where, folder, read_paths))
            out.update(found)
    return frozenset(out), tuple(read_paths), ".git" in entries, frozenset(steps)


def _config_folders(folder: str) -> list:
    """Its sub-folders named for configurations: ``configs``, ``accelerate_configs``, ``config-ds``;
    not every name that holds the word (``test_launch_configs_are_a_dependency0``)."""
    try:
        return [os.path.join(folder, d) for d in sorted(os.listdir(folder))
                if _CONFIG_FOLDER.match(d) and os.path.isdir(os.path.join(folder, d))]
    except OSError:
        return []


_PIN_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "requirements.txt", "environment.yml", "environment.yaml")
_ACCELERATE_PIN = re.compile(r"""(?im)^[^#\n]*["'\s]accelerate\s*(?:==|<=|~=|<)\s*(\d+)\.(\d+)""")


def accelerate_pinned_before(path: Optional[str], version: tuple) -> bool:
    """Does the project around ``path`` pin accelerate to a release before ``version`` (``setup.py``'s
    ``"accelerate==0.17"``, a requirements file)? Read from the nearest folder, going up, that holds
    one of the usual files; stops at a repository's root."""
    if not path or not os.path.isfile(path):
        return False
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(_LEVELS + 1):
        pin = _pin_in(folder)
        if pin is not None:
            return pin < version
        parent = os.path.dirname(folder)
        if os.path.isdir(os.path.join(folder, ".git")) or parent == folder:
            break
        folder = parent
    return False


@lru_cache(maxsize=256)
def _pin_in(folder: str) -> Optional[tuple]:
    """The accelerate release pinned by the usual files of ``folder``, if any says one."""
    for name in _PIN_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        _CONSULTED.add(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(_MAX_BYTES)
        except OSError:
            continue
        match = _ACCELERATE_PIN.search(text)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None
