"""Helpers for the model-runner tests: a tiny random model built in memory, scheduled batches by hand."""

from __future__ import annotations

import torch

from infer.runtime.engine.scheduler import ScheduledBatch
from infer.runtime.engine.sequence import Sequence
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.model.llama import ModelConfig, Transformer

TINY = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)


def tiny_model(kernels) -> Transformer:
    """A 2-layer Llama with random weights (from torch's seed) running ``kernels``' layer ops, float32."""
    model = Transformer(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.use_fused_ops(kernels.layer_ops)
    model.kernels = kernels
    return model.eval().requires_grad_(False)


def batch(lengths: list[int], block_size: int, decode: list[bool], first_block: int = 1) -> ScheduledBatch:
    """Sequences of ``lengths`` tokens on distinct blocks; a decoding one has all but its last token in
    the cache (one token this step), the others are prefilled whole this step."""
    seqs, counts, block = [], [], first_block
    gen = torch.Generator().manual_seed(len(lengths))
    for n, dec in zip(lengths, decode):
        s = Sequence(f"r{len(seqs)}", torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist(),
                     SamplingParams(max_tokens=4, temperature=0))
        width = -(-n // block_size)
        s.block_table = list(range(block, block + width))
        block += width
        s.num_computed_tokens = n - 1 if dec else 0
        seqs.append(s)
        counts.append(1 if dec else n)
    return ScheduledBatch(seqs, counts, [])
