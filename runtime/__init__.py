"""The corrective runtime library: a correct gradient-accumulation context and local SGD."""
