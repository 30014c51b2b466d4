"""The hooks installed inside every training worker, once `import torch` has finished.

What DDP does at run time, and where each count comes from:

* A DDP forward with grad enabled is a **micro-step**. DDP reads `require_backward_grad_sync` in
  `_pre_forward`/`_post_forward` (`reducer.prepare_for_backward`), never during backward, so whether the
  coming backward all-reduces is decided by the flag *at forward time*; that is what we record.
* Gradient buckets are counted without touching DDP's own all-reduce. A synced forward prepares the
  reducer; when that backward has run, the reducer is *finalized* only after every bucket's all-reduce
  completed (`Reducer::finalize_backward` waits for them). So after a synced backward we ask the reducer
  whether it finalized and, if so, record one all-reduce per bucket of its current layout (sizes from
  DDP's own logging data; the layout is rebuilt once, at the second synced iteration). The check runs from
  an autograd engine callback queued behind the reducer's own, and again at the next forward, optimizer
  step, barrier and `destroy_process_group`, so no synced backward is missed. No comm hook means no
  Python in the all-reduce path and no extra pass over the gradients: a Python comm hook costs 1-3% of
  the step time of a small model (benchmarks/bench_profiler_overhead.py), the whole overhead budget.
* `--comm-hook` (and any model whose user registers a comm hook) counts through a counting comm hook
  instead: it does exactly what DDP's built-in path does (scale by 1/world_size, then all-reduce SUM), so
  the weights stay bit-identical, and it times every bucket. DDP accepts one hook only, so a hook the user
  registers is routed *through* the counting hook instead of replacing it.
* `no_sync()` entered after a synced forward is too late: the reducer was already prepared. We note the
  `no_sync()` call site, and when the backward of a synced forward starts while the flag is off we record
  the SC102 evidence with that line.
* Optimizer steps come from torch's global optimizer step post-hook; each one flushes the record file, and
  so do a blocking `barrier` (when it starts and when it returns) and `destroy_process_group`, so what a
  rank did after its last optimizer step survives the `os._exit` that often follows.
* Python-level collectives (`dist.all_reduce`, `barrier`, `all_gather_single`, `reduce_scatter_single`,
  ...) are wrapped on the `torch.distributed` namespace: FSDP1/FSDP2, parameter averaging and manual
  gradient averaging all go through them.

Nothing here may raise into the user's program: every hook body is guarded, and a failure disables the
profiler with one line on stderr.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref

from synccheck.profiler import recorder as R
from synccheck.profiler.frames import scan_stack, user_frame

rec = R.Recorder()
_dist = None      # torch.distributed, set by install()
_torch = None
_installed = False

# Per-model bookkeeping, keyed by the wrapper object itself (weak: models may be discarded).
_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_model_counter = 0
_optimizer_index: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_in_comm_hook = 0          # >0 while a user's DDP comm hook runs: its collectives belong to the bucket
_comm_hook_collectives = 0  # collectives issued so far inside comm hooks
_fsdp_forward_depth = 0
# `synccheck profile --comm-hook`: count (and time) every DDP bucket through a Python comm hook.
COMM_HOOK = os.environ.get(R.ENV_COMM_HOOK) == "1"


def _warn(msg: str) -> None:
    print(f"synccheck: {msg}", file=sys.stderr)


def _active() -> bool:
    return rec.active or (rec.rank is None and rec.try_activate(_dist))


# -- process role ------------------------------------------------------------------------------------

_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic")
_LAUNCHER_SCRIPTS = ("torchrun", "accelerate", "accelerate-launch", "deepspeed")
# `python -m accelerate.commands.launch` and `python -m accelerate.commands.accelerate_cli launch`: the
# accelerate CLI never trains in its own process (`launch` runs torch.distributed.run in-process).
_LAUNCHER_MODULE_PREFIXES = _LAUNCHER_MODULES + ("accelerate.commands.",)


def process_role() -> str:
    """'agent' for torchrun / `python -m torch.distributed.run` / `accelerate launch` themselves.

    They import torch.distributed too, but only start workers; they must record nothing."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and str(spec.name).startswith(_LAUNCHER_MODULE_PREFIXES):
        return "agent"
    # `python -m torch.distributed.run`: runpy imports the torch.distributed package (and so torch)
    # before __main__ exists and while sys.argv[0] is still "-m"; the interpreter's own argv says it.
    orig = list(getattr(sys, "orig_argv", []))
    for i, arg in enumerate(orig[1:], 1):
        module = orig[i + 1] if arg == "-m" and i + 1 < len(orig) else (arg[2:] if arg.startswith("-m") else None)
        if module is not None:
            if module.startswith(_LAUNCHER_MODULE_PREFIXES):
                return "agent"
            break
        if not arg.startswith("-"):
            break
    argv0 = sys.argv[0] if sys.argv else ""
    base = os.path.basename(argv0)
    if base in _LAUNCHER_SCRIPTS:
        return "agent"
    norm = argv0.replace(os.sep, "/")
    if norm.endswith(("torch/distributed/run.py", "torch/distributed/launch.py")):
        return "agent"
    return "worker"


