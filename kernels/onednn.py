"""oneDNN's prepacked bfloat16 linear (torch.ops.mkldnn), and whether this torch and CPU can run it.

``F.linear`` hands oneDNN a row-major weight that its matmul copies into a blocked layout on every
call; reordering the weight once at load (``pack``) and calling ``linear`` skips that copy.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@lru_cache(maxsize=None)
def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run prepacked ``dtype`` weights (bfloat16, with bf16 instructions)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(16, 32, generator=gen).to(dtype)
        x = torch.randn(3, 32, generator=gen).to(dtype)
        return torch.allclose(linear(x, pack(w), None).float(), torch.nn.functional.linear(x, w).float(), atol=1e-2)
    except (RuntimeError, AttributeError):  # a build without these mkldnn ops, a CPU without bf16
        return False
