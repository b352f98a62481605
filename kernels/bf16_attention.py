"""Attention of prompt chunks (kernels/csrc/bf16_attention.cpp), over the paged cache.

What every prompt chunk runs at every layer on the `avx512bf16` class (vdpbf16ps), the `avx512` class
(the same bfloat16 pairs widened, two FMAs) and the `avx2` class (the same on 8 lanes): a fresh prompt
(nothing cached) and a chunk after cached tokens alike, reading K and V in place through the block table.
torch's bfloat16 flash SDPA takes ~2 ms a layer for a 256-token prompt of the embedded model on a
2-core Zen 4; this kernel is measured against it in bench/attention.py. ``load()`` gives the module
only where it can run (the active class has AVX2 + FMA at least and the source builds); ``name()`` is the build's
class, as the load log and benchmarks print it. ``chunk_attention`` has
kernels.amx_attention's signature and checks every chunk's rows, context and block ids first,
raising RuntimeError naming the bad entry.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import isa
from .extension import build


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``chunk_attention``), or None where it cannot run or be built."""
    if not isa.at_least("avx2"):
        return None
    module = build("infer_bf16_attention", "bf16_attention.cpp", ["-fopenmp"])
    return module if module is not None and module.available() else None


def name() -> str:
    """avx512bf16 | avx512 | avx2: the instructions this class's build multiplies with."""
    return "avx512bf16" if isa.at_least("avx512bf16") else "avx512" if isa.at_least("avx512") else "avx2"


def fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a KV cache has what the kernel takes: bfloat16, head_dim a multiple of 32."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0
