"""Attention of prompt chunks after cached tokens on Intel AMX tiles (kernels/csrc/amx_attention.cpp).

What a request whose system prompt is cached runs at every layer: its ~30 new tokens against the
~430 of its context, read in place from the paged cache. ``load()`` gives the module only where it
can run (a CPU with AMX, tile permission, a compiler); elsewhere the engine keeps gather + SDPA.
``chunk_attention`` checks every chunk's rows, context length and block ids (and the tensors' shapes
and dtypes) before any tile instruction runs, raising RuntimeError naming the bad entry.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .extension import build_amx


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``chunk_attention``), or None where AMX cannot be used."""
    return build_amx("infer_amx_attention", "amx_attention.cpp")


def fits(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether a KV cache has the shape the kernel takes: bfloat16, head_dim a multiple of 32, blocks of 16."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and block_size == 16
