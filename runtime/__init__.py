"""The corrective runtime library: a correct gradient-accumulation context and local SGD.

- :class:`GradientAccumulator`: gradient accumulation that syncs once per optimizer step on DDP, FSDP,
  FSDP2 or a plain module, and divides by the real size of every window.
- :class:`LocalSGD`: K-batch synchronous SGD; no gradient all-reduce, parameters averaged every K steps.
"""

from .accumulate import GradientAccumulator
from .local_sgd import LocalSGD

__all__ = ["GradientAccumulator", "LocalSGD"]
