"""infer.bench: benchmarks that print and save JSON, each against a baseline measured in the same run."""