# -- DDP ---------------------------------------------------------------------------------------------

class _ModelState:
    """What the counting comm hook and the forward wrapper need to know about one wrapped model."""

    __slots__ = ("id", "kind", "model_ref", "pg", "inv_world", "user_hook", "user_state",
                 "last_no_sync", "by_hook", "layout", "layout_final", "synced_forwards", "pending",
                 "comm_us", "__weakref__")

    def __init__(self, model_id: str, kind: str, model) -> None:
        self.id = model_id
        self.kind = kind
        self.model_ref = weakref.ref(model)
        self.pg = None
        self.inv_world = 1.0
        self.user_hook = None
        self.user_state = None
        self.last_no_sync: tuple | None = None   # (t, path, line) of the latest no_sync() call
        self.by_hook = False          # buckets counted by the counting comm hook, not from the layout
        self.layout: list = []        # bytes of each gradient bucket, as the reducer has them now
        self.layout_final = False     # DDP rebuilds its buckets once; after that the layout is kept
        self.synced_forwards = 0
        self.pending: int | None = None   # time of a synced forward whose backward is not yet counted
        self.comm_us = 0              # DDP's own average communication time of a synced backward


def _register_model(model, kind: str, frame) -> _ModelState:
    global _model_counter
    _model_counter += 1
    st = _ModelState(f"{kind}{_model_counter - 1}", kind, model)
    _models[model] = st
    try:
        params = list(model.parameters())
        n_params = sum(p.numel() for p in params)
        n_bytes = sum(p.numel() * p.element_size() for p in params)
    except Exception:
        n_params = n_bytes = 0
    path, line = user_frame(frame)
    rec.event([R.MODEL, R.now_us(), st.id, kind, n_params, n_bytes, path, line])
    return st


def _counting_comm_hook(st: _ModelState, bucket):
    """DDP's gradient all-reduce for one bucket, counted.

    Without a user hook this does what the reducer's built-in path does when no hook is registered: the
    bucket holds the summed-by-nobody local gradients, scaled by 1/world_size (the reducer multiplies by
    1/div_factor while copying into the bucket; with a hook it only copies), then all-reduced with SUM.
    Same operations in the same order, so the weights match a run without the profiler bit for bit."""
    global _in_comm_hook
    t0 = R.now_us()
    if st.user_hook is None:
        buf = bucket.buffer()
        buf.mul_(st.inv_world)
        n_bytes = buf.numel() * buf.element_size()
        fut = st.pg.allreduce([buf]).get_future()

        def done(f, t0=t0, n_bytes=n_bytes):
            # Runs on the thread that completes the all-reduce (gloo's worker): only append here.
            rec.event([R.BUCKET, t0, R.now_us() - t0, st.id, n_bytes, 1])
            return f.value()[0]

        return fut.then(done)
    buf = bucket.buffer()
    n_bytes = buf.numel() * buf.element_size()
    before = _comm_hook_collectives
    _in_comm_hook += 1
    try:
        fut = st.user_hook(st.user_state, bucket)
    finally:
        _in_comm_hook -= 1
    # A user hook that issued no visible collective (post-local-SGD after its warm-up, a no-op hook)
    # handled the bucket without communicating.
    communicated = 1 if _comm_hook_collectives > before else 0

    def user_done(f, t0=t0, n_bytes=n_bytes, communicated=communicated):
        rec.event([R.BUCKET, t0, R.now_us() - t0, st.id, n_bytes, communicated])
        return f.wait()

    return fut.then(user_done)


