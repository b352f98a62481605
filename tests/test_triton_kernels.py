"""The GPU path's triton kernels (kernels/triton_ops) on the CPU, through triton's interpreter.

Each kernel is checked against its plain-torch reference, and the reference against float64, on
fresh random inputs at tiny shapes (the interpreter runs every program instance in Python). The
interpreter does not run triton's GPU compiler, so one test also compiles every kernel and GPU
autotune config for sm_90 (no GPU needed). The interpreter rounds float32 -> bfloat16 by
truncation where a GPU rounds to nearest even, so bfloat16 results are held to a couple of ulps.
"""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET before triton is imported"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402,F401  (a declared dev dependency: missing, this module fails; it never skips)

from infer.kernels import triton_ops as T  # noqa: E402
from infer.kernels.triton_ops import decode_attention, w4a16  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.initial_seed())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: one number comparable across shapes and dtypes."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def test_the_kernels_run_under_the_interpreter():
    # set too late (another module imported these kernels first), they would need a GPU and fail obscurely
    assert T.interpreting()
    assert type(decode_attention._decode_kernel).__name__ == "InterpretedFunction"


def test_interpreter_do_bench_times_the_call():
    calls = []
    median = T.do_bench(lambda: calls.append(1))
    quantiles = T.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8))
    assert median >= 0 and len(quantiles) == 3 and all(q >= 0 for q in quantiles)
    assert len(calls) == 8  # a warm-up and three timed runs, twice


# ---------------------------------------------------------------- paged decode attention

def random_paged(seqs, heads, kv_heads, d, block_size, dtype, lens=None, num_blocks=24):
    g = gen()
    k = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    if lens is None:
        lens = torch.randint(1, 5 * block_size, (seqs,), generator=g)
        lens[0] = 2 * block_size  # one context that ends exactly on a block boundary
    lens = torch.as_tensor(lens)
    width = int(-(-int(lens.max()) // block_size))
    # every sequence's table is a full random permutation prefix: shorter contexts have real
    # blocks (with real data) past their end, so reading too far would change the result
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(seqs)])
    q = (torch.randn(seqs, heads, d, generator=g) * 2).to(dtype)
    return q, k, v, tables, lens


def attention_float64(q, k, v, tables, lens):
    """torch's SDPA in float64 over each sequence's gathered context (as tests/test_kernels.py)."""
    kv_heads, d = k.shape[2], k.shape[3]
    out = []
    for i in range(q.shape[0]):
        if lens[i] == 0:  # an empty context: the kernels give zeros (SDPA would give nan)
            out.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            continue
        keys = k[tables[i]].reshape(-1, kv_heads, d)[:lens[i]].double().transpose(0, 1)[None]
        vals = v[tables[i]].reshape(-1, kv_heads, d)[:lens[i]].double().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i].double()[None, :, None, :], keys, vals, enable_gqa=True)
        out.append(o[0, :, 0, :])
    return torch.stack(out)


ATTN_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d,block_size", [(4, 2, 32, 4), (4, 4, 16, 16), (14, 2, 24, 8)],
                         ids=["gqa2-d32-bs4", "mha-d16-bs16", "gqa7-d24-bs8"])  # 7 per KV head, as Qwen2-7B
def test_decode_attention_matches_float64(dtype, heads, kv_heads, d, block_size):
    q, k, v, tables, lens = random_paged(3, heads, kv_heads, d, block_size, dtype)
    want = attention_float64(q, k, v, tables, lens)
    ref = T.paged_decode_attention_reference(q, k, v, tables, lens, d ** -0.5)
    assert rel_err(ref, want) < ATTN_TOL[dtype]
    for splits in (1, 3):
        got = T.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, splits=splits, config={"BLOCK_N": 16})
        assert got.dtype == dtype and got.shape == q.shape
        assert rel_err(got, want) < ATTN_TOL[dtype], f"splits={splits}"
        assert rel_err(got, ref) < ATTN_TOL[dtype], f"splits={splits}"


@pytest.mark.parametrize("config", [c.kwargs for c in decode_attention._INTERPRETER_CONFIGS] + [None],
                         ids=lambda c: "autotuned" if c is None else f"BLOCK_N{c['BLOCK_N']}")
