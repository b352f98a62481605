"""The int8 KV cache: the store kernel's quantization and the decode kernel over it, against float64
references computed from the dequantized cache (kernels.cpu_attention.dequantize)."""

from __future__ import annotations

import json

import pytest
import torch

from infer.kernels import cpu_attention

from test_kernels import reference


def quantized_paged(seqs, heads, kv_heads, head_dim, block_size=16, num_blocks=48, scale=3.0):
    """A random int8 cache written by store_kv_ (every slot), with random tables and lengths."""
    seed = torch.initial_seed()
    gen = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    k = torch.randn(slots, kv_heads, head_dim, generator=gen) * scale
    v = torch.randn(slots, kv_heads, head_dim, generator=gen) * scale
    kc = torch.zeros(num_blocks, *cpu_attention.block_shape(block_size, kv_heads, head_dim, torch.int8), dtype=torch.int8)
    vc = torch.zeros_like(kc)
    cpu_attention.store_kv_(kc, vc, torch.randperm(slots, generator=gen), k.bfloat16(), v.bfloat16())
    lens = torch.randint(1, 6 * block_size, (seqs,), generator=gen)
    lens[0] = 6 * block_size  # one full-width table
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(seqs)])
    q = torch.randn(seqs, heads, head_dim, generator=gen).bfloat16()
    return q, kc, vc, tables, lens


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows by slot (block * block_size + position): [slots, kv_heads, head_dim + 2]."""
    return cache.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_quantizes_each_row_within_half_a_step(dtype):
    seed = torch.initial_seed()
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(37, (9 + 3 + 3) * 64, generator=gen) * torch.rand(37, 1, generator=gen) * 20).to(dtype)
    qkv[3] = 0  # an all-zero row: scale 0, values 0
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided slices, as the fused projection gives
    k, v = k.view(37, 3, 64), v.view(37, 3, 64)
    kc = torch.full((4, *cpu_attention.block_shape(16, 3, 64, torch.int8)), 99, dtype=torch.int8)
    vc = kc.clone()
    slots = torch.randperm(64, generator=gen)[:37]
    cpu_attention.store_kv_(kc, vc, slots, k, v)
    turned = k.double() @ cpu_attention.hadamard(64).double()  # keys are stored turned (H k), values plain
    for cache, x in ((kc, turned), (vc, v)):
        rows = slot_rows(cache)[slots]
        got = cpu_attention.dequantize_rows(rows).double()
        scale = rows[..., -2:].contiguous().view(torch.bfloat16).double()
        absmax = x.double().abs().amax(-1, keepdim=True)
        # the scale is absmax / 127 rounded to bfloat16 (relative error <= 2^-9), values within +-127
        assert ((scale - absmax / 127).abs() <= absmax / 127 * 2 ** -8 + 1e-30).all()
        assert rows[..., :-2].abs().max() <= 127
        # (the kernel turns keys in float32: a few ulps of a 64-term sum on top of half a step)
        assert ((got - x.double()).abs() <= scale / 2 * (1 + 1e-3) + 1e-30).all()
        assert (got[3] == 0).all()
    # turned back, each key is within half a step of its row: H e / 64 averages the 64 errors
    keys = cpu_attention.dequantize_rows(slot_rows(kc)[slots], keys=True).double()
    step = slot_rows(kc)[slots][..., -2:].contiguous().view(torch.bfloat16).double()
    assert ((keys - k.double()).abs() <= step / 2 * (1 + 1e-3) + 1e-30).all()  # H e / 64: |.| <= max |e|
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (slot_rows(kc)[untouched] == 99).all()  # only the slots written
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_attention.store_kv_(kc[..., :64].contiguous(), vc[..., :64].contiguous(), slots, k, v)


@pytest.mark.parametrize("head_dim", [64, 96])
def test_turned_keys_with_outlier_channels_lose_less_than_plain_rows(head_dim):
    """Keys with a few channels far above the rest (RoPE'd keys often have them): stored turned, their error
    is a fraction of what one absmax scale over the plain row gives (96: three turned blocks of 32)."""
    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(64, 2, head_dim, generator=gen)
    k[..., torch.randperm(head_dim, generator=gen)[:3]] *= 20
    v = torch.randn_like(k)
    kc = torch.zeros(4, *cpu_attention.block_shape(16, 2, head_dim, torch.int8), dtype=torch.int8)
    vc = torch.zeros_like(kc)
    cpu_attention.store_kv_(kc, vc, torch.arange(64), k, v)
    turned = (cpu_attention.dequantize(kc, keys=True).reshape(64, 2, head_dim) - k).abs().mean().item()
    step = k.abs().amax(-1, keepdim=True) / 127
    plain = ((k / step).round() * step - k).abs().mean().item()
    print(f"mean key error: turned {turned:.5f}, plain rows {plain:.5f}")
    assert turned < plain / 2, (turned, plain)
    assert (cpu_attention.dequantize(vc).reshape(64, 2, head_dim) - v).abs().amax() <= v.abs().amax() / 254 * 1.01


@pytest.mark.parametrize("fixed", [True, False], ids=["registers", "general"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 40)])
def test_decode_on_int8_cache_matches_float64_of_dequantized(fixed, heads, kv_heads, head_dim):
    q, kc, vc, tables, lens = quantized_paged(6, heads, kv_heads, head_dim)
    module = cpu_attention.load()
    module.use_q8_fixed_path(fixed)
    try:
        got = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, head_dim ** -0.5)
        # a row gets the same bits alone as in the batch
        alone = cpu_attention.paged_decode_attention(q[2:3], kc, vc, tables[2:3], lens[2:3], head_dim ** -0.5)
    finally:
        module.use_q8_fixed_path(True)
    assert torch.equal(alone, got[2:3])
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = reference(q, cpu_attention.dequantize(kc, keys=True), cpu_attention.dequantize(vc), tables, lens)
    # within the output's bfloat16 rounding (2^-9 relative) and float32 arithmetic's error
    excess = ((got.double() - want).abs() - want.abs() * 2 ** -8).max().item()
    assert excess < 2e-3, excess


def test_decode_refuses_a_cache_of_the_wrong_row_size():
    q, kc, vc, tables, lens = quantized_paged(2, 9, 3, 64)
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        cpu_attention.paged_decode_attention(q, kc[..., :65].contiguous(), vc[..., :65].contiguous(), tables, lens, 0.125)


# ---------------------------------------------------------------- the engine on an int8 cache
def test_kv_cache_dtype_follows_the_request_then_the_artifact_and_refuses_what_cannot_read_it():
    from types import SimpleNamespace

    from infer.runtime.engine.plan import kv_cache_dtype

    cpp = SimpleNamespace(backend="cpp", decode_attention=cpu_attention.paged_decode_attention,
                          store_kv=cpu_attention.store_kv_)
    torch_ops = SimpleNamespace(backend="torch", decode_attention=None, store_kv=None)
    bf16 = torch.bfloat16
    assert kv_cache_dtype("auto", None, bf16, cpp) == bf16
    assert kv_cache_dtype("auto", "int8", bf16, cpp) == torch.int8
    assert kv_cache_dtype("bfloat16", "int8", bf16, cpp) == bf16
    assert kv_cache_dtype("int8", "bfloat16", bf16, cpp) == torch.int8
    assert kv_cache_dtype("auto", "int8", bf16, torch_ops) == bf16  # the artifact's choice, where it cannot run
    with pytest.raises(ValueError, match="use kv_cache_dtype=bfloat16"):
        kv_cache_dtype("int8", None, bf16, torch_ops)
    with pytest.raises(ValueError, match="choose one of"):
        kv_cache_dtype("fp8", None, bf16, cpp)


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
             "How many legs does a spider have?"]


def test_int8_cache_holds_194x_and_a_prefix_hit_gives_the_logits_of_a_miss(embedded_artifact):
    from infer.runtime import LLM
    from infer.runtime.engine.model_runner import kv_bytes_per_block
    from infer.runtime.engine.sampling_params import SamplingParams

    llm = LLM(embedded_artifact, dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory=24 << 20,
              max_num_batched_tokens=40, max_num_seqs=8)
    engine = llm.engine
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    assert engine.runner.kv_cache.dtype == torch.int8 and engine.runner.kv_cache.shape[-1] == 64 + 2
    model = engine.model
    ratio = kv_bytes_per_block(model, 16, torch.bfloat16) / kv_bytes_per_block(model, 16, torch.int8)
    assert ratio == pytest.approx(128 / 66)  # 1.94x the tokens in the same memory
    assert engine.num_blocks == (24 << 20) // kv_bytes_per_block(model, 16, torch.int8)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    miss = llm.generate(prompts[0], params)[0]
    hits = engine.block_manager.prefix_hits
    hit = llm.generate(prompts[0], params)[0]
    assert engine.block_manager.prefix_hits > hits
    assert hit.token_ids == miss.token_ids and hit.logprobs == miss.logprobs  # the same bits
    # chunked prefill (40-token steps) and preemption (7 blocks: two sequences' prompts and one spare, and each
    # grows by a block) change no token
    small = LLM(embedded_artifact, dtype="bfloat16", kv_cache_dtype="int8", max_num_batched_tokens=40,
                max_num_seqs=8, kv_cache_memory=7 * kv_bytes_per_block(model, 16, torch.int8),
                enable_prefix_caching=False)
    batch = prompts[:4]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = small.generate(batch, greedy)
    assert small.engine.scheduler.num_preemptions > 0
    alone = [llm.generate(p, greedy)[0] for p in prompts[:4]]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert small.engine.block_manager.num_free_blocks == small.engine.num_blocks
    # the answer a chat user reads, in float32: in bfloat16 the first token is a near tie ("The" against
    # "L'", 0.1 apart with the bfloat16 cache too) that the linears' rounding on some CPU classes flips
    with LLM(embedded_artifact, dtype="float32", kv_cache_dtype="int8") as exact:
        assert "Paris" in exact.generate(prompts[0], SamplingParams(temperature=0, max_tokens=20))[0].text


# ---------------------------------------------------------------- the build's choice
def test_recipe_kv_cache_keys_are_checked():
    from infer.pipeline.config import RecipeError, validate

    assert validate({"kv_cache": {"dtype": "auto"}}).kv_cache.window_tokens == 2048
    with pytest.raises(RecipeError, match="kv_cache.dtype.*auto, bfloat16, int8"):
        validate({"kv_cache": {"dtype": "fp8"}})
    with pytest.raises(RecipeError, match="at least 2048 tokens"):
        validate({"kv_cache": {"dtype": "auto", "window_tokens": 512}})


def test_kv_stage_measures_int8_against_the_models_own_cache_and_states_the_choice(embedded_artifact, tmp_path):
    # the stage on short windows (a recipe asks for >= 2048 tokens; the measurement is the same code)
    from dataclasses import replace

    from infer.pipeline import kv_cache
    from infer.pipeline.config import BuildConfig, KVCacheSpec
    from infer.pipeline.stage import StageResult
    from infer.runtime.artifact import MANIFEST, Artifact

    # the stage it follows is a stage directory: the artifact's files and the stage's _stage.json record
    from infer.pipeline.stage import DONE, link_tree
    stage_dir = link_tree(embedded_artifact, tmp_path / "tune-stage", with_manifest=True)
    (stage_dir / DONE).write_text("{}")
    packaged = StageResult("tune", "k" * 64, stage_dir, False, 0.0, {})
    loose = replace(BuildConfig(), kv_cache=KVCacheSpec(dtype="auto", window_tokens=128, windows=1, mean_kld_max=1.0,
                                                         top1_agreement_min=0.0))
    def manifest(stage):
        return Artifact(stage.path, json.loads((stage.path / MANIFEST).read_text()), {})

    art = manifest(kv_cache.kv_stage(loose, tmp_path, packaged))
    record = art.manifest["kv_cache"]
    assert art.kv_cache_dtype == "int8" and record["requested"] == "auto"
    row = record["candidates"][0]
    assert row["dtype"] == "int8" and row["tokens"] == 128 and row["passed"]
    assert 0 < row["mean_kld"] < 0.05 and row["top1_agreement"] > 0.85
    assert record["capacity_x"] == pytest.approx(128 / 66, abs=1e-3)
    strict = replace(loose, kv_cache=replace(loose.kv_cache, dtype="int8", mean_kld_max=0.0))
    with pytest.raises(kv_cache.KVCacheError, match="use kv_cache.dtype=auto or bfloat16"):
        kv_cache.kv_stage(strict, tmp_path, packaged)  # the same measurement (cached), a gate it fails
    none_pass = replace(loose, kv_cache=replace(loose.kv_cache, mean_kld_max=0.0))
    assert manifest(kv_cache.kv_stage(none_pass, tmp_path, packaged)).kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("sharpness", [0.05, 1.0, 4.0], ids=["flat", "plain", "peaked"])
def test_decode_on_a_long_int8_cache_matches_float64(heads, kv_heads, head_dim, sharpness):
    """2,085 tokens (many 64-token spans of the AVX2 task's int16 probabilities, a ragged tail) with attention
    from nearly uniform to a few tokens: the register task against float64 of the dequantized cache."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    block, length = 16, 2085
    blocks = -(-length // block) + 3
    k = torch.randn(blocks * block, kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(blocks * block, kv_heads, head_dim, generator=gen) * 2
    kc = torch.zeros(blocks, *cpu_attention.block_shape(block, kv_heads, head_dim, torch.int8), dtype=torch.int8)
    vc = torch.zeros_like(kc)
    cpu_attention.store_kv_(kc, vc, torch.arange(blocks * block), k.bfloat16(), v.bfloat16())
    tables = torch.randperm(blocks, generator=gen)[None, :-3].repeat(2, 1)
    lens = torch.tensor([length, length - 77])
    q = (torch.randn(2, heads, head_dim, generator=gen) * sharpness).bfloat16()
    got = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, head_dim ** -0.5)
    want = reference(q, cpu_attention.dequantize(kc, keys=True), cpu_attention.dequantize(vc), tables, lens)
    excess = ((got.double() - want).abs() - want.abs() * 2 ** -8).max().item()
    print("largest output", want.abs().max().item(), "excess over bfloat16 rounding", excess)
    assert excess < 2e-3 * max(1.0, want.abs().max().item()), excess


def test_the_like_for_like_reference_reads_its_prompt_rows_as_decode_rows(embedded_artifact):
    """bench/kv_cache.py's served comparison: the bfloat16 reference's prompt rows as decode rows (the int8 cache's
    route), so the two runs differ by the format alone; in float32 both references give the format's small loss."""
    from infer.pipeline.kv_cache import compare_caches, eval_windows

    windows = eval_windows(embedded_artifact, "pydoc_topics", 160, 1)
    chunks = compare_caches(embedded_artifact, windows)
    rows = compare_caches(embedded_artifact, windows, reference_rows="decode-rows")
    print(chunks, rows)
    assert (chunks["reference_rows"], rows["reference_rows"]) == ("chunks", "decode-rows")
    assert 0 < rows["mean_kld"] < 0.05 and abs(rows["mean_kld"] - chunks["mean_kld"]) < 0.5 * chunks["mean_kld"]