def _patch_ddp(DDP) -> None:
    orig_init = DDP.__init__
    orig_forward = DDP.forward
    orig_no_sync = DDP.no_sync
    orig_register = DDP.register_comm_hook
    orig_register_builtin = DDP._register_builtin_comm_hook

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            if not _active():
                return
            st = _models.get(self) or _register_model(self, "ddp", sys._getframe(1))
            _install_counting_hook(self, st)
        except Exception as exc:  # never break DDP construction
            _warn(f"could not hook DistributedDataParallel: {type(exc).__name__}: {exc}")

    @functools.wraps(orig_register)
    def register_comm_hook(self, state, hook):
        st = _models.get(self)
        if st is None or not rec.active or getattr(self, "reducer", None) is None:
            return orig_register(self, state, hook)
        if st.user_hook is not None:
            # Keep DDP's own rule: one hook per model.
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        # The counting hook becomes the reducer's hook (DDP accepts only one), and the user's hook is
        # called from inside it. Keep DDP's own bookkeeping as the original method does.
        self._check_comm_hook(hook)
        if not st.by_hook:
            _settle(self, st)
            _route_through_counting_hook(self, st)
        if self.logger is not None:
            self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        st.user_hook, st.user_state = hook, state
        return None

    @functools.wraps(orig_register_builtin)
    def _register_builtin_comm_hook(self, comm_hook_type):
        st = _models.get(self)
        if st is None or not rec.active:
            return orig_register_builtin(self, comm_hook_type)
        # The C++ built-ins cannot be chained from Python; use their Python equivalents.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        name = str(comm_hook_type).rsplit(".", 1)[-1]
        hook = default_hooks.fp16_compress_hook if "FP16" in name else default_hooks.allreduce_hook
        return register_comm_hook(self, self.process_group, hook)

    @functools.wraps(orig_forward)
    def forward(self, *args, **kwargs):
        st = _models.get(self) if rec.active else None
        if st is None or not _torch.is_grad_enabled():
            return orig_forward(self, *args, **kwargs)
        try:
            synced = bool(self.require_backward_grad_sync)
            t0 = R.now_us()
            path, line = user_frame(sys._getframe(1))
            if st.pending is not None:
                _settle(self, st)
                st.pending = None       # a synced forward whose backward never ran all-reduced nothing
            rec.event([R.FORWARD, t0, st.id, 1 if synced else 0, path, line])
        except Exception:
            return orig_forward(self, *args, **kwargs)
        output = orig_forward(self, *args, **kwargs)
        if synced:
            try:
                if not st.by_hook:
                    st.synced_forwards += 1
                    if not st.layout_final:
                        _read_layout(self, st)      # after _pre_forward, which may have rebuilt the buckets
                    st.pending = t0
            except Exception:
                pass
            _watch_backward(self, st, output, t0)
        return output

    @functools.wraps(orig_no_sync)
    def no_sync(self):
        st = _models.get(self) if rec.active else None
        if st is not None:
            path, line = user_frame(sys._getframe(1))
            st.last_no_sync = (R.now_us(), path, line)
        return orig_no_sync(self)

    DDP.__init__ = __init__
    DDP.forward = forward
    DDP.no_sync = no_sync
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook


def _install_counting_hook(ddp, st: _ModelState) -> None:
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "reducer", None) is None:
        return  # compiled-autograd DDP: no C++ reducer to hook; Python collectives still count
    st.pg = ddp.process_group
    world = st.pg.size()
    st.inv_world = 1.0 / world
    if ddp._comm_hooks:
        # A hook was registered during construction (mixed precision): the reducer cannot get a second
        # one, so its buckets are counted from the layout.
        return
    if COMM_HOOK or not hasattr(ddp, "_get_ddp_logging_data"):
        _route_through_counting_hook(ddp, st)


