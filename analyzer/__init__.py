"""Static analysis of training scripts (`synccheck lint`). Never imports torch or the code it checks."""