def test_decode_attention_every_config_and_split_count(config):
    """Splits more than tiles, an empty context (zeros, not nan) and int32 tables, per tile config."""
    q, k, v, tables, lens = random_paged(3, 4, 2, 16, 4, torch.float32, lens=[0, 1, 37])
    want = attention_float64(q, k, v, tables, lens)
    for splits in (1, 2, 5, 16) if config else (1, 5):  # autotuning times every config again per split count
        got = T.paged_decode_attention(q, k, v, tables.to(torch.int32), lens.to(torch.int32), 16 ** -0.5,
                                       splits=splits, config=config)
        assert not got.isnan().any()
        assert (got.double() - want).abs().max().item() < 2e-6, f"splits={splits}"
    if config is None:
        assert decode_attention._decode_tuned.cache  # the autotuner timed the configs and kept one


def test_decode_attention_reads_strided_queries_of_the_fused_qkv_row():
    heads, kv_heads, d, bs = 4, 2, 16, 8
    _, k, v, tables, lens = random_paged(2, heads, kv_heads, d, bs, torch.float32)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d, generator=gen())
    q = qkv[:, :heads * d].view(2, heads, d)  # rows strided by the whole qkv width
    got = T.paged_decode_attention(q, k, v, tables, lens, 0.3, splits=2)
    assert rel_err(got, attention_float64(q * 0.3 / d ** -0.5, k, v, tables, lens)) < 2e-6


def test_decode_attention_refuses_a_bad_head_layout():
    q, k, v, tables, lens = random_paged(2, 3, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="head layout"):
        T.paged_decode_attention(q, k, v, tables, lens, 0.25)


# ---------------------------------------------------------------- W4A16 GEMM

@pytest.fixture(scope="module")
def pack_to_int32():
    """compressed-tensors' own packer: the test weights are laid out by the library that writes checkpoints."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32


def random_w4(n, k, group, asym, act_order, pack, dtype=torch.float32):
    g = gen()
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    groups = k // group
    scale = (torch.rand(n, groups, generator=g) * 0.05 + 0.005).to(dtype)
    zero = torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8) if asym else None
    g_idx = None
    if act_order:  # GPTQ's: columns quantized in a permuted order, group by position in that order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // group).to(torch.int32)
    packed = pack(q, 4)
    zero_packed = None if zero is None else pack(zero, 4, packed_dim=0)
    return (q, scale, zero, g_idx), (packed, scale, zero_packed, g_idx)


def dequant_float64(q, scale, zero, g_idx, group):
    """(q - zero) * scale from the unpacked values, written independently of the runtime's code."""
    k = q.shape[1]
    cols = g_idx.long() if g_idx is not None else torch.arange(k) // group
    w = q.double() - (zero.double()[:, cols] if zero is not None else 0)
    return w * scale.double()[:, cols]


def test_pack_int4_is_compressed_tensors_packing(pack_to_int32):
    g = gen()
    values = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    assert torch.equal(T.pack_int4(values), pack_to_int32(values, 4))
    assert torch.equal(T.pack_int4(values, dim=0), pack_to_int32(values, 4, packed_dim=0))


GEMM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (True, True)])
def test_the_gemm_reference_reads_the_layout_as_the_runtime_does(asym, act_order, pack_to_int32):
    """The Triton reference unpacks on its own (kernels import no runtime code): it must agree with
    the runtime's compressed-tensors reader on the same tensors."""
    from infer.runtime.model.compressed_tensors import Args, QuantWeight, unpack_int32

    raw, (packed, scale, zero_packed, g_idx) = random_w4(48, 128, 32, asym, act_order, pack_to_int32)
    zero = None if zero_packed is None else unpack_int32(zero_packed, 4, 48, dim=0)
    runtime = QuantWeight(Args(4, "int", "group"), None, unpack_int32(packed, 4, 128), scale, zero, g_idx)
    eye = torch.eye(128)
    assert torch.equal(T.w4a16_gemm_reference(eye, packed, scale, zero_packed, g_idx).t(),
                       runtime.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,asym,act_order", [(32, False, False), (64, True, False), (128, False, True),
                                                  (32, True, True)],
                         ids=["g32-sym", "g64-asym", "g128-actorder", "g32-asym-actorder"])
