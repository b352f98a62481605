"""bfloat16 linears on Intel AMX tiles (kernels/csrc/amx_linear.cpp), for the few-row matmuls of serving.

``load()`` gives the module only where it can run: a CPU with AMX, a kernel that grants this
process tile permission, and a compiler that builds the source. Elsewhere callers keep oneDNN.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .extension import build_amx

TILE_K = 32  # bfloat16 values of k per tile row
BLOCK_N = 16  # output columns per tile


@lru_cache(maxsize=1)
def load() -> object | None:
    """The compiled module (``amx_linear``), or None where AMX cannot be used."""
    return build_amx("infer_amx_linear", "amx_linear.cpp")


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight has the shape the kernel takes: N a multiple of 32, K of 32."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % (2 * BLOCK_N) == 0 and k % TILE_K == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: per 16 output columns and 32 k, one tile of (k pair, column, pair).

    Tile row r of block (nb, kb) holds, for each of the 16 columns, the two weights at
    k = kb*32 + 2r and 2r + 1: the pair layout AMX's bfloat16 dot product reads."""
    n, k = weight.shape
    blocks = weight.detach().reshape(n // BLOCK_N, BLOCK_N, k // TILE_K, TILE_K // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).reshape(n // BLOCK_N, k // TILE_K, TILE_K // 2, 2 * BLOCK_N).contiguous()
