import re
import sys

from synccheck.analyzer.imports import line_matches
from synccheck.analyzer.rules.base import Rule

RANK_TEST_TEXT = (r"(?<!\w)(rank|global_rank|local_rank|get_rank|is_main_process|is_local_main_process|"
                  r"master_process|is_master|is_rank_zero|is_global_zero|is_world_process_zero|"
                  r"is_local_process_zero|main_process|is_main|is_chief|is_global_main|is_local_main|"
                  r"is_global_master|is_local_master|is_main_rank|is_master_rank|is_rank0|is_rank_0|is_main_worker|device_id|"
                  r"is_root_worker|is_local_root_worker|is_root_process|is_root_rank|"
                  r"is_primary|is_global_primary|is_local_primary)(?!\w)")
RANK_TEST = re.compile(RANK_TEST_TEXT, re.I)     # (``os.environ.get("RANK", "0") == "0"``)
# Substrings that between them cover every name RANK_TEST accepts ("master" for nanoGPT's `master_process`
# as well as `is_master`): the text pre-check looks for these before any regex runs.
RANK_WORDS = ("rank", "RANK", "main_process", "master", "global_zero", "process_zero", "is_main", "is_chief",
              "is_global_main", "is_local_main", "device_id", "is_root", "is_local_root", "is_primary",
              "_primary")
CALL_PREFIXES = ("dist.", "distributed.", "c10d.", "accelerator.", "fabric.", "strategy.")


# (``torch.distributed``, ``DistributedDataParallel``, a project's ``distributed_utils``)
FRAMEWORKS = ("distributed", "Distributed", "accelerate", "accelerator.", "fabric.", "lightning")
# decorators whose function runs on the main process only
RANK_DECORATORS = ("rank_zero_only", "on_main_process", "on_local_main_process", "main_process_only", "rank0_only",
                   "master_only", "on_rank_zero")
RANK_DECORATOR = re.compile(r"^[ \t]*@[\w.]*\b(?:" + "|".join(RANK_DECORATORS) + r")\b", re.M)
COLLECTIVE_TEXT = (r"\b(?:dist|distributed|c10d|accelerator|fabric|strategy)\.(barrier|monitored_barrier|all_reduce|"
                   r"all_gather\w*|broadcast\w*|reduce|gather|gather_object|gather_for_metrics|scatter\w*|"
                   r"reduce_scatter\w*|all_to_all\w*|wait_for_everyone|pad_across_processes)\(")
# (and a LightningModule's own gather, and a project object's method that says it communicates:
# ``metric_logger.synchronize_between_processes()``, ``top1.all_reduce()``)
# (``distributed_utils.all_reduce_dict(data)``, ``utils.all_gather_list(x)``: a project helper's name
# that says it communicates; the analysis then reads what it runs)
# (and accelerate's own names whatever the Accelerator is called: ``accelerate.wait_for_everyone()``)
COLLECTIVE_CALL = re.compile(COLLECTIVE_TEXT + r"|\.(?:synchronize_between_processes|all_reduce\w*|all_gather\w*|"
                                               r"wait_for_everyone|gather_for_metrics)\(")
_METHOD_COLLECTIVES = (".synchronize_between_processes(", ".all_reduce", ".all_gather", ".wait_for_everyone(",
                       ".gather_for_metrics(")
# torch.distributed.checkpoint's save and load, under the names it is imported as (``import
# torch.distributed.checkpoint as dcp``): every rank writes its shard and agrees on the plan
DCP_CALL = re.compile(r"\b(?:dcp|DCP|dist_cp|distcp|dist_checkpoint|checkpoint)\.(?:save|load|save_state_dict|"
                      r"load_state_dict|async_save)\(")


# what may follow one of CALL_PREFIXES in a collective call: COLLECTIVE_TEXT without its prefix
_COLLECTIVE_NAME = re.compile(COLLECTIVE_TEXT.split(r"\.", 1)[1])


def _has_collective(text: str) -> bool:
    """COLLECTIVE_CALL.search(text) is not None, found from the prefixes with str.find: the regex tried
    at every position of a large file was a tenth of a cold lint of torch."""
    for prefix in CALL_PREFIXES:
        start = text.find(prefix)
        while start != -1:
            before = text[start - 1] if start else " "
            if not (before.isalnum() or before == "_") and _COLLECTIVE_NAME.match(text, start + len(prefix)):
                return True
            start = text.find(prefix, start + 1)
    return any(w in text for w in _METHOD_COLLECTIVES)


# ``fabric.save(path, state)`` / ``fabric.load(path)``: each ends in ``self.barrier()`` (Lightning Fabric)
_FABRIC_CHECKPOINT = re.compile(r"\bfabric\.(?:save|load)\(")


