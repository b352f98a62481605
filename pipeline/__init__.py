"""infer.pipeline."""
