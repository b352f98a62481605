"""bfloat16 linears in column blocks (kernels/csrc/bf16_linear.cpp), for every CPU class without AMX in
use: the layout a decode step streams at close to memory speed. On AVX-512 BF16 the kernel multiplies
with vdpbf16ps; on AVX-512F or AVX2 + FMA it widens the bfloat16 weights to float32 in registers.

``load()`` gives the module only where it can run (the active class, kernels/isa.py, is at least
``avx2``, and the source builds); elsewhere callers keep oneDNN. Measured on the embedded model's 120 decoder linears plus
its LM head, each weight distinct (a decode step's streaming, past any cache), 2 threads on an
AMD EPYC (Zen 4) without AMX: 1 row 10 ms vs oneDNN's packed layout 20 ms, 4 rows 10 vs 19 ms,
16 rows 17 vs 26, 64 rows 51 vs 61, 256 rows 187 vs 202.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import isa
from .extension import build

WIDE, NARROW = 64, 32  # output columns per weight block (csrc/bf16_linear.cpp)
NARROW_UP_TO = 1024  # weights of at most this many output columns get narrow blocks


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``bf16_linear``), or None where it cannot run or be built."""
    if not isa.at_least("avx2"):
        return None
    module = build("infer_bf16_linear", "bf16_linear.cpp", ["-fopenmp"])
    return module if module is not None and module.available() else None


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight has what the kernel takes: bfloat16, K even (k pairs)."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0


def block_width(n: int) -> int:
    """Columns per block for an N-column weight: 32 for a narrow one, so that a decode step's few
    blocks split evenly over the threads (576 columns in 64s: 9 blocks, one thread gets 5), else 64,
    which reuses each broadcast of x over more columns."""
    return NARROW if n <= NARROW_UP_TO else WIDE


def padded_rows(n: int) -> int:
    """Output columns of an N-column weight once packed: N rounded up to whole blocks."""
    width = block_width(n)
    return -(-n // width) * width


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] -> [ceil(N/W), K/2, W, 2], W = block_width(N): per block of W output columns, each k pair
    of every column side by side (zero columns pad N to a whole block), so a block reads as one
    sequential stream. ``out``: memory of that many elements of weight's dtype to write it into (one pass
    over the weight: a 7B model's 152,064-row LM head in about a second)."""
    n, k = weight.shape
    width = block_width(n)
    blocks = padded_rows(n) // width
    shape = (blocks, k // 2, width, 2)
    out = torch.empty(shape, dtype=weight.dtype) if out is None else out[:blocks * k * width].view(shape)
    src, whole = weight.detach(), n // width
    out[:whole].copy_(src[:whole * width].view(whole, width, k // 2, 2).permute(0, 2, 1, 3))
    if whole < blocks:  # the last block's columns past N are zero
        last = torch.zeros(width, k, dtype=weight.dtype)
        last[:n - whole * width] = src[whole * width:]
        out[whole].copy_(last.view(width, k // 2, 2).permute(1, 0, 2))
    return out