DEFINED = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)", re.M)
CALLED = re.compile(r"(?<![\w.])(?:self\.|cls\.)?(\w+)\s*\(")


def _rank_if_lines(text: str):
    """(end offset, indentation) of each ``if``/``elif`` line that tests a rank. Found with str.find on
    the rank words, not a regex over the whole file: this runs on every candidate file, unparsed."""
    bound = set()           # ``should_write = dist.get_rank() == 0``: names that hold a rank test
    for line_end, line in _rank_word_lines(text):
        code = line.split("#", 1)[0].rstrip()
        stripped = code.lstrip()
        if stripped.startswith(("if ", "if(", "elif ", "elif(", "match ")) and code.endswith(":") and \
                RANK_TEST.search(code):
            yield line_end, len(line) - len(line.lstrip())
        elif stripped.startswith(("if ", "if(", "elif ", "elif(")) and RANK_TEST.search(code) and (
                code.endswith("\\") or code.count("(") + code.count("[") > code.count(")") + code.count("]")):
            # the first line of a test written over several lines (``if is_main_process() and a \``
            # / ``and b:``, DINOv2): the block starts after the line that ends the test
            end = _test_end(text, line_end)
            if end is not None:
                yield end, len(line) - len(line.lstrip())
        elif code.endswith(":") and RANK_TEST.search(code):
            # the last line of a test written over several lines (``if not distributed or (distributed
            # \n and args.rank % ngpus_per_node == 0):``): the ``if`` a few lines up
            indent = _wrapped_if(text, line_end - len(line))
            if indent is not None:
                yield line_end, indent
        elif RANK_TEST.search(code) and not stripped.startswith(("if ", "if(", "elif ", "elif(")) and \
                (indent := _wrapped_if(text, line_end - len(line))) is not None and \
                (end := _test_end(text, line_end)) is not None:
            # a middle line of a test written over several lines (black's ``if (\n    a\n    and
            # is_primary(args)\n):``): the block starts after the line that ends the test
            yield end, indent
        else:
            held = _HOLDS_TEST.match(code)
            if held and RANK_TEST.search(held.group(2)):
                bound.add(held.group(1))
    for name in bound:
        if RANK_TEST.fullmatch(name):
            continue                        # (its ``if`` lines were found above)
        # (``if is_root:``, ``if i % 10 == 0 and is_root:``)
        test = re.compile(r"^([ \t]*)(?:el)?if[ \t(]+(?:[^\n]*[^\w.])?" + re.escape(name) + r"\b[^\n]*:[ \t]*(?:#[^\n]*)?$",
                          re.M)
        for match in test.finditer(text):
            yield match.end(), len(match.group(1))


def _test_end(text: str, line_end: int, most: int = 4):
    """The end offset of the line, among the ``most`` after ``line_end``, that ends with ``:`` (the end
    of a test written over several lines), or None."""
    begin = line_end + 1
    for _ in range(most):
        end = text.find("\n", begin)
        end = len(text) if end == -1 else end
        if text[begin:end].split("#", 1)[0].rstrip().endswith(":"):
            return end
        if end >= len(text):
            return None
        begin = end + 1
    return None


def _wrapped_if(text: str, start: int, most: int = 4):
    """The indentation of the ``if``/``elif`` line a few lines above the line at ``start`` that
    continues its test (an open bracket on the way), or None."""
    end = start - 1
    for _ in range(most):
        if end <= 0:
            return None
        begin = text.rfind("\n", 0, end) + 1
        line = text[begin:end].split("#", 1)[0].rstrip()
        stripped = line.lstrip()
        if stripped.startswith(("if ", "if(", "elif ", "elif(")):
            return len(line) - len(stripped) if line.count("(") + line.count("[") > line.count(")") + \
                line.count("]") or line.endswith("\\") else None
        if not stripped or stripped.endswith(":"):
            return None
        end = begin - 1
    return None


# ``name = <expression>`` on one line (not ``==``): a test (or a rank: ``self.gpu = int(os.environ["RANK"])``)
# stored under a name of the code's choosing
_HOLDS_TEST = re.compile(r"^[ \t]*((?:self\.)?\w+)[ \t]*(?::[^=]*)?=(?!=)(.*)$")


