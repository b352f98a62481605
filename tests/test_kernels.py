"""The CPU paged-attention kernel and the gather + SDPA path against a float64 reference."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu_attention
from infer.runtime.engine.attention import PagedAttention, PrefillChunk


def random_paged(seqs: int, heads: int, kv_heads: int, head_dim: int, dtype, block_size: int = 16):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    num_blocks = 64
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.randint(1, 7 * block_size, (seqs,), generator=gen)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(seqs)])
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, lens


def reference(q, k, v, tables, lens):
    out = []
    kv_heads, d = k.shape[2], k.shape[3]
    for i in range(q.shape[0]):
        keys = k[tables[i]].reshape(-1, kv_heads, d)[:lens[i]].double().transpose(0, 1)[None]
        vals = v[tables[i]].reshape(-1, kv_heads, d)[:lens[i]].double().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i].double()[None, :, None, :], keys, vals, enable_gqa=True)
        out.append(o[0, :, 0, :])
    return torch.stack(out)


def test_kernel_builds_here():
    # the machines this runs on have a C++ compiler: a missing kernel is a failure, not a skip
    assert cpu_attention.load() is not None


@contextlib.contextmanager
def decode_path(path: str):
    """A bfloat16 cache's decode path: "avx512bf16" where the CPU has it, or "float" (what a CPU without it runs,
    and what the tuning's ``cpp-float`` chooses), passed as the kernel's bf16_dots to every call inside, so that
    both are checked on this host."""
    if path == "avx512bf16" and not cpu_attention.load().has_bf16_dots():
        pytest.skip("this CPU has no AVX-512 BF16: only the float path exists here (the 'float' case ran)")
    original = cpu_attention.paged_decode_attention
    cpu_attention.paged_decode_attention = functools.partial(original, bf16_dots=path == "avx512bf16")
    try:
        yield
    finally:
        cpu_attention.paged_decode_attention = original


@pytest.fixture(params=["avx512bf16", "float"])
def bf16_decode_path(request):
    with decode_path(request.param):
        yield request.param


@pytest.mark.parametrize("dtype,tol,path", [(torch.float32, 1e-5, "float"), (torch.bfloat16, 2e-2, "avx512bf16"),
                                            (torch.bfloat16, 2e-2, "float"), (torch.float16, 5e-3, "float")])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 40), (16, 2, 128)])
def test_kernel_matches_float64(dtype, tol, path, heads, kv_heads, head_dim):
    q, k, v, tables, lens = random_paged(7, heads, kv_heads, head_dim, dtype)
    with decode_path(path):
        got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
    assert got.dtype == dtype
    assert (got.double() - reference(q, k, v, tables, lens)).abs().max().item() < tol


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (16, 2, 128)])
def test_bfloat16_kernel_walks_any_block_size_and_any_length(block_size, heads, kv_heads, head_dim, bf16_decode_path):
    # the bfloat16 path scores 16 tokens at a time and walks the block table a token at a time:
    # lengths around 16-token groups and block edges, blocks smaller and larger than a group
    q, k, v, _, _ = random_paged(8, heads, kv_heads, head_dim, torch.bfloat16, block_size)
    lens = torch.tensor([1, 2, 15, 16, 17, 31, 33, 6 * block_size + 1])
    width = int(-(-lens.max() // block_size))  # at most 33 of the cache's 64 blocks
    gen = torch.Generator().manual_seed(torch.initial_seed() + 1)
    tables = torch.stack([torch.randperm(k.shape[0], generator=gen)[:width] for _ in range(len(lens))])
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
    assert (got.double() - reference(q, k, v, tables, lens)).abs().max().item() < 2e-2


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (8, 2, 40)])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(heads, kv_heads, head_dim, bf16_decode_path):
    # a row's result must not depend on the rows it shares a step with (the engine's decode steps are
    # batch-invariant: the fused-decode test compares a request alone with it in a batch)
    q, k, v, tables, lens = random_paged(7, heads, kv_heads, head_dim, torch.bfloat16)
    batch = cpu_attention.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
    alones = [cpu_attention.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], head_dim ** -0.5)
              for i in range(7)]
    for i, alone in enumerate(alones):
        assert torch.equal(alone, batch[i:i + 1]), i
        want = reference(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1])
        assert (alone.double() - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_long_contexts_in_spans_match_float64_alone_and_in_a_batch(heads, kv_heads, head_dim, bf16_decode_path):
    """Contexts of several 128-token spans (the bfloat16 path cuts each task into spans taken by the threads and
    merges them by their largest scores), with sliding-window starts before, inside and at a span's edge: against
    float64, and a sequence alone bit for bit its row in the batch."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    block_size, num_blocks = 16, 80
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([129, 255, 256, 257, 700, 1000, 1000])
    starts = torch.tensor([0, 100, 128, 200, 384, 0, 999])
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:63] for _ in range(len(lens))])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    for windowed in (None, starts):
        got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, windowed)
        for i in range(len(lens)):
            first = 0 if windowed is None else int(starts[i])
            keys = k[tables[i]].reshape(-1, kv_heads, head_dim)[first:lens[i]].double().transpose(0, 1)[None]
            vals = v[tables[i]].reshape(-1, kv_heads, head_dim)[first:lens[i]].double().transpose(0, 1)[None]
            want = F.scaled_dot_product_attention(q[i].double()[None, :, None, :], keys, vals, enable_gqa=True)[0, :, 0]
            assert (got[i].double() - want).abs().max().item() < 2e-2, (i, windowed is not None)
            alone = cpu_attention.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], scale,
                                                         None if windowed is None else windowed[i:i + 1])
            assert torch.equal(alone, got[i:i + 1]), (i, windowed is not None)


