"""The names of things, as torch, Accelerate, Lightning Fabric and DeepSpeed spell them.

Everything the analysis knows about third-party APIs lives here, keyed by qualified name (resolved
from the module's own imports, never by importing anything) or, where code reaches an object
through a value we cannot resolve, by the names people give such objects.
"""
from __future__ import annotations

import re

# Data-parallel wrappers: the qualified name of the call that makes one -> its kind.
WRAPPERS = {
    "torch.nn.parallel.DistributedDataParallel": "ddp",
    "torch.nn.parallel.distributed.DistributedDataParallel": "ddp",
    "torch.nn.DistributedDataParallel": "ddp",
    "torch.distributed.fsdp.FullyShardedDataParallel": "fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "fsdp",
    "torch.distributed.fsdp.fully_shard": "fsdp2",
    "torch.distributed._composable.fsdp.fully_shard": "fsdp2",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard": "fsdp2",
    "torch.distributed.fsdp._fully_shard.fully_shard": "fsdp2",
    # composable DDP, applied in place like fully_shard (and switched off the same way in torch 2.6+:
    # ``set_requires_gradient_sync``)
    "torch.distributed._composable.replicate": "fsdp2",
    "torch.distributed._composable.replicate.replicate": "fsdp2",
    "deepspeed.initialize": "deepspeed",
    # ignite's helper: DistributedDataParallel around the model when a native backend runs several processes
    "ignite.distributed.auto_model": "ddp",
    "ignite.distributed.auto.auto_model": "ddp",
}
# Class names that identify a wrapper whatever module they came from (a star import, a re-export
# through a package we do not index): ``DistributedDataParallel`` is unambiguous.
# OpenMMLab's subclasses of torch's wrappers (mmcv.parallel, mmengine.model) are the same wrappers.
WRAPPER_TAILS = {"DistributedDataParallel": "ddp", "FullyShardedDataParallel": "fsdp", "fully_shard": "fsdp2",
                 "MMDistributedDataParallel": "ddp", "MMFullyShardedDataParallel": "fsdp"}
_WRAPPER_PACKAGES = ("torch.", "fairscale.", "mmcv.", "mmengine.")
# apex's DistributedDataParallel (``apex.`` packages) all-reduces in backward hooks on every backward too.
# It has no ``no_sync``: its switch is ``disable_allreduce()`` / ``enable_allreduce()``, read by those hooks
# (in the backward, as FSDP reads its own)
_APEX_PACKAGE = "apex."
# Kinds whose ``.module`` is the module inside the wrapper (DataParallel's "dp" too).
MODULE_INSIDE = frozenset(("ddp", "fsdp", "dp", "apex"))

# DDP decides at *forward* time whether the next backward all-reduces (``_pre_forward`` prepares the
# reducer only while ``require_backward_grad_sync`` is true); FSDP reads its switch during backward.
# Accelerate and Fabric wrap DDP in the multi-GPU case.
FORWARD_DECIDES = frozenset(("ddp", "accelerate", "fabric"))
# Kinds whose accumulation the user must manage: DeepSpeed's engine does it itself.
DATA_PARALLEL = frozenset(("ddp", "fsdp", "fsdp2", "accelerate", "fabric", "apex"))

ACCELERATOR = frozenset(("accelerate.Accelerator", "accelerate.accelerator.Accelerator"))
FABRIC = frozenset(("lightning.Fabric", "lightning.fabric.Fabric", "lightning.fabric.fabric.Fabric",
                    "lightning_fabric.Fabric", "lightning_fabric.fabric.Fabric", "pytorch_lightning.lite.LightningLite",
                    "lightning.pytorch.lite.LightningLite"))
ACCUMULATION_PLUGIN = "GradientAccumulationPlugin"

OPTIMIZER_TAILS = (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
    "LBFGS", "SparseAdam", "ASGD", "Adafactor", "Muon", "LAMB", "Lamb", "FusedAdam", "FusedLAMB", "FusedSGD",
    "AdamW8bit", "Adam8bit", "PagedAdamW", "Lion", "ZeroRedundancyOptimizer", "LARS", "Shampoo", "SophiaG",
    "DeepSpeedCPUAdam", "Optimizer",
)
# How optimizers are named when they come from somewhere we cannot see: optimizer, opt, optG, opt_d,
# solver, ... but not options, optional, opts.
OPTIMIZER_NAME = re.compile(r"(?i)^(?:\w*optim\w*|opt(?!ion)[A-Za-z0-9_]{0,3}|\w*_opt|solver\w*)$")
OPTIMIZER_FACTORIES = ("create_optimizer", "build_optimizer", "get_optimizer", "make_optimizer",
                       "create_optimizer_v2", "configure_optimizers", "init_optimizer", "setup_optimizer")
SCALER_TAILS = ("GradScaler", "ShardedGradScaler")
# Loss scalers that run backward and the optimizer step in one call (timm's NativeScaler and the copies
# of it in MAE, DeiT, BEiT, ConvNeXt...): ``loss_scaler(loss, optimizer, ...)``.
NATIVE_SCALER_TAILS = ("NativeScaler", "NativeScalerWithGradNormCount", "ApexScaler")
SAMPLER_TAILS = ("DistributedSampler",)
LOADER_TAILS = ("DataLoader",)
ACCUMULATOR = ("GradientAccumulator",)         # synccheck.runtime
LOCAL_SGD = ("LocalSGD", "PostLocalSGDOptimizer", "PeriodicModelAverager", "HierarchicalModelAverager")

