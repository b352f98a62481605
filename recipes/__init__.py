"""infer.recipes."""