class _CollectiveFunctions:
    """Which functions of a file run a collective, themselves or through functions of the file they
    call (transitively), read from the text: a body is the lines indented deeper than its ``def`` (a
    triple-quoted string's lines belong to it whatever their indentation). Only the functions a rank
    branch calls, and what they call, are ever read."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.defs: dict = {}
        for match in DEFINED.finditer(text):
            self.defs.setdefault(match.group(2), []).append(match)
        self.calls: dict = {}      # name -> the functions of the file its bodies call
        self.runs: set = set()

    def any_runs(self, names) -> bool:
        todo = [n for n in names if n in self.defs and n not in self.calls]
        while todo:
            name = todo.pop()
            if name in self.calls:
                continue
            bodies = [self._body(m) for m in self.defs[name]]
            if any(COLLECTIVE_CALL.search(b) or "FULL_STATE_DICT" in b or "full_optim_state_dict" in b or
                   DCP_CALL.search(b) for b in bodies):
                # (an FSDP full state dict all-gathers: rank_branches._full_gather)
                self.runs.add(name)
            self.calls[name] = {c for b in bodies for c in CALLED.findall(b) if c in self.defs}
            todo.extend(c for c in self.calls[name] if c not in self.calls)
        grown = True
        while grown:
            grown = False
            for name, called in self.calls.items():
                if name not in self.runs and not called.isdisjoint(self.runs):
                    self.runs.add(name)
                    grown = True
        return not self.runs.isdisjoint(names)

    def called_through(self, names) -> set:
        """The names called (``f(``, ``module.f(``) in the bodies of these functions of the file and of
        the functions of the file they call, transitively."""
        seen, out = set(), set()
        todo = [n for n in names if n in self.defs]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for match in self.defs[name]:
                body = self._body(match)
                called = set(CALLED.findall(body)) | set(MODULE_CALLED.findall(body))
                out |= called
                todo.extend(c for c in called if c in self.defs and c not in seen)
        return out

    def _body(self, match) -> str:
        """From the ``def`` line (a one-line body is on it) to the first line indented no deeper, that is
        not the end of a wrapped signature (``):``) nor inside a triple-quoted string."""
        text = self.text
        indent = len(match.group(1))
        pos = text.find("\n", match.end())
        in_string = False
        while pos != -1:
            end = text.find("\n", pos + 1)
            line = text[pos + 1:len(text) if end == -1 else end]
            stripped = line.lstrip()
            if stripped and not in_string and len(line) - len(stripped) <= indent \
                    and not stripped.startswith((")", "]", "}")):
                break
            if (line.count('"""') + line.count("'''")) % 2:
                in_string = not in_string
            pos = end
        return text[match.start():len(text) if pos == -1 else pos]


_LEAVING = ("return", "continue", "break")


def _rank_branch_calls(text: str) -> bool:
    """Some ``if`` on the rank has, in its indented block (or its ``else``), a collective or a call of a
    function of this file that runs one: cheap text, so files without one are never parsed."""
    runs = None
    for body in _rank_blocks(text):
        if COLLECTIVE_CALL.search(body) or "FULL_STATE_DICT" in body or "full_optim_state_dict(" in body or \
                (".state_dict()" in body and "FULL_STATE_DICT" in text) or DCP_CALL.search(body) or \
                "summon_full_params(" in body or (
                ".save_state(" in body and "accelerat" in text) or (
                ".save_checkpoint(" in body and "deepspeed" in text):
            # (``with FSDP.state_dict_type(model, FULL_STATE_DICT): model.state_dict()`` all-gathers, as
            # does a ``model.state_dict()`` in a rank block after ``FSDP.set_state_dict_type(model, FULL_...)``;
            # under DeepSpeed, ``accelerator.save_state`` saves through a barrier: whether it runs
            # DeepSpeed, the script or the launch configurations beside it say, read later)
            return True
        lines = body.strip().splitlines()
        if lines and (lines[0].strip().startswith(_LEAVING) or lines[-1].strip().startswith(_LEAVING)):
            # ``if not is_main: return`` (or ``continue``, or ``self.meters.clear(); return``): what
            # follows runs on one side only
            return True
        if runs is None:
            runs = _CollectiveFunctions(text)
        if runs.any_runs(set(CALLED.findall(body))):
            return True
    return False


_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w.]+)(?:[ \t]+as[ \t]+(\w+))?[ \t]*(?:#[^\n]*)?$", re.M)
_FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+\(?([^)\n]*)", re.M)
# modules that are never this project's own: a rank branch calling into them cannot hide a collective
# of the project (torch's own collectives are found by their names anyway)
_EXTERNAL = ("torch", "numpy", "os", "sys", "time", "math", "json", "logging", "random", "typing", "collections",
             "functools", "itertools", "pathlib", "shutil", "re", "copy", "argparse", "datetime", "warnings",
             "transformers", "accelerate", "tqdm", "wandb", "PIL", "matplotlib", "pandas", "yaml", "omegaconf")


def _rank_branch_calls_imported(text: str) -> bool:
    """Some rank branch calls a function imported from a module of the project, which may run a
    collective in its own file: the file is worth a parse with its imports."""
    imported = set()
    found = line_matches(_FROM_IMPORT, text, "from")
    if "import (" in text or "import(" in text:
        # ``from ludic.training import (\n    Trainer,\n    ...)``: the names on the lines that follow
        found = found + _PARENTHESIZED_IMPORT.findall(text)
    for dots, module, names in found:
        if not dots and module.split(".")[0] in _EXTERNAL:
            continue
        imported.update(n.split(" as ")[-1].split("#")[0].strip() for n in names.replace("\n", ",").split(","))
    imported.discard("")
    for module, alias in line_matches(_IMPORT, text, "import"):
        # ``import backends`` (``utils.dist``: ``import utils.dist as du``)
        if module.split(".")[0] not in _EXTERNAL and module.split(".")[0] not in sys.stdlib_module_names:
            imported.add(alias or module.split(".")[0])
    if not imported:
        return False
    if any(d in imported and _RANK_DECORATOR_WORDS.search(d) for d in _DECORATOR_NAME.findall(text)):
        return True     # ``@leader_only()`` from the project: its wrapper may meet the ranks in a barrier
    # and the objects made from them (``tracker = MeanTracker(device)``; ``tracker.synced_mean()``;
    # ``backend = distributed_utils.set_backend(args)``; ``backend.average_all(loss)``)
    # (or kept on ``self``: ``self.alg = PPO(policy, ...)``; ``self.alg.broadcast_parameters()``, rsl_rl's runner)
    made = {name for name, cls in _MADE_FROM.findall(text) if cls in imported}
    bodies = list(_rank_blocks(text))
    if any(imported.intersection(CALLED.findall(body)) or (imported | made).intersection(
            MODULE_CALLED.findall(body) + SELF_ATTRIBUTE_CALLED.findall(body)) for body in bodies):
        return True
    # through a function of this file: ``if local_rank in [-1, 0]: evaluate(args, model)``, whose
    # ``load_and_cache_examples`` (imported) meets the others in a barrier (transformers#998)
    local = _CollectiveFunctions(text)
    called = {name for body in bodies for name in CALLED.findall(body) if name in local.defs}
    return bool(called) and not (imported | made).isdisjoint(local.called_through(called))


_PARENTHESIZED_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]*\(([^)]*)\)", re.M)
_MADE_FROM = re.compile(r"^[ \t]*((?:self\.)?\w+)[ \t]*=[ \t]*(\w+)(?:\.\w+)?\(", re.M)
SELF_ATTRIBUTE_CALLED = re.compile(r"(?<![\w.])(self\.\w+)\.\w+\s*\(")
_DECORATOR_NAME = re.compile(r"^[ \t]*@(\w+)", re.M)
# a decorator whose name says it is about the ranks (torch's own files use dozens of other decorators)
_RANK_DECORATOR_WORDS = re.compile(r"leader|main|rank|master|zero|primary|chief|barrier|sync", re.I)


