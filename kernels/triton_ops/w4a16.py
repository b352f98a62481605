"""W4A16 GEMM straight from compressed-tensors' ``pack-quantized`` layout: y = x @ dequant(W)^T.

The checkpoint tensors are used as stored, nothing repacked at load:
- ``weight_packed`` int32 [N, K/8]: 8 values a word, little end first, each stored as q + 8 for the
  signed value q in [-8, 7];
- ``weight_scale`` [N, K/group] float;
- ``weight_zero_point`` (asymmetric) int32 [N/8, K/group]: int4 zero points packed the same way but
  along the output dimension;
- ``weight_g_idx`` [K] (activation order): the group of each input column.
dequant(W)[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = g_idx[k] or k // group_size.

Decode multiplies a few rows by a large weight, so the kernel is a weight stream: each program
loads each int32 word of its [BLOCK_K, BLOCK_N] tile once and unpacks it for all (<= BLOCK_M)
rows. SPLIT_K > 1 cuts K across programs (float32 atomic adds into a zeroed buffer) so that
batch 1 still fills the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import FP32_DOT, check_device, configs, do_bench, dot, next_power_of_2


def _cfg(bm, bn, bk, split_k, warps=4, stages=3):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k}, num_warps=warps,
                         num_stages=stages)


_GPU_CONFIGS = [_cfg(16, 64, 128, 1), _cfg(16, 64, 128, 4), _cfg(16, 128, 128, 2, 8), _cfg(16, 32, 128, 4),
                _cfg(16, 64, 64, 2), _cfg(16, 128, 64, 1), _cfg(16, 32, 64, 8, 2), _cfg(64, 128, 64, 1, 8)]
# one config with split-K and a tile wider than group 32 (per-column scales); one plain
_INTERPRETER_CONFIGS = [_cfg(16, 32, 32, 1), _cfg(16, 16, 64, 2)]


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, g_idx_ptr, y_ptr, M, N, K, num_groups, M_BUCKET,
                  stride_xm, stride_wn, stride_sn, stride_ym,
                  GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, ACT_ORDER: tl.constexpr,
                  ONE_GROUP_PER_TILE: tl.constexpr, FP32_DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    n64 = offs_n.to(tl.int64)
    if HAS_ZERO:
        zero_row = zero_ptr + (offs_n // 8).to(tl.int64) * num_groups  # [BLOCK_N] packed zero rows
        zero_shift = (offs_n % 8) * 4

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        tile_mask = k_mask[:, None] & n_mask[None, :]
        # one load per word, then its 8 nibbles spread over 8 rows: row k = 8 * word + j
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + n64[None, :] * stride_wn + offs_w[:, None],
                        mask=(offs_w * 8 < k_end)[:, None] & n_mask[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N]
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))  # q + 8
        if ONE_GROUP_PER_TILE:
            g = k0 // GROUP_SIZE
            scale = tl.load(scale_ptr + n64 * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZERO:
                zero = ((tl.load(zero_row + g, mask=n_mask, other=0) >> zero_shift) & 0xF)[None, :]
        else:
            if ACT_ORDER:
                g = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // GROUP_SIZE
            scale = tl.load(scale_ptr + n64[None, :] * stride_sn + g[:, None], mask=tile_mask, other=0.0)
            scale = scale.to(tl.float32)
            if HAS_ZERO:
                zero = (tl.load(zero_row[None, :] + g[:, None], mask=tile_mask, other=0) >> zero_shift[None, :]) & 0xF
        if HAS_ZERO:
            w = (q - zero).to(tl.float32) * scale  # (q + 8) - (zero + 8)
        else:
            w = (q - 8).to(tl.float32) * scale
        acc += dot(x, w.to(x_ptr.dtype.element_ty), FP32_DOT)

    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y, acc, mask=mask)
    else:
        tl.atomic_add(y, acc, mask=mask)


def one_group_per_tile(group_size: int, block_k: int, act_order: bool) -> bool:
    """Whether every K tile lies inside one group (aligned tiles no wider than a group): then a
    tile needs one row of scales, not one per column."""
    return not act_order and group_size % block_k == 0


_w4a16_tuned = triton.autotune(configs=configs(_GPU_CONFIGS, _INTERPRETER_CONFIGS),
                               key=["M_BUCKET", "N", "K", "GROUP_SIZE", "HAS_ZERO", "ACT_ORDER"],
                               reset_to_zero=["y_ptr"], do_bench=do_bench)(triton.heuristics(
    {"ONE_GROUP_PER_TILE": lambda a: one_group_per_tile(a["GROUP_SIZE"], a["BLOCK_K"], a["ACT_ORDER"])})(_w4a16_kernel))


def w4a16_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_zero_point: torch.Tensor | None = None, weight_g_idx: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """x [..., K] (fp32/bf16/fp16) -> [..., N] in x's dtype. ``config`` forces one tile config
    (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) instead of the autotuned one."""
    check_device(x, weight_packed, weight_scale, weight_zero_point, weight_g_idx)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight_packed.shape[0]
    if weight_packed.dtype != torch.int32 or weight_packed.shape[1] * 8 != k:
        raise ValueError(f"weight_packed must be int32 [N, K/8] = [{n}, {k // 8}], got {tuple(weight_packed.shape)}")
    num_groups = weight_scale.shape[1]
    if weight_scale.shape[0] != n or k % num_groups:
        raise ValueError(f"weight_scale must be [N, K/group], got {tuple(weight_scale.shape)} for N={n}, K={k}")
    group_size = k // num_groups
    if weight_zero_point is not None and (weight_zero_point.dtype != torch.int32 or
                                          tuple(weight_zero_point.shape) != (n // 8, num_groups) or n % 8):
        raise ValueError(f"weight_zero_point must be int32 [N/8, K/group] = [{n // 8}, {num_groups}]")
    if weight_g_idx is not None and weight_g_idx.numel() != k:
        raise ValueError(f"weight_g_idx must be [K] = [{k}]")
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    zero = weight_zero_point.contiguous() if weight_zero_point is not None else weight_packed
    g_idx = weight_g_idx.to(torch.int32).contiguous() if weight_g_idx is not None else weight_packed
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)  # zeroed: split-K adds into it
    args = (x2, weight_packed, weight_scale, zero, g_idx, y, m, n, k, num_groups, max(16, next_power_of_2(m)),
            x2.stride(0), weight_packed.stride(0), weight_scale.stride(0), y.stride(0))
    meta = dict(GROUP_SIZE=group_size, HAS_ZERO=weight_zero_point is not None, ACT_ORDER=weight_g_idx is not None,
                FP32_DOT=FP32_DOT)

    def grid(c):
        return triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"]

    if config is None:
        _w4a16_tuned[grid](*args, **meta)
    else:
        one_group = one_group_per_tile(group_size, config["BLOCK_K"], meta["ACT_ORDER"])
        _w4a16_kernel[grid(config)](*args, **meta, **config, ONE_GROUP_PER_TILE=one_group)
    return y.to(x.dtype).view(*shape[:-1], n)


def unpack_int4(packed: torch.Tensor, count: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> signed int4 values along ``dim`` (``pack_int4`` undone; compressed-tensors'
    layout: 8 values a word, little end first, each stored as q + 8)."""
    if dim == 0:
        return unpack_int4(packed.t(), count, 1).t().contiguous()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :count] - 8).to(torch.int8)


