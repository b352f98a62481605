"""The engine: requests in, scheduled forward passes, tokens and text out (nano-vllm's split)."""