@pytest.mark.parametrize("kernel", [None, cpu_attention.paged_decode_attention], ids=["sdpa", "cpp"])
def test_paged_attention_context_mixes_prefill_and_decode(kernel):
    """One step with a decode and a prompt chunk over a cached prefix, as the engine builds it."""
    dtype = torch.float64 if kernel is None else torch.float32  # the kernel takes 16- and 32-bit floats
    tol = 1e-10 if kernel is None else 1e-5
    bs, kvh, heads, d, layers = 4, 2, 4, 16, 1
    cache = torch.zeros(layers, 2, 16, bs, kvh, d, dtype=dtype)
    # sequence A: 6 tokens cached, decodes its 7th; sequence B: 5 cached, prefills 3 more
    table_a, table_b = [3, 7], [1, 9, 12]
    hist_a, hist_b = torch.randn(2, 6, kvh, d, dtype=dtype), torch.randn(2, 5, kvh, d, dtype=dtype)
    for hist, table in ((hist_a, table_a), (hist_b, table_b)):
        for p in range(hist.shape[1]):
            cache[0, :, table[p // bs], p % bs] = hist[:, p]
    q, k, v = (torch.randn(4, n, d, dtype=dtype) for n in (heads, kvh, kvh))
    slots = [table_a[6 // bs] * bs + 6 % bs] + [table_b[p // bs] * bs + p % bs for p in (5, 6, 7)]
    ctx = PagedAttention(cache, bs, torch.tensor(slots), [PrefillChunk(1, 3, 8, torch.tensor(table_b))],
                         torch.tensor([0]), torch.tensor([table_a]), torch.tensor([7]), kernel)
    out = ctx.attend(0, q, k, v)
    # reference: whole histories, causal for B's chunk
    ka, va = torch.cat([hist_a[0], k[:1]]), torch.cat([hist_a[1], v[:1]])
    kb, vb = torch.cat([hist_b[0], k[1:]]), torch.cat([hist_b[1], v[1:]])
    exp_a = F.scaled_dot_product_attention(q[:1].transpose(0, 1)[None], ka.transpose(0, 1)[None],
                                           va.transpose(0, 1)[None], enable_gqa=True)[0].transpose(0, 1)
    mask = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]
    exp_b = F.scaled_dot_product_attention(q[1:].transpose(0, 1)[None], kb.transpose(0, 1)[None],
                                           vb.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(out[:1], exp_a, atol=tol) and torch.allclose(out[1:], exp_b, atol=tol)
    assert torch.equal(cache[0, 0, table_b[1], 1], k[1])  # position 5 of B landed in its slot


def test_chunks_after_cached_tokens_batch_into_one_padded_call():
    """Several prompt chunks over cached prefixes of different lengths, plus a fresh prompt, in one step."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    bs, kvh, heads, d, num_blocks = 4, 2, 6, 8, 64
    cache = torch.zeros(1, 2, num_blocks, bs, kvh, d, dtype=torch.float64)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []  # (cached tokens, new tokens); the last has nothing cached
    for cached, new in ((9, 3), (2, 7), (13, 1 + int(torch.randint(0, 5, (1,), generator=gen))), (0, 5)):
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        hist = torch.randn(2, cached, kvh, d, generator=gen, dtype=torch.float64)
        for p in range(cached):
            cache[0, :, table[p // bs], p % bs] = hist[:, p]
        seqs.append((cached, new, table, hist))
    total = sum(new for _, new, _, _ in seqs)
    q = torch.randn(total, heads, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, kvh, d, generator=gen, dtype=torch.float64) for _ in range(2))
    chunks, slots, row = [], [], 0
    for cached, new, table, _ in seqs:
        chunks.append(PrefillChunk(row, new, cached + new, torch.tensor(table)))
        slots += [table[p // bs] * bs + p % bs for p in range(cached, cached + new)]
        row += new
    ctx = PagedAttention(cache, bs, torch.tensor(slots), chunks, torch.zeros(0, dtype=torch.long),
                         torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    out = ctx.attend(0, q, k, v)
    row = 0
    for cached, new, _, hist in seqs:  # reference: explicit causal softmax over each whole history
        rows = slice(row, row + new)
        keys = torch.cat([hist[0], k[rows]]).repeat_interleave(heads // kvh, dim=1)  # [ctx, heads, d]
        vals = torch.cat([hist[1], v[rows]]).repeat_interleave(heads // kvh, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q[rows], keys) / d ** 0.5
        visible = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        assert torch.allclose(out[rows], torch.einsum("hnt,thd->nhd", probs, vals), atol=1e-10)
        row += new


@pytest.mark.parametrize("error, remembered", [
    (RuntimeError("Error building extension 'x': error: expected ';'"), True),
    (RuntimeError("Error building extension 'x': fatal error: No space left on device"), False),
    (PermissionError("cannot write the build directory"), False),
])
def test_a_failed_build_is_remembered_only_when_the_source_is_at_fault(error, remembered, tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    from infer.kernels import extension

    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["name"])
        raise error

    monkeypatch.setenv("INFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    assert extension.build("infer_paged_attention", "paged_attention.cpp", []) is None
    assert extension.build("infer_paged_attention", "paged_attention.cpp", []) is None
    # a compile error is not retried by the next caller; a full disk or a permission is
    assert len(calls) == (1 if remembered else 2)
    assert bool(list(tmp_path.rglob("failed"))) == remembered


@pytest.mark.parametrize("age_s, removed", [(3600, True), (30, False)])
def test_a_build_lock_left_by_a_killed_compile_is_removed(age_s, removed, tmp_path, monkeypatch):
    """torch's build baton waits while ``lock`` exists: one older than any compile would hang every load."""
    import os
    import time

    import torch.utils.cpp_extension

    from infer.kernels import extension

    monkeypatch.setenv("INFER_KERNEL_CACHE", str(tmp_path))
    directory = tmp_path / f"infer_paged_attention-{extension.build_key('paged_attention.cpp', [])}"
    directory.mkdir()
    lock = directory / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    seen = []

    def load(**kwargs):  # what torch would find: a lock it waits on, or none
        seen.append(lock.exists())
        raise OSError("stop here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    assert extension.build("infer_paged_attention", "paged_attention.cpp", []) is None
    assert seen == [not removed]


def test_kernel_builds_are_keyed_by_source_flags_torch_and_cpu(monkeypatch):
    """Two environments (torch versions, or one version installed twice) or two CPUs never share a build
    directory."""
    import torch

    from infer.kernels import extension

    key = extension.build_key("paged_attention.cpp", ["-fopenmp"])
    assert key == extension.build_key("paged_attention.cpp", ["-fopenmp"])
    assert key != extension.build_key("paged_attention.cpp", ["-fopenmp", "-ffast-math"])
    assert key != extension.build_key("layer_ops.cpp", ["-fopenmp"])
    monkeypatch.setattr(extension, "cpu_flags", lambda: "sse2 avx2")  # another machine's CPU
    assert key != extension.build_key("paged_attention.cpp", ["-fopenmp"])
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0-another-env")
    assert key != extension.build_key("paged_attention.cpp", ["-fopenmp"])
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/another/venv/torch/__init__.py")  # the same version elsewhere
    assert key != extension.build_key("paged_attention.cpp", ["-fopenmp"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    k_cache = torch.randn(8, 16, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(8, 16, 3, 64, generator=gen).to(dtype)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=gen).to(dtype)  # k, v: strided slices of the fused rows
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    k, v = k.view(5, 3, 64), v.view(5, 3, 64)
    slots = torch.randperm(8 * 16, generator=gen)[:5]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, 3, 64).index_copy_(0, slots, k)
    want_v.view(-1, 3, 64).index_copy_(0, slots, v)
    cpu_attention.store_kv_(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot 128 outside the cache of 128"):
        cpu_attention.store_kv_(k_cache, v_cache, torch.tensor([0, 1, 2, 3, 128]), k, v)
    assert torch.equal(k_cache, want_k)  # refused before anything was written


# ---------------------------------------------------------------- prompt chunks (AMX; AVX-512 BF16, AVX-512F, AVX2)
AMX_ATTENTION = __import__("infer.kernels.amx_attention", fromlist=["load"]).load()
BF16_ATTENTION = __import__("infer.kernels.bf16_attention", fromlist=["load"]).load()
CHUNK_KERNELS = [
    pytest.param("amx", marks=pytest.mark.skipif(AMX_ATTENTION is None, reason="this CPU has no AMX: the AMX chunk kernel cannot run here; the class build's case and gather + padded SDPA ran")),
    # kernels/csrc/bf16_attention.cpp as the active class builds it: vdpbf16ps, widened pairs on 16 or 8 lanes
    pytest.param("class", marks=pytest.mark.skipif(BF16_ATTENTION is None, reason="this CPU has no AVX2 + FMA: that kernel cannot run here; gather + padded SDPA, what such a host runs, ran")),
]


def test_amx_chunk_attention_is_used_wherever_the_cpu_has_amx():
    """Where AMX is on, its chunk kernel attends every prompt chunk, fresh ones too (1.3-2.7x the
    AVX-512 BF16 kernel on 40-1024 fresh tokens, a 2-core Xeon), and the fused step runs it."""
    from infer.kernels import isa
    from infer.kernels.resolver import resolve

    assert (AMX_ATTENTION is not None) == (torch.cpu._is_amx_tile_supported() and isa.active() == "amx")
    described = resolve("auto", dtype=torch.bfloat16).describe(torch.bfloat16)
    want = "amx" if AMX_ATTENTION is not None else described["chunk_attention"]
    assert described["prefill_attention"] == described["chunk_attention"] == want, described
    if AMX_ATTENTION is not None:
        assert described["linear"] == "amx" and described["step_layers"] == "cpp", described


def test_the_chunk_attention_is_built_on_every_class_from_avx2():
    """kernels/csrc/bf16_attention.cpp attends prompt chunks on every class with AVX2 + FMA, built for it (INFER_ISA
    forces a lower one: tests/test_isa.py reruns this file so)."""
    from infer.kernels import bf16_attention, isa
    from infer.kernels.resolver import resolve

    assert (BF16_ATTENTION is not None) == isa.at_least("avx2")
    kernels = resolve("auto", amx=False, dtype=torch.bfloat16)
    want = bf16_attention.name() if BF16_ATTENTION is not None else "torch-sdpa"
    assert kernels.describe()["prefill_attention"] == kernels.describe()["chunk_attention"] == want
    if BF16_ATTENTION is not None:  # the build of the active class (amx's linears aside, its vector class's)
        assert bf16_attention.name() == min(isa.active(), "avx512bf16", key=isa.CLASSES.index)


@pytest.mark.parametrize("kernel", CHUNK_KERNELS)
@pytest.mark.parametrize("lengths, cached, heads, kv_heads, d, block", [
    ([30], [400], 9, 3, 64, 16),  # a request after a cached system prompt
    ([1, 5, 17, 33], [15, 16, 7, 100], 9, 3, 64, 16),  # odd sizes: partial blocks, rows not a multiple of 16
    ([24] * 6, [200] * 6, 9, 1, 64, 16),  # a burst, multi-query attention
    ([40, 9], [0 + 3, 64], 9, 9, 64, 16),  # no grouping
    ([256], [0], 9, 3, 64, 16),  # a fresh prompt: what every new request runs
    ([97, 3, 130], [0, 0, 61], 8, 2, 128, 16),  # fresh and cached together, head_dim 128 (Qwen, Llama)
    ([77, 20], [0, 45], 16, 4, 96, 8),  # head_dim 96 (a 64 + a 32 pass), blocks of 8
])
def test_chunk_attention_matches_float64(kernel, lengths, cached, heads, kv_heads, d, block):
    from infer.runtime.engine.attention import PrefillChunk, _PaddedChunks

    if kernel == "amx" and block != 16:
        pytest.skip("the AMX kernel takes blocks of 16 (amx_attention.fits); the resolver never gives it others")
    from infer.kernels import bf16_attention

    module = AMX_ATTENTION if kernel == "amx" else BF16_ATTENTION
    seed = torch.initial_seed()
    print("seed", seed, "kernel", "amx" if kernel == "amx" else bf16_attention.name())
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1024
    k = torch.randn(num_blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16)
    q = (2 * torch.randn(sum(lengths), heads, d, generator=gen)).to(torch.bfloat16)  # peaked softmaxes too
    free = torch.randperm(num_blocks, generator=gen)
    chunks, start, used = [], 0, 0
    for n, c in zip(lengths, cached):
        blocks = -(-(c + n) // block)
        chunks.append(PrefillChunk(start, n, c + n, free[used:used + blocks].clone()))
        start, used = start + n, used + blocks
    want = torch.empty(q.shape, dtype=torch.float64)
    for ch in chunks:
        keys = k[ch.blocks].reshape(-1, kv_heads, d)[:ch.context].double().repeat_interleave(heads // kv_heads, 1)
        vals = v[ch.blocks].reshape(-1, kv_heads, d)[:ch.context].double().repeat_interleave(heads // kv_heads, 1)
        rows = slice(ch.start, ch.start + ch.length)
        visible = torch.arange(ch.context)[None, :] <= ch.context - ch.length + torch.arange(ch.length)[:, None]
        want[rows] = F.scaled_dot_product_attention(q[rows].double().transpose(0, 1), keys.transpose(0, 1),
                                                    vals.transpose(0, 1), attn_mask=visible).transpose(0, 1)
    width = max(len(c.blocks) for c in chunks)
    tables = torch.stack([F.pad(c.blocks, (0, width - len(c.blocks))) for c in chunks])
    got = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    module.chunk_attention(q, k, v, got, torch.tensor([c.start for c in chunks]), torch.tensor(lengths),
                           torch.tensor(cached), tables, d ** -0.5)
    sdpa = torch.zeros(q.shape, dtype=torch.bfloat16)
    _PaddedChunks(chunks, block, torch.bfloat16).attend(q, k, v, sdpa)
    # bfloat16 probabilities and output: as close to the float64 result as torch's SDPA path is
    err, sdpa_err = (got.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)
    with pytest.raises(RuntimeError, match=r"does not fit the \d+ query rows or its block table"):
        module.chunk_attention(q, k, v, got, torch.tensor([0]), torch.tensor([lengths[0]]),
                               torch.tensor([block * width]), tables[:1], d ** -0.5)


# ---------------------------------------------------------------- sliding windows: a start per row
def windowed_reference(q, k, v, tables, lens, starts):
    """reference() over each row's keys from its start to its length."""
    out = []
    kv_heads, d = k.shape[2], k.shape[3]
    for i in range(q.shape[0]):
        keys = k[tables[i]].reshape(-1, kv_heads, d)[starts[i]:lens[i]].double().transpose(0, 1)[None]
        vals = v[tables[i]].reshape(-1, kv_heads, d)[starts[i]:lens[i]].double().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i].double()[None, :, None, :], keys, vals, enable_gqa=True)
        out.append(o[0, :, 0, :])
    return torch.stack(out)


def random_starts(lens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A start per row in 0 .. len - 1: at 0, mid-block, on a block edge, at the last token, and random."""
    starts = (torch.rand(len(lens), generator=gen) * lens).long()
    starts[0], starts[1] = 0, lens[1] - 1
    starts[2] = (lens[2] - 1) // 16 * 16  # the first token of the last block
    return starts.clamp(0, None)


def paged_case(case: str, heads: int, kv_heads: int, head_dim: int):
    """(q, k, v, tables, lens, the cache as float keys and values, the path, a generator) for a case named
    "dtype[-path]": a random float32/bfloat16 cache, or an int8 one written by store_kv_ (its float keys and
    values dequantized), 7 sequences; the seed printed."""
    dtype, _, path = case.partition("-")
    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    if dtype == "int8":
        from test_kv_quant import quantized_paged
        q, k, v, tables, lens = quantized_paged(7, heads, kv_heads, head_dim)
        return q, k, v, tables, lens, cpu_attention.dequantize(k, keys=True), cpu_attention.dequantize(v), path, gen
    q, k, v, tables, lens = random_paged(7, heads, kv_heads, head_dim, getattr(torch, dtype))
    return q, k, v, tables, lens, k, v, path, gen


# a 16-bit or float32 cache takes the register task for head_dim 64/128 and the general loops for 40; an
# int8 cache's register task is switched off to check its general loops on every shape
@pytest.mark.parametrize("case", ["float32", "bfloat16-avx512bf16", "bfloat16-float", "int8-registers", "int8-general"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 40)])
def test_kernel_attends_from_each_rows_start_and_never_reads_blocks_before_it(case, heads, kv_heads, head_dim):
    q, k, v, tables, lens, keys, vals, path, gen = paged_case(case, heads, kv_heads, head_dim)
    dtype = case.partition("-")[0]
    # float32 arithmetic's error, and a 16-bit output's rounding (2^-9 relative) where q is 16-bit
    rounding, tol = (0.0, 1e-5) if dtype == "float32" else (2 ** -8, 2e-3)
    lens[:3] = torch.tensor([70, 45, 96])
    tables = torch.cat([tables, torch.randint(0, k.shape[0], (7, 6 - tables.shape[1]), generator=gen)], 1) \
        if tables.shape[1] < 6 else tables
    starts = random_starts(lens, gen)
    want = windowed_reference(q, keys, vals, tables, lens, starts)
    given_back = tables.clone()
    for i, s in enumerate(starts.tolist()):
        given_back[i, :s // 16] = 10 ** 9  # a block before the start's block: an id no cache has
    module = cpu_attention.load()
    if path == "avx512bf16" and not module.has_bf16_dots():
        pytest.skip("this CPU has no AVX-512 BF16: only the float path exists here (the 'float' case ran)")
    dots = {"bf16_dots": path != "float"}
    module.use_q8_fixed_path(path == "registers")
    fixed_shape = head_dim in (64, 128)
    try:
        got = cpu_attention.paged_decode_attention(q, k, v, given_back, lens, head_dim ** -0.5, starts, **dots)
        alone = cpu_attention.paged_decode_attention(q[3:4], k, v, given_back[3:4], lens[3:4], head_dim ** -0.5,
                                                     starts[3:4], **dots)
        full = cpu_attention.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5, torch.zeros_like(lens),
                                                    **dots)
        plain = cpu_attention.paged_decode_attention(q, k, v, tables, lens, head_dim ** -0.5, **dots)
    finally:
        module.use_q8_fixed_path(True)
    err = ((got.double() - want).abs() - want.abs() * rounding).max().item()
    print(case, "fixed shape" if fixed_shape else "general shape", "max |diff| beyond rounding", err)
    assert err < tol
    assert torch.equal(alone, got[3:4])
    assert torch.equal(full, plain)  # starts of 0 are the plain kernel, bit for bit
    assert (plain.double() - want).abs().max().item() > 0.05  # the window mattered


def test_kernel_refuses_a_start_outside_the_context():
    q, k, v, _, lens = random_paged(3, 4, 2, 64, torch.float32)
    lens[:] = torch.tensor([20, 5, 40])
    tables = torch.arange(9).view(3, 3)  # room for 48 tokens whatever random_paged's lengths were
    for bad, match in ((torch.tensor([0, 5, 0]), "start 5 of sequence 1 is outside 0..4"),
                       (torch.tensor([-1, 0, 0]), "start -1 of sequence 0"), (torch.tensor([0, 0]), "starts must be")):
        with pytest.raises(RuntimeError, match=match):
            cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.125, bad)


# ---------------------------------------------------------------- Gemma 2's attention logit soft-capping
def capped_reference(q, k, v, tables, lens, starts, scale, cap):
    """float64 attention of each row over its keys from its start: scores tanh(s * scale / cap) * cap."""
    out = []
    kv_heads, d = k.shape[2], k.shape[3]
    group = q.shape[1] // kv_heads
    for i in range(q.shape[0]):
        keys = k[tables[i]].reshape(-1, kv_heads, d)[starts[i]:lens[i]].double().repeat_interleave(group, 1)
        vals = v[tables[i]].reshape(-1, kv_heads, d)[starts[i]:lens[i]].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[i].double(), keys) * scale
        p = torch.softmax(torch.tanh(s / cap) * cap, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, vals))
    return torch.stack(out)


@pytest.mark.parametrize("case", ["float32", "bfloat16-avx512bf16", "bfloat16-float", "int8-registers", "int8-general"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 40)])
def test_kernel_soft_caps_the_scores(case, heads, kv_heads, head_dim):
    """softcap > 0: every path (register tasks for head_dim 64/128, the general loops for 40, bfloat16's
    AVX-512 BF16 task, int8's both) caps the scaled scores as transformers' Gemma 2 does, with and without
    window starts; the scale is not head_dim's (query_pre_attn_scalar's); softcap 0 is the plain kernel."""
    q, k, v, tables, lens, keys, vals, path, gen = paged_case(case, heads, kv_heads, head_dim)
    dtype = case.partition("-")[0]
    rounding, tol = (0.0, 1e-5) if dtype == "float32" else (2 ** -8, 2e-3)
    scale, cap = 0.5 / head_dim ** 0.5 * 3, 1.5  # scores of a few units: the cap bends them
    starts = random_starts(lens, gen)
    module = cpu_attention.load()
    if path == "avx512bf16" and not module.has_bf16_dots():
        pytest.skip("this CPU has no AVX-512 BF16: only the float path exists here (the 'float' case ran)")
    dots = {"bf16_dots": path != "float"}
    module.use_q8_fixed_path(path == "registers")
    try:
        got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, softcap=cap, **dots)
        windowed = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, starts, softcap=cap, **dots)
        uncapped = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, softcap=0.0, **dots)
        plain = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, **dots)
    finally:
        module.use_q8_fixed_path(True)
    zeros = torch.zeros_like(lens)
    for out, first in ((got, zeros), (windowed, starts)):
        want = capped_reference(q, keys, vals, tables, lens, first, scale, cap)
        err = ((out.double() - want).abs() - want.abs() * rounding).max().item()
        print(case, "max |diff| beyond rounding", err)
        assert err < tol
    assert torch.equal(uncapped, plain)  # softcap 0: the kernel as before, bit for bit
    assert (plain.double() - capped_reference(q, keys, vals, tables, lens, zeros, scale, cap)).abs().max() > 0.05
    with pytest.raises(RuntimeError, match="softcap must be 0 \\(none\\) or positive; got -1"):
        cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, softcap=-1.0)


@pytest.mark.parametrize("kernel", [None, cpu_attention.paged_decode_attention], ids=["sdpa", "cpp"])
def test_paged_attention_soft_caps_prefill_and_decode_rows(kernel):
    """PagedAttention given a scale and a soft-cap: its decode rows (the C++ kernel, or explicit scores where
    SDPA would be) and a prompt chunk after cached tokens and one starting a sequence (explicit scores)
    against float64."""
    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kvh, d, bs = 4, 2, 32, 4
    scale, cap = 0.4, 1.5
    cache = torch.zeros(1, 2, 16, bs, kvh, d)
    # seq a: 6 cached tokens + 1 decode; seq b: a chunk of 3 after 5 cached; seq c: a fresh chunk of 4
    table_a, table_b, table_c = [3, 7], [1, 9], [5]
    for table, n in ((table_a, 6), (table_b, 5)):
        for p in range(n):
            cache[0, :, table[p // bs], p % bs] = torch.randn(2, kvh, d, generator=gen) * 2
    q, k, v = (torch.randn(8, h, d, generator=gen) * 2 for h in (heads, kvh, kvh))
    slots = [table_a[6 // bs] * bs + 6 % bs] + [table_b[p // bs] * bs + p % bs for p in range(5, 8)] + \
        [table_c[0] * bs + p for p in range(4)]
    ctx = PagedAttention(cache, bs, torch.tensor(slots), [PrefillChunk(1, 3, 8, torch.tensor(table_b)),
                                                          PrefillChunk(4, 4, 4, torch.tensor(table_c))],
                         torch.tensor([0]), torch.tensor([table_a]), torch.tensor([7]), decode_kernel=kernel)
    out = ctx.attend(0, q, k, v, scale, cap)
    kc, vc = cache[0, 0], cache[0, 1]
    want = [capped_reference(q[0:1], kc, vc, torch.tensor([table_a]), [7], [0], scale, cap)[0]]
    for table, row0, cached, n in ((table_b, 1, 5, 3), (table_c, 4, 0, 4)):
        for j in range(n):
            want.append(capped_reference(q[row0 + j:row0 + j + 1], kc, vc, torch.tensor([table]), [cached + j + 1],
                                         [0], scale, cap)[0])
    err = (out.double() - torch.stack(want)).abs().max().item()
    print("max |diff|", err)
    assert err < 1e-5
    assert (ctx.attend(0, q, k, v, scale).double() - torch.stack(want)).abs().max() > 0.05  # the cap mattered