def w4a16_gemm_reference(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                         weight_zero_point: torch.Tensor | None = None, weight_g_idx: torch.Tensor | None = None,
                         acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain torch: dequantize ((q - zero) * scale, group by ``g_idx`` or by position), round the weight
    to x's dtype as the kernel multiplies it, one matmul in ``acc_dtype``. (The tests also check this
    against the runtime's own reader, runtime/model/compressed_tensors.py.)"""
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    q = unpack_int4(weight_packed, k).float()
    groups = weight_scale.shape[1]
    col_group = weight_g_idx.long() if weight_g_idx is not None else \
        torch.arange(k, device=q.device) // (k // groups)
    if weight_zero_point is not None:
        q = q - unpack_int4(weight_zero_point, n, dim=0).float()[:, col_group]
    w = (q * weight_scale.float()[:, col_group]).to(x.dtype).to(acc_dtype)
    return (x.to(acc_dtype) @ w.t()).to(x.dtype)


def pack_int4(values: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Signed int4 values [-8, 7] -> int32 words along ``dim`` (compressed-tensors' ``pack_to_int32``
    for 4 bits): for making weights on a device where compressed-tensors is not installed."""
    if dim == 0:
        return pack_int4(values.t(), 1).t().contiguous()
    rows, cols = values.shape
    if cols % 8:
        raise ValueError("pack_int4 needs a multiple of 8 values along the packed dimension")
    nibbles = (values.to(torch.int64) + 8).reshape(rows, cols // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(-1)  # disjoint bit fields: the sum is the word, as an unsigned int
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