def test_w4a16_gemm_matches_float64(dtype, group, asym, act_order, pack_to_int32):
    n, k, m = 64, max(128, 2 * group), 3
    raw, tensors = random_w4(n, k, group, asym, act_order, pack_to_int32, dtype)
    x = torch.randn(m, k, generator=gen()).to(dtype)
    want = x.double() @ dequant_float64(*raw, group).t()
    ref = T.w4a16_gemm_reference(x, *tensors)
    assert rel_err(ref, want) < GEMM_TOL[dtype]
    for config in [c.kwargs for c in w4a16._INTERPRETER_CONFIGS]:
        got = T.w4a16_gemm(x, *tensors, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel_err(got, want) < GEMM_TOL[dtype], config
        assert rel_err(got, ref) < GEMM_TOL[dtype], config


@pytest.mark.parametrize("m", [1, 4])
def test_w4a16_gemm_autotuned_on_a_batch_with_leading_dims(m, pack_to_int32):
    raw, tensors = random_w4(40, 96, 32, True, False, pack_to_int32)  # N not a multiple of BLOCK_N, K of BLOCK_K
    x = torch.randn(m, 1, 96, generator=gen())
    got = T.w4a16_gemm(x, *tensors)
    assert got.shape == (m, 1, 40)
    assert rel_err(got[:, 0], x[:, 0].double() @ dequant_float64(*raw, 32).t()) < 1e-5
    assert w4a16._w4a16_tuned.cache


def test_w4a16_gemm_refuses_mismatched_tensors(pack_to_int32):
    _, (packed, scale, zero, _) = random_w4(16, 64, 32, True, False, pack_to_int32)
    with pytest.raises(ValueError, match="weight_packed"):
        T.w4a16_gemm(torch.randn(2, 72), packed, scale)
    with pytest.raises(ValueError, match="weight_zero_point"):
        T.w4a16_gemm(torch.randn(2, 64), packed, scale, zero[:1])


# ---------------------------------------------------------------- RMSNorm, rotary, SiLU-mul, KV store

ULPS = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # a couple of ulps, relative


def rms_float64(x, weight, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual_add(dtype):
    g = gen()
    hidden = 96  # not a power of two: the row is masked
    x = torch.randn(5, hidden, generator=g).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    eps = 1e-6

    ref, _ = T.rms_norm_reference(x, weight, eps)
    assert rel_err(ref, rms_float64(x, weight, eps)) < 2 * ULPS[dtype]
    got = T.rms_norm(x, weight, eps)
    assert got.dtype == dtype and rel_err(got, ref) < ULPS[dtype]

    ref_normed, ref_stream = T.rms_norm_reference(x, weight, eps, residual)
    xs, rs = x.clone(), residual.clone()
    T.fused_add_rms_norm_(xs, rs, weight, eps)
    assert rel_err(rs, x.double() + residual.double()) < ULPS[dtype]
    if dtype != torch.bfloat16:  # torch rounds the sum once, as a GPU does; the interpreter truncates bf16
        assert torch.equal(rs, ref_stream)
    assert rel_err(xs, ref_normed) < ULPS[dtype]
    assert rel_err(xs, rms_float64(ref_stream, weight, eps)) < 2 * ULPS[dtype]


def rope_tables(head_dim, positions=64, theta=10000.0):
    """The model's own tables: RotaryEmbedding.cos / .sin."""
    from infer.runtime.model.llama import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, theta, positions)
    return rope, rope.cos, rope.sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_q_and_k_heads_of_fused_rows_in_place(dtype):
    heads, kv_heads, d = 4, 2, 16
    rope, cos, sin = rope_tables(d)
    g = gen()
    wide = torch.randn(6, (heads + 2 * kv_heads) * d + 8, generator=g).to(dtype)
    qkv = wide[:, :(heads + 2 * kv_heads) * d]  # strided rows, as a view of a wider buffer
    positions = torch.randint(0, 64, (6,), generator=g)
    before, tail = qkv.clone(), wide[:, -8:].clone()
    ref = T.rotary_reference(before, positions, cos, sin, heads + kv_heads, d)
    want = T.rotary_reference(before.double(), positions, cos.double(), sin.double(), heads + kv_heads, d,
                              acc_dtype=torch.float64)
    assert rel_err(ref, want) < ULPS[dtype]
    T.rotary_(qkv, positions, cos, sin, heads + kv_heads, d)
    rotated = (heads + kv_heads) * d
    assert rel_err(qkv[:, :rotated], want[:, :rotated]) < ULPS[dtype]
    assert torch.equal(qkv[:, rotated:], before[:, rotated:])  # v untouched
    assert torch.equal(wide[:, -8:], tail)  # nor the rest of the buffer
    # the model's torch path (it rounds per op in 16-bit dtypes) agrees to within that rounding
    model_path = before.clone()
    rope.rotate_(model_path, heads + kv_heads, d, rope.tables(positions, dtype))
    assert rel_err(qkv, model_path) < 4 * ULPS[dtype]


def test_rotary_refuses_positions_outside_the_table_and_masks_them_unchecked():
    _, cos, sin = rope_tables(16, positions=8)
    x = torch.randn(3, 64, generator=gen())
    with pytest.raises(ValueError, match="outside the rotary table of 8"):
        T.rotary_(x.clone(), torch.tensor([0, 8, 1]), cos, sin, 4, 16)
    y = x.clone()
    T.rotary_(y, torch.tensor([0, 8, 1]), cos, sin, 4, 16, check=False)
    assert torch.equal(y[1], x[1])  # left alone, not read out of bounds
    assert not torch.equal(y[2], x[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = gen()
    inter = 80
    wide = (torch.randn(3, 2 * inter + 16, generator=g) * 3).to(dtype)
    gate_up = wide[:, :2 * inter]  # strided rows
    want = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    ref = T.silu_and_mul_reference(gate_up)
    assert rel_err(ref, want) < ULPS[dtype]
    got = T.silu_and_mul(gate_up, block=32)  # several column blocks per row
    assert got.shape == (3, inter) and got.dtype == dtype
    assert rel_err(got, ref) < ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_slots_and_skips_padding(dtype):
    g = gen()
    heads, kv_heads, d, blocks, bs = 4, 2, 16, 6, 4
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    _, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    k, v = k.view(5, kv_heads, d), v.view(5, kv_heads, d)  # strided slices of the fused rows
    slots = torch.randperm(blocks * bs, generator=g)[:5]
    slots[2] = -1  # padding
    want_k, want_v = T.store_kv_reference(k_cache, v_cache, slots, k, v)
    # the reference is index_copy_ of the non-padding rows
    flat = want_k.view(-1, kv_heads, d)
    assert torch.equal(flat[slots[slots >= 0]], k[slots >= 0])
    T.store_kv_(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_refuses_slots_outside_the_cache_before_writing():
    g = gen()
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    for bad in (8, -2):
        with pytest.raises(ValueError, match=f"slot {bad} outside the cache of 8"):
            T.store_kv_(k_cache, v_cache, torch.tensor([0, bad, 1]), k, v)
        assert not k_cache.any() and not v_cache.any()  # nothing written
    T.store_kv_(k_cache, v_cache, torch.tensor([0, 8, 1]), k, v, check=False)  # unchecked: masked
    assert torch.equal(k_cache.view(-1, 2, 16)[[0, 1]], k[[0, 2]])
    assert not k_cache.view(-1, 2, 16)[2:].any()


# ---------------------------------------------------------------- the GPU compiler

def test_every_kernel_and_gpu_config_compiles_for_hopper():
    """The interpreter skips triton's GPU compiler; compile each kernel and GPU autotune config for
    sm_90 (ptxas is in the triton wheel), in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-m", "infer.kernels.triton_ops.compile_check", "90"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(run.stdout)
    kernels = {r["kernel"] for r in records}
    assert kernels == {"decode_attention", "merge_splits", "w4a16_gemm", "rms_norm", "rotary", "silu_and_mul",
                       "store_kv"}
    assert len([r for r in records if r["kernel"] == "w4a16_gemm"]) >= len(w4a16._GPU_CONFIGS)
    from infer.kernels.triton_ops.compile_check import HOPPER_SHARED_BYTES

    assert max(r["shared_bytes"] for r in records) <= HOPPER_SHARED_BYTES
