"""RMSNorm over rows, and the pre-norm block's fused step: residual += x; x = RMSNorm(residual).

Fusing the add saves a full read and write of the hidden state per norm, which at decode is a
memory-bound op of its own. The arithmetic follows runtime/model's RMSNorm: the sum is taken in
the model's dtype (x + residual rounded), the norm in float32, the result rounded to the dtype
and then scaled by the weight (rounded again), so the kernel rounds where torch rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import check_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_ptr.dtype.element_ty)  # the stream in the model's dtype
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, out, eps):
    check_device(x, residual, weight)
    if x.dim() != 2 or x.stride(1) != 1 or weight.numel() != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError("rms_norm expects x [T, H] with contiguous rows and weight [H] of x's dtype")
    if x.shape[0] == 0:
        return
    block = next_power_of_2(x.shape[1])
    r = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), x.shape[1], eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [T, H]; a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual becomes x + residual, x becomes RMSNorm(x + residual)."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError("x and residual must share shape and dtype, with contiguous rows")
    _launch(x, residual, weight, x, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """runtime/model's RMSNorm.forward in plain torch: (normed, new residual stream)."""
    stream = x if residual is None else x + residual
    xf = stream.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), stream