NO_GRAD = frozenset(("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad",
                     "torch.autograd.grad_mode.no_grad", "torch.autograd.inference_mode"))

COLLECTIVES = frozenset((
    "barrier", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "all_to_all", "all_to_all_single", "gather_object", "scatter_object_list", "monitored_barrier",
    "all_reduce_coalesced", "all_gather_coalesced",
))
# ``accelerator.*`` / ``fabric.*`` methods that every process must call.
FRAMEWORK_COLLECTIVES = frozenset(("wait_for_everyone", "gather", "gather_for_metrics", "reduce", "all_reduce",
                                   "all_gather", "broadcast", "barrier", "pad_across_processes"))
# ``accelerate.utils`` functions that every process must call (``from accelerate.utils import broadcast``)
ACCELERATE_UTILS_COLLECTIVES = frozenset(("broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
                                          "pad_across_processes"))
# Collectives that synchronize gradients or parameters by hand (manual all-reduce, local SGD): an
# optimizer step after them is on synchronized gradients whatever DDP did.
GRAD_SYNC = frozenset(("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
                       "average_parameters", "allreduce_grads", "all_reduce_grads", "reduce_gradients",
                       "sync_gradients", "allreduce_gradients"))

# Methods of a module that return the module itself: the wrapper survives ``model = model.to(dev)``.
SELF_RETURNING = frozenset(("to", "cuda", "cpu", "float", "half", "bfloat16", "double", "train", "eval",
                            "requires_grad_", "to_empty", "share_memory", "type", "xpu", "mps"))
# Tensor methods that keep a loss what it is (for provenance and scaling).
TENSOR_PASSTHROUGH = frozenset(("mean", "sum", "float", "double", "half", "to", "squeeze", "clone", "contiguous",
                                "view", "reshape", "cuda", "unsqueeze", "bfloat16", "abs", "nan_to_num", "type_as",
                                # shape and linear ops between a model's output and its loss (a CLIP loss's
                                # ``img @ txt.t()``): the gradient still reaches the model, scaled as it was
                                "t", "transpose", "permute", "flatten", "matmul", "mm", "bmm", "expand", "expand_as",
                                "repeat", "narrow", "select", "index_select", "masked_fill", "gather", "roll", "neg"))
# casts, which keep what a tensor was divided by (``loss = loss.float()`` after ``loss / accum``)
TENSOR_CASTS = frozenset(("float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "clone"))
# elementwise functions of a model's output (``logits.log_softmax(-1)``, ``(out * w).pow(2)``): the gradient
# still reaches the model, but the result is a new quantity, divided by nothing (a loss made of it is fresh)
TENSOR_FUNCTIONS = frozenset(("softmax", "log_softmax", "sigmoid", "tanh", "relu", "square", "pow", "exp", "log",
                              "sqrt", "logsumexp", "clamp", "clip", "norm"))
# The words a function must contain (itself or through what it calls) to matter to the sync analysis.
# Packages whose names the vocabulary knows by their qualified names: an import from them is taken
# as what its name says (torch.distributed.barrier is a collective), never read from the disk, even
# when their sources are being linted (torch's own package) or sit beside the script.
FRAMEWORK_PACKAGES = frozenset(("torch", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric",
                                "deepspeed", "transformers", "numpy", "torchvision", "torchaudio", "apex",
                                "fairscale", "timm", "synccheck"))

EVENT_WORDS = ("backward", "step", "zero_grad", "no_sync", "accumulate", "require_backward_grad_sync",
               "set_requires_gradient_sync", "no_backward_sync", "enter_context", "all_reduce", "disable_allreduce")


def tail(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


def wrapper_kind(qualname: str) -> str:
    """The wrapper kind a call of ``qualname`` makes, or ""."""
    kind = WRAPPERS.get(qualname)
    if kind:
        return kind
    last = tail(qualname)
    if last in WRAPPER_TAILS and (qualname == last or qualname.startswith(_WRAPPER_PACKAGES)):
        return WRAPPER_TAILS[last]
    if last == "DistributedDataParallel" and qualname.startswith(_APEX_PACKAGE):
        return "apex"
    return ""


def is_optimizer_class(qualname: str) -> bool:
    last = tail(qualname)
    if "lr_scheduler" in qualname or last.endswith(("LR", "Scheduler")):
        return False
    return qualname.startswith("torch.optim.") or last.endswith(OPTIMIZER_TAILS)


def looks_like_optimizer(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return bool(OPTIMIZER_NAME.match(last)) and "sched" not in last.lower()

# a project's method that steps an optimizer it holds (``accelerator.take_optimizer_step()``,
# ``model.optim_step()``); not a scheduler's or an EMA's
# sharpness-aware minimization's two steps (davda54/sam): each reads the gradients of its own backward
SAM_STEPS = frozenset(("first_step", "second_step"))
STEPPING_METHOD = re.compile(r"(?!step$)(?!\w*(?:sched|lr_|ema|warmup))\w*optim\w*step|\w*step_optim")