# ``comm.synchronize()``: a function of a project module imported whole (``from utils import comm``)
MODULE_CALLED = re.compile(r"(?<![\w.])(\w+)\.\w+\s*\(")


def _rank_blocks(text: str):
    """The indented block (and else) of every ``if`` line that tests a rank."""
    for pos, indent in _rank_if_lines(text):
        block = []
        while pos < len(text):
            end = text.find("\n", pos + 1)
            end = len(text) if end == -1 else end
            line = text[pos + 1:end]
            stripped = line.strip()
            if stripped and len(line) - len(line.lstrip()) <= indent and not stripped.startswith(("else", "elif")):
                break
            block.append(line)
            pos = end
        yield "\n".join(block)
    yield from _rank_conditional_expressions(text)


_CONDITIONAL = re.compile(r"[ \t]if[ \t]+(.+?)[ \t]+else\b")


def _rank_conditional_expressions(text: str):
    """``acc = evaluate(model) if rank == 0 else None``: the line of each conditional expression on
    a rank, up to its ``if`` (the side only that rank runs; the ``else`` side after it)."""
    for _, line in _rank_word_lines(text):
        code = line.split("#", 1)[0]
        match = _CONDITIONAL.search(code) if " else" in code else None
        if match and RANK_TEST.search(match.group(1)) and not code.lstrip().startswith(("if", "elif")):
            yield code[:match.start()] + "\n" + code[match.end():]


