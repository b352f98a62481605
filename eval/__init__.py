"""infer.eval."""
