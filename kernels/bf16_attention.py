"""Attention of prompt chunks on AVX-512 BF16 (kernels/csrc/bf16_attention.cpp), over the paged cache.

What every prompt chunk runs at every layer on a CPU with AVX-512 BF16: a fresh prompt (nothing
cached) and a chunk after cached tokens alike, reading K and V in place through the block table.
torch's bfloat16 flash SDPA takes ~2 ms a layer for a 256-token prompt of the embedded model on a
2-core Zen 4; this kernel is measured against it in bench/attention.py. ``load()`` gives the module
only where it can run (the CPU has ``avx512_bf16`` and the source builds). ``chunk_attention`` has
kernels.amx_attention's signature and checks every chunk's rows, context and block ids first,
raising RuntimeError naming the bad entry.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .extension import build, cpu_has_avx512_bf16


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``chunk_attention``), or None where it cannot run or be built."""
    if not cpu_has_avx512_bf16():
        return None
    module = build("infer_bf16_attention", "bf16_attention.cpp", ["-fopenmp"])
    return module if module is not None and module.available() else None


def fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a KV cache has what the kernel takes: bfloat16, head_dim a multiple of 32."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0