def _route_through_counting_hook(ddp, st: _ModelState) -> None:
    _dist._register_comm_hook(ddp.reducer, st, _counting_comm_hook)
    st.by_hook = True
    st.pending = None


# -- counting buckets from the layout ----------------------------------------------------------------

_ENGINE = None


def _read_layout(ddp, st: _ModelState) -> None:
    """Bucket sizes and communication time from DDP's logging data (about 13 us a call).

    DDP updates that data at the start of a synced forward, *before* it rebuilds its buckets (once, in
    the second synced iteration), so the rebuilt layout shows one synced iteration late: that one
    backward is counted in the layout before the rebuild (same bytes, maybe another bucket count)."""
    data = ddp._get_ddp_logging_data()
    rebuilt = bool(data.get("has_rebuilt_buckets"))
    sizes = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes")
    st.layout = [int(b) for b in str(sizes or "").split(",") if b.strip()]
    # No rebuild at all with find_unused_parameters (unless static_graph): give up waiting after a few.
    st.layout_final = rebuilt or st.synced_forwards >= 4
    if rebuilt:
        rec.force_detail()      # the steps right after the rebuild are written in full
    _read_comm_time(data, st)


def _read_comm_time(data: dict, st: _ModelState) -> None:
    # DDP times its sampled iterations (the first ten, then every 100th): from the launch of the first
    # bucket's all-reduce to the end of the last one.
    avg_ns = data.get("avg_backward_comm_time")
    if isinstance(avg_ns, int) and avg_ns > 0:
        st.comm_us = avg_ns // 1000


def _settle(ddp, st: _ModelState) -> None:
    """Count the buckets of the pending synced backward if the reducer has finished it."""
    t_forward = st.pending
    if t_forward is None:
        return
    try:
        ddp.reducer._check_reducer_finalized()
    except Exception:
        return              # its backward has not run (yet): nothing was all-reduced
    st.pending = None
    t = R.now_us()
    layout = st.layout
    if layout:
        # The backward's communication time as DDP measures it, shared out over its buckets, ending now
        # but never starting before its own forward: the report places events in time, and a bucket
        # drawn before the previous optimizer step would be counted in the previous step.
        dur = st.comm_us // len(layout)
        start = max(t - st.comm_us, t_forward + 1)
        for n_bytes in layout:
            rec.event([R.BUCKET, start, dur, st.id, n_bytes, 1])
            start += dur


def _refresh_comm_times() -> None:
    for model, st in list(_models.items()):
        if st.kind == "ddp" and not st.by_hook and st.layout_final:
            try:
                _read_comm_time(model._get_ddp_logging_data(), st)
            except Exception:
                pass


def _settle_all() -> None:
    for model, st in list(_models.items()):
        if st.pending is not None:
            try:
                _settle(model, st)
            except Exception:
                pass


def _settle_after_backward(ddp_ref, st: _ModelState) -> None:
    """Queue a check behind the reducer's own end-of-backward callback (which waits for the all-reduces).

    Called while the backward runs, before the reducer queued its callback (it does so when the first
    gradient of the model is ready): the engine runs final callbacks in order, including those queued
    by a callback, so the second hop lands after the reducer's."""
    engine = _ENGINE

    def check():
        try:
            model = ddp_ref()
            if model is not None:
                _settle(model, st)
        except Exception:
            pass

    engine.queue_callback(lambda: engine.queue_callback(check))


