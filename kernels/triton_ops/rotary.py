"""Rotary embedding in place, neox style (rotate half), on the q and k heads of fused qkv rows.

The contract of runtime/model's ``RotaryEmbedding.rotate_`` with the kernel's tables: x [T, >= heads
* head_dim] (a fused qkv row: q heads then k heads, v left alone), positions [T] int, cos/sin
float32 [max_positions, head_dim] (``RotaryEmbedding.cos`` / ``.sin``). Computed in float32,
rounded once. A position outside the table leaves its row untouched (the wrapper refuses such
positions first, unless ``check=False`` or a CUDA graph is being captured: the check reads the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import capturing, check_device, next_power_of_2


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_x, stride_table, heads, half, max_positions,
                   HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    pos_i = pos + tl.zeros([HALF_PAD], tl.int64)  # block-shaped: the interpreter masks with blocks only
    i_mask = (i < half) & (pos_i >= 0) & (pos_i < max_positions)
    mask = (h[:, None] < heads) & i_mask[None, :]
    table = pos_i * stride_table + i
    c1 = tl.load(cos_ptr + table, mask=i_mask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + table + half, mask=i_mask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + table, mask=i_mask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + table + half, mask=i_mask, other=0.0)[None, :]
    first = x_ptr + row * stride_x + h[:, None] * (2 * half) + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    tl.store(first, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
            head_dim: int, check: bool = True) -> None:
    """Rotates the first ``heads`` heads of each row of x in place."""
    check_device(x, positions, cos, sin)
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < heads * head_dim or head_dim % 2:
        raise ValueError("rotary_ expects x [T, >= heads * head_dim] with contiguous rows and an even head_dim")
    if cos.dtype != torch.float32 or sin.shape != cos.shape or cos.shape[1] != head_dim or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError("cos and sin must be contiguous float32 [positions, head_dim] tables")
    if positions.numel() != x.shape[0]:
        raise ValueError("one position per row")
    if check and positions.numel() and not capturing() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"position outside the rotary table of {cos.shape[0]}")
    half = head_dim // 2
    _rotary_kernel[(x.shape[0],)](x, positions, cos, sin, x.stride(0), cos.stride(0), heads, half, cos.shape[0],
                                  HEADS_PAD=next_power_of_2(heads), HALF_PAD=next_power_of_2(half))


def rotary_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     head_dim: int, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A rotated copy of x: ``RotaryEmbedding.rotate_``'s formula in ``acc_dtype``, rounded once."""
    out = x.clone()
    xh = x[:, :heads * head_dim].to(acc_dtype).view(-1, heads, head_dim)
    c = cos.index_select(0, positions.long()).to(acc_dtype)[:, None, :]
    s = sin.index_select(0, positions.long()).to(acc_dtype)[:, None, :]
    half = head_dim // 2
    rotated = torch.cat((-xh[..., half:], xh[..., :half]), dim=-1)
    out[:, :heads * head_dim] = (xh * c + rotated * s).reshape(-1, heads * head_dim).to(x.dtype)
    return out
