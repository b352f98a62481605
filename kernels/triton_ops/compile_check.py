"""Compiles every kernel, with every GPU autotune config, for an NVIDIA target without a GPU.

The interpreter runs the kernels' arithmetic on the CPU but not triton's GPU compiler, which is
stricter (dot shapes, layouts, constexpr rules, shared memory). ``triton.compile`` with a
``GPUTarget`` runs the whole pipeline down to a cubin with the ptxas bundled in the wheel, no
driver needed, so this catches what would only fail on the device. Run it in a process without
``TRITON_INTERPRET`` (the tests start one): ``python -m infer.kernels.triton_ops.compile_check``.
"""

from __future__ import annotations

import json
import os
import sys
import time

# shared memory one block may use on sm_90 (H100/H200): 227 KiB
HOPPER_SHARED_BYTES = 232448


def _jobs():
    from . import decode_attention, kv_store, rmsnorm, rotary, silu_mul, w4a16

    bf16, i32, i64 = "*bf16", "i32", "*i64"
    attn = decode_attention._decode_kernel
    attn_sig = {n: i32 for n in attn.arg_names}
    attn_sig.update(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, out_ptr=bf16, tables_ptr=i64, lens_ptr=i64, part_ptr="*fp32",
                    lse_ptr="*fp32", scale="fp32")
    for i, c in enumerate(decode_attention._GPU_CONFIGS):  # every config split; the direct store once
        for splits in (4, 1) if i == 0 else (4,):
            yield ("decode_attention", attn, attn_sig,
                   dict(BLOCK_SIZE=16, GROUP_PAD=16, D_PAD=128, SPLITS=splits, FP32_DOT=False, **c.kwargs), c)
    merge = decode_attention._merge_splits_kernel
    merge_sig = {n: i32 for n in merge.arg_names}
    merge_sig.update(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=bf16)
    yield "merge_splits", merge, merge_sig, dict(SPLITS=4, SPLITS_PAD=4, D_PAD=128), None

    gemm = w4a16._w4a16_kernel
    gemm_sig = {n: i32 for n in gemm.arg_names}
    gemm_sig.update(x_ptr=bf16, w_ptr="*i32", scale_ptr=bf16, zero_ptr="*i32", g_idx_ptr="*i32", y_ptr="*fp32")
    for i, c in enumerate(w4a16._GPU_CONFIGS):  # every config symmetric; the other paths on two configs
        for group, zero, act in ((128, False, False), (128, True, True), (32, True, False))[:3 if i < 2 else 1]:
            yield ("w4a16_gemm", gemm, gemm_sig,
                   dict(GROUP_SIZE=group, HAS_ZERO=zero, ACT_ORDER=act, FP32_DOT=False,
                        ONE_GROUP_PER_TILE=w4a16.one_group_per_tile(group, c.kwargs["BLOCK_K"], act), **c.kwargs), c)

    norm = rmsnorm._rms_norm_kernel
    norm_sig = {n: i32 for n in norm.arg_names}
    norm_sig.update(x_ptr=bf16, residual_ptr=bf16, weight_ptr=bf16, out_ptr=bf16, eps="fp32")
    for residual in (False, True):
        yield "rms_norm", norm, norm_sig, dict(HAS_RESIDUAL=residual, BLOCK=4096), None
    rot = rotary._rotary_kernel
    rot_sig = {n: i32 for n in rot.arg_names}
    rot_sig.update(x_ptr=bf16, pos_ptr=i64, cos_ptr="*fp32", sin_ptr="*fp32")
    yield "rotary", rot, rot_sig, dict(HEADS_PAD=32, HALF_PAD=64), None
    silu = silu_mul._silu_mul_kernel
    silu_sig = {n: i32 for n in silu.arg_names}
    silu_sig.update(x_ptr=bf16, out_ptr=bf16)
    yield "silu_and_mul", silu, silu_sig, dict(BLOCK=1024), None
    kv = kv_store._kv_store_kernel
    kv_sig = {n: i32 for n in kv.arg_names}
    kv_sig.update(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, slots_ptr=i64)
    yield "store_kv", kv, kv_sig, dict(ROW_PAD=512), None


def compile_all(arch: int = 90) -> list[dict]:
    """One record per (kernel, config): name, constexprs, shared memory bytes, seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs a process without TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)
    records = []
    for name, fn, sig, constexprs, config in _jobs():
        sig = dict(sig, **{k: "constexpr" for k in constexprs})
        options = {} if config is None else dict(num_warps=config.num_warps, num_stages=config.num_stages)
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, sig, constexprs), target=target, options=options)
        records.append({"kernel": name, "constexprs": {k: v for k, v in constexprs.items()},
                        "options": options, "shared_bytes": compiled.metadata.shared,
                        "seconds": round(time.perf_counter() - start, 2)})
    return records


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default; set, so it does not warn
    result = compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
    json.dump(result, sys.stdout)
