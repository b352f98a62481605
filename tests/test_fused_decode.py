"""A decode step's layers in one C++ call (runtime/model/fused_decode.py) against the model's own
Python loop over the same kernels: the same tokens and logprobs, steps of one and of several decodes."""

from __future__ import annotations

import random

import pytest
import torch

from infer.kernels import decode_layers
from infer.kernels.resolver import cpu_has_avx512_bf16
from infer.runtime import LLM, SamplingParams

FUSED = decode_layers.load()


def test_the_fused_decode_kernel_is_built_wherever_the_cpu_has_avx512_bf16():
    assert (FUSED is not None) == cpu_has_avx512_bf16()


class _Counting:
    def __init__(self, fused):
        self.fused, self.steps = fused, 0

    def __call__(self, *args):
        out = self.fused(*args)
        self.steps += out is not None
        return out


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX-512 BF16: the model runs its Python layer loop, "
                                          "which every other engine test covers")
def test_fused_decode_steps_give_the_python_loops_tokens_and_logprobs(embedded_artifact):
    from pydoc_data.topics import topics

    # no prefix cache: every run computes its prompts afresh, in one chunk each, the same way
    # amx=False: on an AMX host the linears would be AMX tiles, which the fused step does not take
    llm = LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=64 << 20, tuning="off", enable_prefix_caching=False,
              amx=False)
    model = llm.engine.model
    assert model.fused_decode is not None, llm.engine.kernels.describe(torch.bfloat16)
    text = "".join(topics.values())
    starts = [random.randrange(len(text) - 2000) for _ in range(3)]
    prompts = [llm.tokenizer.encode(text[s:s + 2000])[:random.randint(20, 120)] for s in starts]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    fused = model.fused_decode
    counting = model.fused_decode = _Counting(fused)
    together = llm.generate(prompts, params)  # decode steps of 3 sequences at once
    alone = llm.generate(prompts[:1], params)[0]  # and of one
    assert counting.steps >= 2 * 15, counting.steps  # every decode step after each prompt went fused
    model.fused_decode = None
    plain = llm.generate(prompts, params)
    model.fused_decode = fused
    for got, want in zip([*together, alone], [*plain, plain[0]]):
        assert got.token_ids == want.token_ids
        diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(got.logprobs, want.logprobs)]
        assert max(diffs) == 0, diffs  # the same kernels on the same inputs: the same bits


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX-512 BF16: the model runs its Python layer loop, "
                                          "which every other engine test covers")
def test_fused_decode_with_qkv_bias_matches_the_python_loop(tmp_path, embedded_artifact, cache_dir):
    """Qwen2's q/k/v carry a bias: the fused step adds it where the packed linear does."""
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
              amx=False)
    fused = llm.engine.model.fused_decode
    assert fused is not None and llm.engine.model.layers[0].self_attn.qkv_proj.bias is not None
    prompts = [[random.randrange(100, 49000) for _ in range(random.randint(5, 40))] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    counting = llm.engine.model.fused_decode = _Counting(fused)
    got = llm.generate(prompts, params)
    llm.engine.model.fused_decode = None
    want = llm.generate(prompts, params)
    assert counting.steps >= 11
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]


@pytest.mark.skipif(FUSED is None, reason="this CPU has no AVX-512 BF16: the model runs its Python layer loop, "
                                          "which every other engine test covers")
@pytest.mark.parametrize("recipe", ["smollm2_135m_gptq", "smollm2_135m_gptq_g32_asym"])
def test_fused_decode_of_a_w4a16_model_matches_the_python_loop(tmp_path, embedded_artifact, cache_dir, recipe):
    """W4A16 (int4 groups of 64, symmetric; of 32 with zero points) of a Qwen2 with q/k/v biases, built by
    the shipped recipes: the fused step runs the int4 kernel where the layer loop runs Int4Avx512Linear,
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
    llm = LLM(artifact, kv_cache_memory=16 << 20, tuning="off", enable_prefix_caching=False, amx=False)
    model = llm.engine.model
    assert set(quantized_modules(model).values()) == {"cpu-int4-avx512"} and model.dtype == torch.bfloat16
    fused = model.fused_decode
    assert fused is not None
    prompts = [[random.randrange(100, 49000) for _ in range(random.randint(5, 40))] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    counting = model.fused_decode = _Counting(fused)
    got = llm.generate(prompts, params)
    model.fused_decode = None
    want = llm.generate(prompts, params)
    assert counting.steps >= 11
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]
