"""The CPU paged-attention kernel (kernels/csrc/paged_attention.cpp), compiled on first use.

torch's CPU SDPA is slow for decode (a handful of queries against hundreds of keys) and needs
the context gathered out of the block pool first; this kernel reads K/V in place. Where it
cannot be built the engine falls back to gather + SDPA.

Both calls also take an int8 cache (the quantized KV cache): [blocks, block_size, kv_heads, head_dim + 2],
each row head_dim values then its bfloat16 scale's two bytes; ``store_kv_`` quantizes as it stores and
the decode kernel dequantizes in registers. ``dequantize`` is the reference the tests compare against.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled extension module, or None (with a warning) when it cannot be built."""
    return build("infer_paged_attention", "paged_attention.cpp", ["-fopenmp", "-ffast-math"])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           starts: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q [seqs, heads, d]; caches [blocks, block_size, kv_heads, d] (or int8, d + 2); returns [seqs, heads, d].
    ``starts`` [seqs]: the first position each query sees (a sliding window's), None: position 0; blocks
    before a start's block are never read, so a sliding-window sequence may have given them back.
    ``softcap`` > 0: each scaled score becomes tanh(score / softcap) * softcap before the softmax (Gemma 2's
    attention logit soft-capping); 0: none.

    The kernel checks every index before reading through it (each context length in 1 .. table
    width x block size, each start below its length, each block id it reaches inside the cache) and
    raises RuntimeError naming the bad entry, so a wrong table is an error, never an out-of-bounds read."""
    return _module().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, starts,
                                            softcap=softcap)


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """Writes k, v [T, kv_heads, d] into the caches' rows ``slots`` (block * block_size + offset);
    every slot is checked against the cache's size before anything is written (RuntimeError)."""
    _module().store_kv_(k_cache, v_cache, slots, k, v)


def hadamard_block(head_dim: int) -> int:
    """The size of the blocks an int8 cache's keys are turned in: the largest power of two dividing head_dim
    (paged_attention.cpp's hadamard_block)."""
    return head_dim & -head_dim


def hadamard(head_dim: int) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard matrix [head_dim, head_dim] that turns an int8 cache's keys:
    hadamard_block-sized blocks on the diagonal."""
    n = hadamard_block(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h] * (head_dim // n))


def dequantize(cache: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """An int8 cache [..., head_dim + 2] as float32 [..., head_dim]: values times their row's bfloat16 scale;
    ``keys``: a key cache, its rows turned back (k = H k' / block: H is symmetric and H H = block I)."""
    scale = cache[..., -2:].contiguous().view(torch.bfloat16).float()
    rows = cache[..., :-2].float() * scale
    if not keys:
        return rows
    head_dim = rows.shape[-1]
    return rows @ hadamard(head_dim) / hadamard_block(head_dim)


def _module():
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return module
