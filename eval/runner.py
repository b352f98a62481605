"""The runtime as evaluation uses it: an engine sized for a few windows, not a fraction of the machine."""

from __future__ import annotations


def kv_bytes_per_token(config: dict) -> int:
    layers = config["num_hidden_layers"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * kv_heads * head_dim * 4  # float32 upper bound


def open_llm(artifact, max_len: int, concurrent: int = 4):
    """An ``LLM`` over a verified Artifact (or a path, verified here) with a KV cache for ``concurrent``
    sequences of ``max_len`` tokens."""
    from infer.runtime import LLM, verify_artifact
    from infer.runtime.artifact import Artifact

    artifact = artifact if isinstance(artifact, Artifact) else verify_artifact(artifact)
    block = 16
    tokens = (max_len + 2 * block) * concurrent
    return LLM(artifact, kv_cache_memory=kv_bytes_per_token(artifact.config) * tokens + (8 << 20),
               max_num_seqs=concurrent)
