"""int4 grouped weights through torch's own int4 kernel ("tinygemm": ``_weight_int4pack_mm`` on CUDA,
``_weight_int4pack_mm_for_cpu`` on the CPU; the kernel gpt-fast serves int4 with), packed once.

tinygemm computes w = (u - 8) * scale + zero for the unsigned nibble u and a float ``zero`` per (row,
group). For the signed values q in [-8, 7] and signed zero points z of (q - z) * scale, u = q + 8 and
zero = -z * scale (0 when symmetric). Groups must be contiguous runs of columns: activation order is
served by sorting the columns by group first (``group_order``) and x's columns the same way per call.

On CUDA the weight goes to torch's tiled layout as uint8 pairs, the even column in the high nibble (on
an H200 the other order gave a relative error of 1.07, this one 0.004: bench/device_check.py); on the
CPU torch takes the int32 values. On an H200, at Qwen2.5-7B's shapes, 1 row: 2.3-2.5x the triton W4A16
GEMM and 1.3-1.8x dense bfloat16; 4 rows: 1.5-2.0x the triton GEMM; 16 rows: 0.66-0.89x of it.
"""

from __future__ import annotations

import torch

GROUP_SIZES = (32, 64, 128, 256)


def inner_k_tiles(k: int) -> int | None:
    """The widest K tiling (8, 4 or 2 tiles of 16 columns) that divides ``k``; None if none does."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def supported(n: int, k: int, group_size: int) -> bool:
    """Whether tinygemm takes an [n, k] weight in groups of ``group_size`` on CUDA (whole 8-row tiles)."""
    return group_size in GROUP_SIZES and k % group_size == 0 and inner_k_tiles(k) is not None and n % 8 == 0


def group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The column order that makes activation-order groups contiguous runs of ``group_size`` columns
    (sorted by group, stable), or None when no order does (groups of other sizes)."""
    perm = torch.argsort(g_idx.long(), stable=True)
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    return perm if torch.equal(g_idx.long()[perm], want) else None


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16,
         tiles: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int4 values q [N, K], scales [N, groups] and signed zero points [N, groups] (or None), groups
    contiguous -> (packed weight, scales_and_zeros [groups, N, 2] in ``dtype``), on q's device."""
    u = q.to(torch.int32) + 8
    tiles = tiles or inner_k_tiles(q.shape[1])
    if u.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8).contiguous(),
                                                            tiles)
    scale = scale.float()
    zeros = torch.zeros_like(scale) if zero is None else -zero.float() * scale
    scales_and_zeros = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().to(dtype)
    return packed, scales_and_zeros


def matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in scales_and_zeros' dtype (bfloat16 on CUDA; the CPU also takes float32)."""
    x = x.to(scales_and_zeros.dtype).contiguous()
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