def _rank_word_lines(text: str):
    """(end offset, line) of each line that holds one of the rank words, each line once, found with
    str.find (not a regex over the whole file)."""
    seen = set()
    for word in RANK_WORDS:
        start = text.find(word)
        while start != -1:
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", start)
            line_end = len(text) if line_end == -1 else line_end
            if line_start not in seen:
                seen.add(line_start)
                yield line_end, text[line_start:line_end]
            start = text.find(word, line_end)


class CollectiveInRankBranch(Rule):
    code = "SC301"
    name = "collective-in-rank-branch"
    severity = "error"
    summary = "A collective runs only on some ranks: the others never join it and the job hangs"
    # functions with an ``if`` on the rank whose branch runs a collective, itself or through a call

    @classmethod
    def gate(cls) -> tuple:
        return FRAMEWORKS

    @classmethod
    def wants(cls, text: str) -> bool:
        # a collective of torch.distributed / accelerate / lightning, and something that tells ranks apart
        # substring tests first: the regexes are slow over a large file
        if not (any(f in text for f in FRAMEWORKS) and any(w in text for w in RANK_WORDS)
                and (_has_collective(text) or "FULL_STATE_DICT" in text or "summon_full_params" in text or
                     ("checkpoint" in text and DCP_CALL.search(text) is not None) or
                     (".save_state(" in text and "accelerat" in text) or _FABRIC_CHECKPOINT.search(text) is not None or
                     (".save_checkpoint(" in text and "deepspeed" in text))):
            return False
        # a rank test behind a property (``if self.can_checkpoint:``) is not on the ``if`` line; a
        # function only rank 0 runs (``@rank_zero_only``, ``@accelerator.on_main_process``) has none
        return _rank_branch_calls(text) or "@property" in text or bool(RANK_DECORATOR.search(text))

    @classmethod
    def reaches(cls, text: str) -> bool:
        return any(w in text for w in RANK_WORDS) and _rank_branch_calls_imported(text)

    what = """
        Finds a collective (`dist.barrier()`, `all_reduce`, `broadcast`, `all_gather`, `reduce`,
        `gather`, `accelerator.wait_for_everyone()`, an FSDP full state dict, `accelerator.save_state()`
        in a script that runs under DeepSpeed, ...) that runs only inside an `if rank == 0:`
        / `if accelerator.is_main_process:` branch, directly or through a function of the same file.
    """
    why = """
        A collective completes only when every rank of the group calls it. If only rank 0 does, it
        waits forever; the other ranks go on to their next collective (often a gradient all-reduce)
        and wait there. Nothing crashes: the job hangs until the NCCL/gloo timeout, typically 10 to
        30 minutes later, with no pointer to the cause. `synccheck profile --hang-timeout` shows it.
    """
    use_instead = "Run the collective on every rank: move it after the rank-0 block."
    fix_safety = """
        There is no automatic fix: moving a collective out of a rank branch changes what every rank runs.
    """
    INVALID = ("""
        import torch.distributed as dist

        if dist.get_rank() == 0:
            save_checkpoint(model)
            dist.barrier()  # SC301
    """, """
        import torch.distributed as dist

        def sync_metrics(t):
            dist.all_reduce(t)
            return t

        if rank == 0:
            sync_metrics(loss)  # SC301
    """, """
        from accelerate import Accelerator
        accelerator = Accelerator()
        if accelerator.is_main_process:
            accelerator.save_model(model, "out")
            accelerator.wait_for_everyone()  # SC301
    """, """
        import os
        import torch.distributed as dist

        master_process = int(os.environ["RANK"]) == 0   # nanoGPT's name
        if master_process:
            os.makedirs(out_dir, exist_ok=True)
            dist.barrier()  # SC301
    """)
    VALID = ("""
        import torch.distributed as dist

        if dist.get_rank() == 0:
            save_checkpoint(model)
        dist.barrier()
    """, """
        import torch.distributed as dist

        if rank == 0:
            dist.broadcast(t, src=0)
        else:
            dist.broadcast(t, src=0)
    """)

    def check(self, ctx):
        from synccheck.analyzer.project.rank_branches import collectives_in_rank_branches

        for found in collectives_in_rank_branches(ctx.program):
            through = " (through this call)" if found.through else ""
            where = (f"on the main rank (its function is decorated `{found.test_text}`)"
                     if found.test_text.startswith("@") else f"on the ranks where `{found.test_text}` holds")
            ctx.report(self, found.module, found.node,
                       f"`{found.what}` is a collective but runs only {where}"
                       f"{through}: the other ranks never join it and the job hangs",
                       "call it on every rank, after the rank-dependent block")
