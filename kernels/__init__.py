"""infer.kernels."""