def _first_grad_tensor(output, depth: int = 0):
    T = _torch.Tensor
    if isinstance(output, T):
        return output if output.requires_grad else None
    if depth > 2:
        return None
    if isinstance(output, dict):
        output = list(output.values())
    elif hasattr(output, "__dataclass_fields__"):
        output = [getattr(output, f) for f in output.__dataclass_fields__]
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _watch_backward(ddp, st: _ModelState, output, t_forward: int) -> None:
    """Check, when the backward of this synced forward starts, whether sync was switched off meanwhile.

    That backward all-reduces anyway (the reducer was prepared in the forward), so `no_sync` there only
    looks like it works: SC102."""
    tensor = _first_grad_tensor(output)
    if tensor is None:
        return
    ddp_ref = weakref.ref(ddp)
    fired = []

    def on_backward(grad):
        if fired:
            return None
        fired.append(True)
        try:
            if st.pending == t_forward:
                _settle_after_backward(ddp_ref, st)
        except Exception:
            pass
        try:
            model = ddp_ref()
            if model is None or model.require_backward_grad_sync or not rec.active:
                return None
            late = st.last_no_sync
            if late is not None and late[0] >= t_forward:
                rec.event([R.LATE_NO_SYNC, R.now_us(), st.id, "no_sync", late[1], late[2]])
            else:
                # The flag was set by hand after the forward; the backward call is the best location.
                path, line = user_frame(sys._getframe(1))
                rec.event([R.LATE_NO_SYNC, R.now_us(), st.id, "flag", path, line])
        except Exception:
            pass
        return None

    try:
        tensor.register_hook(on_backward)
    except Exception:
        pass


# -- FSDP --------------------------------------------------------------------------------------------

def _patch_fsdp2(state_module) -> None:
    """FSDP2 (`fully_shard`): a micro-step is a forward of the root FSDP state.

    FSDP reads its sync switch (`set_requires_gradient_sync`) during backward, so whether a micro-step
    synced is decided later from the reduce-scatters actually seen."""
    FSDPState = getattr(state_module, "FSDPState", None)
    if FSDPState is None or not hasattr(FSDPState, "_root_pre_forward"):
        return
    orig = FSDPState._root_pre_forward

    @functools.wraps(orig)
    def _root_pre_forward(self, module, args, kwargs):
        ctx = getattr(self, "_state_ctx", None)
        starting = ctx is not None and ctx.iter_forward_root is None
        result = orig(self, module, args, kwargs)
        try:
            if starting and ctx.iter_forward_root is self and _torch.is_grad_enabled() and _active():
                st = _models.get(module) or _register_model(module, "fsdp2", sys._getframe(1))
                reduce_grads = any(getattr(g, "reduce_grads", True) for g in self._fsdp_param_groups) \
                    if self._fsdp_param_groups else True
                path, line = user_frame(sys._getframe(1))
                rec.event([R.FORWARD, R.now_us(), st.id, 1 if reduce_grads else 0, path, line])
        except Exception:
            pass
        return result

    FSDPState._root_pre_forward = _root_pre_forward


def _patch_fsdp1(fsdp_module) -> None:
    FSDP = getattr(fsdp_module, "FullyShardedDataParallel", None)
    if FSDP is None:
        return
    orig = FSDP.forward

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        # Nested FSDP instances run inside the root's forward: only the outermost one is a micro-step.
        global _fsdp_forward_depth
        if _fsdp_forward_depth == 0 and _torch.is_grad_enabled():
            try:
                if _active():
                    st = _models.get(self) or _register_model(self, "fsdp", sys._getframe(1))
                    path, line = user_frame(sys._getframe(1))
                    sync = getattr(self, "_sync_gradients", True)
                    rec.event([R.FORWARD, R.now_us(), st.id, 1 if sync else 0, path, line])
            except Exception:
                pass
        _fsdp_forward_depth += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            _fsdp_forward_depth -= 1

    FSDP.forward = forward


# -- optimizer steps ---------------------------------------------------------------------------------

def _checksum_due(n: int) -> bool:
    # Powers of two, then every 1024 steps: enough to catch divergence early and late at a cost that
    # does not show in the step time.
    return (n & (n - 1)) == 0 or n % 1024 == 0


_INT_VIEW = {}


