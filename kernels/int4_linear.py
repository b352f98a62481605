"""int4 weight-only linears (W4A16) in 32-column blocks (kernels/csrc/int4_linear.cpp), on every CPU class
from AVX2 up.

A batch-1 decode step of a W4A16 model reads a quarter of the bytes of its bfloat16 linears; this
kernel turns the nibbles into ``vdpbf16ps`` operands with one shift and one logic op (AVX-512 BF16), or
into float32 FMA operands with a few more (AVX-512F, AVX2), so the step can go at the speed of those
bytes. ``load()`` gives the module only where it can run (the active class, kernels/isa.py, is at
least ``avx2`` and the source builds); elsewhere runtime/model/quant_linear.py keeps torch's
``_weight_int4pack_mm_for_cpu``. ``pack`` lays a weight out once, at load.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import isa
from .extension import build

BLOCK_N = 32  # output columns per weight block (csrc/int4_linear.cpp)
OFFSET = 136  # the kernel's 128 + u encoding, plus the 8 that makes q = u - 8


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``int4_linear``), or None where it cannot run or be built."""
    if not isa.at_least("avx2"):
        return None
    module = build("infer_int4_linear", "int4_linear.cpp", ["-fopenmp"])
    return module if module is not None and module.available() else None


def fits(n: int, k: int, groups: int) -> bool:
    """Whether an [N, K] int4 weight with ``groups`` scales per row has what the kernel takes."""
    return n > 0 and groups > 0 and k % (8 * groups) == 0


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
    """q [N, K] int8 in [-8, 7], scale [N, G], zero [N, G] or None (w = (q - zero) * scale) ->
    (packed [N/32, K/8, 32] int32, scales [N/32, G, 32] float32, offsets of the same shape or None).

    Columns pad to whole blocks with q = 0 and scale 0. Word (kw, c) holds u = q + 8 for
    k = 8 kw + 2j at bits 4j and for k = 8 kw + 2j + 1 at bits 16 + 4j (j = 0..3); a block stores each pair of
    groups' words alternating (csrc/int4_linear.cpp, stored_words)."""
    n, k = q.shape
    groups = scale.shape[1]
    if not fits(n, k, groups):
        raise ValueError(f"int4_linear: a [{n}, {k}] weight with {groups} groups a row does not fit the kernel "
                         f"(K must be a multiple of 8 x groups)")
    u = (q.to(torch.int32) + 8).view(n, k // 8, 8)
    words = torch.zeros(n, k // 8, dtype=torch.int32)
    for i in range(8):  # compressed-tensors' order first (value i of a word at bits 4i), then this kernel's
        words |= u[:, :, i] << (4 * i)  # disjoint bits; bit 31 wraps to the sign
    return pack_words(words, k, scale, zero)


def pack_words(words: torch.Tensor, k: int, scale: torch.Tensor, zero: torch.Tensor | None):
    """``pack`` from compressed-tensors' stored 4-bit words ([N, K/8] int32: u = q + 8 at bits 4i for k = 8 kw + i),
    with no int8 values in between: each word's nibbles moved to this kernel's places (k = 8 kw + 2j at bits
    4j, k = 8 kw + 2j + 1 at bits 16 + 4j). A 7B layer's int4 linears repack in a fraction of a second this way."""
    n, groups = words.shape[0], scale.shape[1]
    if words.dtype != torch.int32 or words.shape[1] * 8 != k or not fits(n, k, groups):
        raise ValueError(f"int4_linear: [{n}, {k}] words with {groups} groups a row do not fit the kernel "
                         f"(int32 words of 8 values, K a multiple of 8 x groups)")
    module = load()
    if module is None:
        raise RuntimeError("int4_linear: the kernel is not built for this CPU class (AVX2 + FMA at least)")
    packed = module.repack_words(words.contiguous(), groups)  # kernels/csrc/int4_linear.cpp: one pass over the words
    return (packed, *_scales_by_block(scale, zero, packed.shape[0]))


def _scales_by_block(scale: torch.Tensor, zero: torch.Tensor | None, blocks: int):
    """scales [N, G] (and zero points) -> [N/32, G, 32] float32, padded columns 0 (offsets: 136 + z)."""
    n, groups = scale.shape

    def per_block(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(blocks * BLOCK_N, groups, dtype=torch.float32)
        padded[:n] = t.float()
        return padded.view(blocks, BLOCK_N, groups).transpose(1, 2).contiguous()

    return per_block(scale), None if zero is None else per_block(zero.float() + OFFSET)
