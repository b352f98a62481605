"""SiLU-and-multiply on the fused gate/up projection: [T, 2I] -> silu(gate) * up [T, I].

One pass instead of split + silu + mul (three reads of the largest activation of the layer).
Computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import check_device


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [T, 2I] (rows may be strided) -> [T, I] in x's dtype."""
    check_device(x)
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError("silu_and_mul expects [T, 2 * intermediate] with contiguous rows (gate, then up)")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32, rounded to x's dtype once (as the kernel does)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