def _param_checksum() -> int | None:
    """Bit-level checksum of every DDP replica's parameters: the integer sum of their raw bits.

    Integer addition is exact and order-independent, so ranks with identical replicas get identical
    sums whatever their thread count, and ranks whose weights differ in a single bit almost surely do
    not. Sharded models (FSDP) hold different shards per rank and are not compared."""
    torch = _torch
    if not _INT_VIEW:
        _INT_VIEW.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    parts = []
    for model, st in list(_models.items()):
        if st.kind != "ddp":
            continue
        for p in model.parameters():
            v = p.detach()
            if v.is_complex():
                v = torch.view_as_real(v)
            itype = _INT_VIEW.get(v.element_size())
            if itype is None or v.numel() == 0:
                continue
            parts.append(v.contiguous().view(itype).sum(dtype=torch.int64))
    if not parts:
        return None
    return int(torch.stack(parts).sum().item())


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    try:
        if not _active():
            return
        rec.steps += 1
        n = rec.steps
        idx = _optimizer_index.get(optimizer)
        if idx is None:
            idx = _optimizer_index[optimizer] = len(_optimizer_index)
        _settle_all()
        checksum = None
        if _checksum_due(n):
            checksum = _param_checksum()
            _refresh_comm_times()
        path, line = user_frame(sys._getframe(1))
        rec.event([R.STEP, R.now_us(), n, idx, path, line, checksum])
        rec.flush()
    except Exception as exc:
        _warn(f"optimizer step hook failed, records may be incomplete: {type(exc).__name__}: {exc}")


# -- Python-level collectives ------------------------------------------------------------------------

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "barrier", "monitored_barrier", "reduce",
    "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "gather", "scatter",
    "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
)

_GRAD_REDUCTIONS = ("all_reduce", "reduce_scatter", "all_reduce_coalesced", "reduce_scatter_single",
                    "reduce_scatter_tensor")


def _n_bytes(value) -> int:
    T = _torch.Tensor
    if isinstance(value, T):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, T))
    return 0


def _tensor_is_param_or_grad(tensor) -> str:
    """'param' if `tensor` shares storage with a DDP replica's parameter, 'grad' for a gradient."""
    try:
        ptr = tensor.data_ptr()
    except Exception:
        return ""
    for model, st in list(_models.items()):
        for p in model.parameters():
            if p.data_ptr() == ptr:
                return "param"
            g = p.grad
            if g is not None and g.data_ptr() == ptr:
                return "grad"
    return ""


def _classify(name: str, via: str, tensor) -> str:
    """What a collective is for: 'hook' (inside a DDP comm hook, counted with its bucket), 'grad'
    (gradient synchronization), 'avg' (parameter averaging: local SGD), 'gather' (FSDP parameter
    all-gather) or 'other'."""
    if _in_comm_hook:
        return "hook"
    if via == "avg":
        return "avg"
    if via == "fsdp":
        return "grad" if name in _GRAD_REDUCTIONS else "gather"
    if via == "ddp":
        return "grad" if name == "all_reduce" else "other"
    if name in ("all_reduce", "all_reduce_coalesced") and tensor is not None:
        first = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
        kind = _tensor_is_param_or_grad(first)
        if kind == "param":
            return "avg"
        if kind == "grad":
            return "grad"
    return "other"


def _wrap_collective(name: str, fn):
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    async_index = params.index("async_op") if "async_op" in params else -1
    # FSDP passes tensors by keyword (`reduce_scatter_single(output=..., input=...)`): look up by name too.
    # The tensor that is reduced: for the *_single / *_tensor forms it is the input (second) argument.
    tensor_index = 1 if name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                                 "reduce_scatter_tensor", "all_to_all_single", "reduce_scatter",
                                 "all_to_all") else 0
    # A blocking barrier is rare and often the last thing a script does before it ends (with `os._exit`,
    # or torch 2.13's gloo teardown abort, both of which skip atexit): the record file is flushed when one
    # starts and when it returns, so whatever came after the last optimizer step (a final local-SGD
    # averaging) and the barrier itself reach the disk. Per-step collectives pay nothing for it.
    flush_around = name in ("barrier", "monitored_barrier")
    if flush_around:
        tensor_index = -1
    tensor_name = params[tensor_index] if 0 <= tensor_index < len(params) else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _comm_hook_collectives
        if not rec.active and not _active():
            return fn(*args, **kwargs)
        try:
            if async_index >= 0:
                async_op = kwargs.get("async_op", args[async_index] if len(args) > async_index else False)
            else:
                async_op = False
            tensor = None
            if tensor_index >= 0:
                tensor = args[tensor_index] if len(args) > tensor_index else kwargs.get(tensor_name)
            n_bytes = _n_bytes(tensor) if tensor is not None else 0
            path, line, via = scan_stack(sys._getframe(1))
            role = _classify(name, via, tensor)
            if _in_comm_hook:
                _comm_hook_collectives += 1
            t0 = R.now_us()
        except Exception:
            return fn(*args, **kwargs)
        if async_op:
            result = fn(*args, **kwargs)
            rec.event([R.COLLECTIVE, t0, -1, name, n_bytes, role, path, line])
            return result
        # A blocking call: the flusher reports it if it does not return (a hang), see recorder.
        current = (name, path, line, t0)
        rec.current = current
        if flush_around:
            _flush_quietly()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.current = None
            rec.event([R.COLLECTIVE, t0, R.now_us() - t0, name, n_bytes, role, path, line])
            if flush_around:
                _flush_quietly()
    wrapper.__synccheck_wrapped__ = fn
    return wrapper


