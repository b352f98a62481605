"""The CPU paged-attention kernel (kernels/csrc/paged_attention.cpp), compiled on first use.

torch's CPU SDPA is slow for decode (a handful of queries against hundreds of keys) and needs
the context gathered out of the block pool first; this kernel reads K/V in place. Where it
cannot be built the engine falls back to gather + SDPA.

Both calls also take an int8 cache (the quantized KV cache): [blocks, kv_heads, block_size, head_dim + 2],
each row head_dim values then its bfloat16 scale's two bytes; ``store_kv_`` quantizes as it stores and
the decode kernel dequantizes in registers. ``dequantize`` is the reference the tests compare against.
``block_shape`` is where the layouts are stated, for whoever allocates a cache.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled extension module, or None (with a warning) when it cannot be built."""
    # no -ffast-math: kernels/csrc/step_layers.cpp builds this source too and must compute the same bits
    return build("infer_paged_attention", "paged_attention.cpp", ["-fopenmp"])


def block_shape(block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """One block of a cache: [block_size, kv_heads, head_dim] of the model's dtype, or int8 [kv_heads,
    block_size, head_dim + 2] (a row's values, then its bfloat16 scale). The int8 rows are head-major: a
    decode task reads one KV head, and its 66-byte rows (head_dim 64) lie back to back, 17 cache lines a
    block, where interleaved with the other heads each row would cost 2 lines (the bfloat16 cache's 128-byte
    rows cost 2 either way): the int8 cache then reads half the bytes from memory, not the same lines."""
    if dtype == torch.int8:
        return kv_heads, block_size, head_dim + 2
    return block_size, kv_heads, head_dim


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           starts: torch.Tensor | None = None, softcap: float = 0.0,
                           bf16_dots: bool = True) -> torch.Tensor:
    """q [seqs, heads, d]; caches [blocks, *block_shape(...)]; returns [seqs, heads, d].
    ``starts`` [seqs]: the first position each query sees (a sliding window's), None: position 0; blocks
    before a start's block are never read, so a sliding-window sequence may have given them back.
    ``softcap`` > 0: each scaled score becomes tanh(score / softcap) * softcap before the softmax (Gemma 2's
    attention logit soft-capping); 0: none. ``bf16_dots`` False: a bfloat16 cache's scores from its rows widened
    to float32 and FMAs, where the build would use ``vdpbf16ps`` (the tune stage's ``cpp-float`` choice).

    The kernel checks every index before reading through it (each context length in 1 .. table
    width x block size, each start below its length, each block id it reaches inside the cache) and
    raises RuntimeError naming the bad entry, so a wrong table is an error, never an out-of-bounds read."""
    return _module().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, starts,
                                            softcap=softcap, bf16_dots=bf16_dots)


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


def dequantize_rows(rows: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """int8 rows [..., head_dim + 2] as float32 [..., head_dim]: values times their row's bfloat16 scale;
    ``keys``: key rows, turned back (k = H k' / block: H is symmetric and H H = block I)."""
    scale = rows[..., -2:].contiguous().view(torch.bfloat16).float()
    values = rows[..., :-2].float() * scale
    if not keys:
        return values
    head_dim = values.shape[-1]
    return values @ hadamard(head_dim) / hadamard_block(head_dim)


def dequantize(cache: torch.Tensor, keys: bool = False) -> torch.Tensor:
    """An int8 cache [blocks, kv_heads, block_size, head_dim + 2] as the float32 cache it stands for, [blocks,
    block_size, kv_heads, head_dim] (``keys``: as dequantize_rows)."""
    return dequantize_rows(cache, keys).transpose(1, 2)


def _module():
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return module
