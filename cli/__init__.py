"""synccheck: find and fix gradient-synchronization misuse in PyTorch data-parallel training."""

__version__ = "0.1.0"