def _flush_quietly() -> None:
    try:
        _settle_all()
        rec.flush()
    except Exception:
        pass


def _patch_collectives(dist) -> None:
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__synccheck_wrapped__", None) is not None:
            continue
        setattr(dist, name, _wrap_collective(name, fn))


def _patch_init_process_group(dist) -> None:
    """Activate as soon as the default group exists, so the record file (and the launcher's view of
    which pid is which rank) appears before the first micro-step."""
    orig = dist.init_process_group

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        result = orig(*args, **kwargs)
        try:
            if rec.forked:
                rec.reopen_after_fork()
            rec.try_activate(dist)
        except Exception:
            pass
        return result

    _install_on_dist(dist, "init_process_group", orig, init_process_group)


def _patch_destroy_process_group(dist) -> None:
    """Flush the record file when the script tears its process group down.

    That is the end of a distributed script, often followed by `os._exit` (or by torch 2.13's gloo abort
    at interpreter teardown), which skip atexit: without this, what a rank did after its last optimizer
    step (a final parameter averaging) could be lost, since the background flusher runs only every
    FLUSH_INTERVAL_S."""
    orig = getattr(dist, "destroy_process_group", None)
    if orig is None or getattr(orig, "__synccheck_wrapped__", None) is not None:
        return

    @functools.wraps(orig)
    def destroy_process_group(*args, **kwargs):
        if rec.active:
            _flush_quietly()
        return orig(*args, **kwargs)

    _install_on_dist(dist, "destroy_process_group", orig, destroy_process_group)


def _install_on_dist(dist, name: str, orig, wrapper) -> None:
    """``dist.<name> = wrapper``, and on ``distributed_c10d`` too where that module still holds the
    original (torch's own code calls it from there)."""
    wrapper.__synccheck_wrapped__ = orig
    setattr(dist, name, wrapper)
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is not None and getattr(c10d, name, None) is orig:
        setattr(c10d, name, wrapper)


# -- installation ------------------------------------------------------------------------------------

def install(when_imported=None) -> None:
    """Called by the bootstrap right after `import torch` finished in this process."""
    global _installed, _dist, _torch
    if _installed:
        return
    _installed = True
    if not rec.out_dir:
        return
    role = process_role()
    R.write_process_marker(rec.out_dir, rec.session, role)
    if role == "agent":
        return
    import torch
    _torch = torch
    if not torch.distributed.is_available():
        return
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook
    _dist = dist
    global _ENGINE
    _ENGINE = torch.autograd.Variable._execution_engine
    _patch_ddp(DistributedDataParallel)
    _patch_collectives(dist)
    _patch_init_process_group(dist)
    _patch_destroy_process_group(dist)
    register_optimizer_step_post_hook(_on_optimizer_step)
    # FSDP is imported lazily by the user's script, if at all.
    lazy = (("torch.distributed.fsdp._fully_shard._fsdp_state", _patch_fsdp2),
            ("torch.distributed.fsdp.fully_sharded_data_parallel", _patch_fsdp1))
    for module_name, patch in lazy:
        module = sys.modules.get(module_name)
        if module is not None:
            _guarded(patch, module)
        elif when_imported is not None:
            when_imported(module_name, functools.partial(_guarded, patch))


def _guarded(patch, module) -> None:
    try:
        patch(module)
    except Exception as exc:
        _warn(f"could not hook {module.__name__}: {type(exc).__name__}: {exc}")
