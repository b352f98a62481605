"""A step's layers in one C++ call (runtime/model/fused_step.py) against the model's own Python loop
over the same kernels: the same tokens and logprobs, for decodes, prompt chunks and steps of both."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from conftest import AMX_MODES
from infer.kernels import bf16_attention, isa, step_layers
from infer.kernels.resolver import cpu_has_amx
from infer.runtime import LLM, SamplingParams

FUSED = step_layers.load()
CHUNKS = FUSED is not None and FUSED.has_chunk_attention()  # prompt chunks in the call too (every class from AVX2)


def test_the_fused_step_kernel_is_built_on_every_class_from_avx2():
    assert (FUSED is not None) == isa.at_least("avx2")
    assert CHUNKS == (FUSED is not None)
    # AMX's linears and chunk attention are built in where the CPU has AMX, and only there
    assert FUSED is None or FUSED.has_amx() == cpu_has_amx()


class _Counting:
    """Wraps a FusedStep: counts the steps it took, by kind (decodes only, prompt chunks, both)."""

    def __init__(self, fused):
        self.fused, self.kinds = fused, Counter()

    def __call__(self, x, positions, ctx):
        out = self.fused(x, positions, ctx)
        if out is not None:
            cached = any(c.cached.sum() > 0 for c in ctx.in_place)
            self.kinds["decodes" if ctx.decodes_only else "mixed" if len(ctx.decode_rows) else "prompts"] += 1
            self.kinds["after cached tokens"] += cached
        return out


def _two_engines(artifact, amx, **engine_args):
    """The same engine twice: one stepping through the fused C++ call, one through the Python layer loop;
    with ``amx`` their linears and chunk attention run on AMX tiles, else on the column-block linears and the
    class's chunk kernel (kernels/csrc/bf16_attention.cpp: AVX-512 BF16, AVX-512F or AVX2)."""
    fused = LLM(artifact, dtype="bfloat16", kv_cache_memory=64 << 20, tuning="off", amx=amx, **engine_args)
    plain = LLM(artifact, dtype="bfloat16", kv_cache_memory=64 << 20, tuning="off", amx=amx, **engine_args)
    kernels = fused.engine.kernels.describe(torch.bfloat16)
    assert fused.engine.model.fused_step is not None, kernels
    chunk = "amx" if amx else bf16_attention.name() if CHUNKS else "torch-sdpa"
    assert kernels["linear"] == ("amx" if amx else "blocks"), kernels
    assert kernels["chunk_attention"] == kernels["prefill_attention"] == chunk, kernels
    plain.engine.model.fused_step = None
    counting = fused.engine.model.fused_step = _Counting(fused.engine.model.fused_step)
    return fused, plain, counting


