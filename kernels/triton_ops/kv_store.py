"""Writes a step's new keys and values into their paged-cache rows, both caches in one launch.

slots [T] int: block * block_size + offset of each token. A negative slot is padding (a CUDA-graph
bucket's unused rows, ``cuda_graphs.PAD_SLOT``) and writes nowhere; so does any slot past the
cache, which the wrapper refuses before launching (``check=True``; skipped while a CUDA graph is
captured, where reading the slots back would sync) -- the kernel's mask keeps memory safe either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import capturing, check_device, next_power_of_2


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     kv_heads, head_dim, capacity, ROW_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    slot = tl.load(slots_ptr + t).to(tl.int64) + tl.zeros([ROW_PAD], tl.int64)  # block-shaped, for the mask
    h = offs // head_dim
    d = offs % head_dim
    mask = (offs < kv_heads * head_dim) & (slot >= 0) & (slot < capacity)
    row = slot * (kv_heads * head_dim) + offs
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + row, k, mask=mask)
    tl.store(v_cache_ptr + row, v, mask=mask)


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              check: bool = True) -> None:
    """k, v [T, kv_heads, d] (rows may be strided: slices of the fused qkv) into caches
    [blocks, block_size, kv_heads, d] at rows ``slots``."""
    check_device(k_cache, v_cache, slots, k, v)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
        raise ValueError("store_kv_: caches must be contiguous [blocks, block_size, kv_heads, d] of one shape")
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    for t in (k, v):
        if t.dim() != 3 or t.shape[1:] != (kv_heads, d) or t.stride(2) != 1 or t.dtype != k_cache.dtype \
                or t.shape[0] != slots.numel():
            raise ValueError("store_kv_: k and v must be [T, kv_heads, d] of the cache's dtype, one row per slot")
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if check and slots.numel() and not capturing():
        bad = slots[(slots < -1) | (slots >= capacity)]
        if bad.numel():  # refused before anything is written
            raise ValueError(f"store_kv_: slot {int(bad[0])} outside the cache of {capacity} (-1 is padding)")
    _kv_store_kernel[(slots.numel(),)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0),
                                       v.stride(1), kv_heads, d, capacity, ROW_PAD=next_power_of_2(kv_heads * d))


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New caches with ``index_copy_`` of the rows whose slot is not padding (the runtime's torch path)."""
    keep = slots >= 0
    kc, vc = k_cache.clone(), v_cache.clone()
    kc.view(-1, *k_cache.shape[2:]).index_copy_(0, slots[keep].long(), k[keep])
    vc.view(-1, *v_cache.shape[2:]).index_copy_(0, slots[keep].long(), v[keep])
    return kc, vc