def _same_bits(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        # the same kernels on the same inputs: the same bits, for sampled and prompt tokens alike
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
        assert [None if p is None else p["logprob"] for p in g.prompt_logprobs] == \
            [None if p is None else p["logprob"] for p in w.prompt_logprobs]


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
@pytest.mark.parametrize("amx", AMX_MODES)
def test_fused_steps_give_the_python_loops_tokens_and_logprobs(embedded_artifact, amx):
    """Prompt-only, decode-only and mixed steps (chunked prefill with decodes riding along), prompts
    after cached tokens (a shared prefix), batches of one and of several."""
    from pydoc_data.topics import topics

    # a small token budget: long prompts go in chunks that share steps with the other sequences' decodes
    fused, plain, counting = _two_engines(embedded_artifact, amx, max_num_batched_tokens=96, prefill_batch_tokens=0)
    text = "".join(topics.values())
    starts = [random.randrange(len(text) - 4000) for _ in range(3)]
    # the last prompt is long enough (>= 200 tokens) that after the others' prefill it still needs two more
    # chunks of the 96-token budget, each sharing its step with their decodes: at least two mixed steps
    lengths = [random.randint(64, 300), random.randint(20, 300), random.randint(200, 300)]
    prompts = [fused.tokenizer.encode(text[s:s + 4000])[:n] for s, n in zip(starts, lengths)]
    shared = prompts[0][:64]  # a prefix the cache holds after the first batch
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    for batch in (prompts, prompts[:1], [shared + p[:40] for p in prompts[1:]]):
        _same_bits(fused.generate(batch, params), plain.generate(batch, params))
    kinds = counting.kinds
    if CHUNKS:
        assert kinds["decodes"] >= 2 * 15 and kinds["prompts"] >= 3 and kinds["mixed"] >= 2, kinds
        assert kinds["after cached tokens"] >= 1, kinds
    else:  # no chunk kernel in the step (a build without it): prompt steps stay in the Python loop
        assert kinds["decodes"] >= 2 * 15 and kinds["prompts"] == kinds["mixed"] == 0, kinds


class _FloatDotsFromTwo:
    """A tuning table that measured the decode kernel's float path faster from two decodes up (cpp-float)."""
    buckets = [1, 2, 4, 8]

    @staticmethod
    def decode_attention(rows):
        return "cpp-float" if rows >= 2 else "cpp"


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
def test_a_table_choosing_the_float_decode_path_runs_it_in_the_one_call_step_and_the_loop_alike(embedded_artifact):
    """The tune stage's cpp-float: decode rows of a batch of two or more attend on the paged kernel's float path
    (bf16_dots=False) in the one-call step, its decode bursts and the layer loop alike, which give the same bits;
    where the build has AVX-512 BF16 the tokens' logprobs then differ from the default path's (the choice is
    real), and a single decode keeps the default."""
    from dataclasses import replace

    from pydoc_data.topics import topics

    fused, plain, counting = _two_engines(embedded_artifact, False, max_num_batched_tokens=96, prefill_batch_tokens=0)
    default = LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=64 << 20, tuning="off", amx=False,
                  max_num_batched_tokens=96, prefill_batch_tokens=0)
    seen = []
    for llm in (fused, plain):
        runner = llm.engine.runner
        runner.plan = replace(runner.plan, tuning=_FloatDotsFromTwo())
        context = runner._context

        def spy(inputs, context=context):
            seen.append((len(inputs.decode_rows), inputs.bf16_dots))
            return context(inputs)

        runner._context = spy
    text = "".join(topics.values())
    start = random.randrange(len(text) - 3000)
    prompts = [fused.tokenizer.encode(text[start + 1000 * i:start + 1000 * i + 900])[:n]
               for i, n in enumerate((40, 70, 90))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    got = fused.generate(prompts, params)
    _same_bits(got, plain.generate(prompts, params))
    assert counting.kinds["decodes"] >= 1, counting.kinds
    assert seen and all(dots == (decodes < 2) for decodes, dots in seen), seen
    assert any(decodes >= 2 for decodes, _ in seen), seen
    from infer.kernels import cpu_attention

    if cpu_attention.load().has_bf16_dots():  # else the float path is the only one this build has
        want = default.generate(prompts, params)
        assert any([a["logprob"] for a in g.logprobs] != [b["logprob"] for b in w.logprobs]
                   for g, w in zip(got, want)), "the float path gave the vdpbf16ps path's bits"


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
def test_a_step_without_chunks_whose_rows_are_not_all_decodes_is_refused(embedded_artifact):
    """The C++ step reads a chunk-less step as decodes only: rows without a block table would attend to
    nothing, so it refuses them by name rather than compute garbage."""
    llm = LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", amx=False)
    fused, cfg, kv_cache = llm.engine.model.fused_step, llm.engine.model.config, llm.engine.runner.kv_cache
    x = torch.zeros(3, cfg.hidden_size, dtype=torch.bfloat16)
    long = dict(dtype=torch.long)
    with pytest.raises(RuntimeError, match="every row a decode"):
        FUSED.step_layers(x, torch.empty_like(x), fused.weights, kv_cache, torch.zeros(3, **long),
                          torch.zeros(3, **long), fused.rotary.cos, fused.rotary.sin, *fused.no_chunks,
                          torch.arange(2), torch.zeros(2, 1, **long), torch.ones(2, **long), *fused.no_chunks[:1],
                          fused.window_layers, False, True, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
@pytest.mark.parametrize("bad", ["slot", "block", "length"])
def test_a_decode_steps_bad_slot_or_table_is_refused_before_anything_is_written(embedded_artifact, bad):
    """A decode-only step checks its slots and block tables once, for every layer, before it writes a key or
    reads the cache through them (it then works on pointers): an index outside the cache is refused by name
    and the cache is left as it was."""
    llm = LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", amx=False)
    fused, cfg, kv_cache = llm.engine.model.fused_step, llm.engine.model.config, llm.engine.runner.kv_cache
    blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
    before = kv_cache.clone()
    x = torch.randn(2, cfg.hidden_size).to(torch.bfloat16)
    long = dict(dtype=torch.long)
    slots, tables, lens = torch.tensor([0, block_size]), torch.tensor([[0], [1]]), torch.tensor([1, 1])
    if bad == "slot":
        slots[1], match = blocks * block_size, "slot .* outside the cache"
    elif bad == "block":
        tables[1, 0], match = blocks, "block id .* outside the cache"
    else:
        lens[0], match = block_size + 1, "context length .* outside"
    with pytest.raises(RuntimeError, match=match):
        FUSED.step_layers(x, torch.empty_like(x), fused.weights, kv_cache, slots, torch.zeros(2, **long),
                          fused.rotary.cos, fused.rotary.sin, *fused.no_chunks, torch.arange(2), tables, lens,
                          *fused.no_chunks[:1], fused.window_layers, False, True, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
    assert torch.equal(kv_cache, before)


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
@pytest.mark.parametrize("amx", AMX_MODES)
def test_fused_steps_with_qkv_bias_match_the_python_loop(tmp_path, embedded_artifact, cache_dir, amx):
    """Qwen2's q/k/v carry a bias: the fused step adds it where the packed linear does (float32 on the
    AVX-512 BF16 kernel, bfloat16 on AMX tiles)."""
    import shutil

    import transformers

    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    cfg = transformers.Qwen2Config(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random, large enough biases to matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_artifact / name, tmp_path / "src" / name)
    artifact = build(compose_recipe([f"model.source={tmp_path / 'src'}", "model.dtype=bfloat16", "tune.enabled=false",
                                     "eval.enabled=false", "artifact.name=tiny-qwen2", f"output_dir={tmp_path / 'out'}",
                                     f"cache_dir={cache_dir}"])).artifact
    llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", enable_prefix_caching=False,
              amx=amx)
    fused, qkv = llm.engine.model.fused_step, llm.engine.model.layers[0].self_attn.qkv_proj
    assert fused is not None and qkv.bias is not None and qkv.kernel == ("amx" if amx else "blocks")
    prompts = [[random.randrange(100, 49000) for _ in range(random.randint(5, 40))] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    counting = llm.engine.model.fused_step = _Counting(fused)
    got = llm.generate(prompts, params)
    llm.engine.model.fused_step = None
    want = llm.generate(prompts, params)
    assert counting.kinds["prompts"] >= CHUNKS and counting.kinds["decodes"] >= 11, counting.kinds
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX2 + FMA: the model runs its Python layer loop, "
                                          "which every other engine test covers")
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("recipe", ["smollm2_135m_gptq", "smollm2_135m_gptq_g32_asym"])
def test_fused_steps_of_a_w4a16_model_match_the_python_loop(tmp_path, embedded_artifact, cache_dir, recipe, amx):
    """W4A16 (int4 groups of 64, symmetric; of 32 with zero points) of a Qwen2 with q/k/v biases, built by
    the shipped recipes: the fused step runs the int4 kernel where the layer loop runs Int4BlocksLinear,
    and gives the same bits."""
    import shutil

    import transformers

    from infer.runtime.model.quant_linear import quantized_modules
    from quant_helpers import TINY_CALIB, build_recipe

    cfg = transformers.Qwen2Config(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(torch.initial_seed())
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_artifact / name, tmp_path / "src" / name)
    artifact = build_recipe([f"recipe={recipe}", f"model.source={tmp_path / 'src'}", "quant.ignore=[lm_head]",
                             "tune.enabled=false", "eval.enabled=false", *TINY_CALIB], tmp_path / "out", cache_dir).artifact
    llm = LLM(artifact, kv_cache_memory=16 << 20, tuning="off", enable_prefix_caching=False, amx=amx)
    model = llm.engine.model
    assert set(quantized_modules(model).values()) == {"cpu-int4-blocks"} and model.dtype == torch.bfloat16
    fused = model.fused_step
    assert fused is not None
    prompts = [[random.randrange(100, 49000) for _ in range(random.randint(5, 40))] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    counting = model.fused_step = _Counting(fused)
    got = llm.generate(prompts, params)
    model.fused_step = None
    want = llm.generate(prompts, params)
    assert counting.kinds["prompts"] >= CHUNKS and counting.kinds["decodes"] >= 11, counting.kinds
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]
