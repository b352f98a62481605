"""The engine end to end on the embedded model: greedy outputs equal transformers' token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import AMX_MODES
from infer.kernels import bf16_attention
from infer.runtime import LLM, LLMEngine, SamplingParams
from infer.runtime.model import ModelConfig

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain recursion in one sentence.", "What is 12 times 12?", "Translate 'good morning' into Spanish.",
    "Name a famous painting by Leonardo da Vinci.", "What does a CPU do?", "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Suggest a name for a black cat.", "Why is the sky blue?", "What is Python used for?",
]
RAW = ["def add(a, b):\n    return", "Once upon a time, in a small village,"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(embedded_llm):
    tok = embedded_llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS] + RAW


@pytest.fixture(scope="module")
def hf_greedy(hf_reference, prompts, embedded_llm):
    """transformers' greedy continuation of each prompt, one at a time (no padding involved)."""
    model, _ = hf_reference
    outs = []
    for p in prompts:
        ids = torch.tensor([embedded_llm.tokenizer.encode(p)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=2)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_greedy_batch_matches_transformers_with_chunking_prefix_cache_and_preemption(
        embedded_artifact, prompts, hf_greedy, kernels):
    cfg = ModelConfig.from_dir(embedded_artifact)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V of 16 tokens
    # 20 blocks: far fewer than 16 sequences of ~60 tokens need, so preemption must happen
    llm = LLM(embedded_artifact, kernels=kernels, max_num_batched_tokens=48, max_num_seqs=16,
              kv_cache_memory=20 * per_block)
    assert llm.engine.num_blocks == 20
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for out, expected in zip(outs, hf_greedy):
        assert out.token_ids == expected, (out.prompt[-60:], out.text)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0  # the chat template's shared system prompt
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # nothing leaked


def test_greedy_answer_and_finish_reasons(embedded_llm, prompts):
    outs = embedded_llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=64))
    assert "Paris" in outs[0].text and outs[0].finish_reason == "stop"
    short = embedded_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=5))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 5


def test_stop_strings_and_stop_tokens(embedded_llm, prompts):
    full = embedded_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=40))[0].text
    word = full.split()[3]
    cut = embedded_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=40, stop=[word]))[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(word)]
    first = embedded_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=40))[0].token_ids[2]
    by_id = embedded_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[first]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == first and len(by_id.token_ids) == 3


def test_seed_gives_same_output_whatever_the_batch(embedded_llm, prompts):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    alone = embedded_llm.generate(prompts[3], p)[0].token_ids
    crowd = embedded_llm.generate(prompts[:6], [SamplingParams(temperature=0.8, max_tokens=20)] * 3 + [p] +
                                  [SamplingParams(temperature=1.2, max_tokens=12)] * 2)
    assert crowd[3].token_ids == alone
    other_seed = embedded_llm.generate(prompts[3], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16,
                                                                  seed=99))[0].token_ids
    assert other_seed != alone


def test_abort_frees_blocks_at_once(embedded_artifact):
    engine = LLMEngine(embedded_artifact, kv_cache_memory=64 << 20)
    free = engine.block_manager.num_free_blocks
    engine.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("b", "Count to one hundred.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < free
    out = engine.abort_request("a")
    assert out.finished and out.finish_reason == "abort"
    engine.abort_request("b")
    assert engine.block_manager.num_free_blocks == free and not engine.has_unfinished_requests()


def test_logprobs_are_the_models(embedded_llm, embedded_artifact, prompts):
    out = embedded_llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                           prompt_logprobs=1))[0]
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    logp = embedded_llm.engine.model.logits(ids)[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp["token_id"] == out.token_ids[i]
        assert lp["logprob"] == pytest.approx(logp[n - 1 + i, out.token_ids[i]].item(), abs=1e-4)
        assert lp["top"][0][0] == out.token_ids[i] and len(lp["top"]) == 2  # greedy picks the top token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for j in range(1, n):
        assert out.prompt_logprobs[j]["logprob"] == pytest.approx(logp[j - 1, out.prompt_token_ids[j]].item(), abs=1e-4)


@pytest.mark.parametrize("prompt,params,match", [
    ("", {}, "prompt is empty"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"top_p": 0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_k": 0}, "top_k"),
    ("hi", {"min_p": 2}, "min_p"),
    ("hi", {"logprobs": 50}, "logprobs"),
    ("hi", {"stop": [""]}, "stop"),
    ("hi", {"frobnicate": 1}, "unknown sampling parameter 'frobnicate'"),
])
def test_bad_input_is_a_clear_value_error(embedded_llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        embedded_llm.generate(prompt, SamplingParams.from_dict(params))


def test_prompt_over_context_limit(embedded_artifact):
    llm = LLM(embedded_artifact, max_model_len=64, kv_cache_memory=64 << 20)
    with pytest.raises(ValueError, match=r"prompt is 100 tokens, over this engine's context limit of 64"):
        llm.generate([[5] * 100])
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        llm.generate([[10**9]])
    # a bad prompt in a list queues nothing
    with pytest.raises(ValueError):
        llm.generate(["fine", ""])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4  # the context limit ends it


@pytest.mark.parametrize("amx", AMX_MODES)
def test_bfloat16_with_the_fast_kernels_is_as_close_to_float32_as_torch_ops(embedded_artifact, hf_reference, amx):
    """The serving dtype through AMX, AVX-512 BF16 or oneDNN linears and the fused kernels, against
    transformers in float32: no further from it than bfloat16 through plain torch ops, on fresh text."""
    import random

    from pydoc_data.topics import topics

    from infer.kernels import isa
    from infer.kernels.resolver import resolve
    from infer.runtime.model import load_model
    from infer.runtime.model.packed_linear import PackedLinear
    from quant_helpers import compare_logits

    ref_model, tok = hf_reference
    text = "".join(topics.values())
    start = random.randrange(len(text) - 4000)
    ids = torch.tensor([tok.encode(text[start:start + 4000])[:160]])
    with torch.no_grad():
        ref = ref_model(ids).logits[0].float()
    kernels = resolve("cpp", amx=amx, dtype=torch.bfloat16)
    fast = load_model(embedded_artifact, torch.bfloat16, kernels)
    plain = load_model(embedded_artifact, torch.bfloat16, "torch")
    print("kernels", kernels.describe(torch.bfloat16))
    assert type(fast.layers[0].mlp.gate_up_proj) is PackedLinear
    linear = "amx" if amx else "blocks" if isa.at_least("avx2") else "onednn"
    assert fast.layers[0].mlp.gate_up_proj.kernel == linear
    # a kernel that streams the weights takes the LM head too; oneDNN's layout gains nothing there
    assert type(fast.lm_head) is (torch.nn.Linear if linear == "onednn" else PackedLinear)
    assert type(plain.layers[0].mlp.gate_up_proj) is torch.nn.Linear
    got, base = compare_logits(fast.logits(ids)[0], ref), compare_logits(plain.logits(ids)[0], ref)
    assert base["mean_kl"] > 0  # bfloat16 does move the logits: the comparison has something to measure
    assert got["mean_kl"] <= 1.5 * base["mean_kl"] + 1e-4 and got["top1"] >= base["top1"] - 0.05, (got, base)


@pytest.mark.parametrize("amx", AMX_MODES)
def test_bfloat16_chunks_after_cached_tokens_match_a_whole_prompt_pass(embedded_artifact, amx):
    """Chunked prefill in bfloat16: every chunk after the first attends to the tokens cached before
    it, through the AMX chunk kernel where AMX is on, the AVX-512 BF16 one where it is off (gather +
    padded SDPA on CPUs without those instructions). Its prompt logprobs, against one float32 pass
    over the whole prompt, must be as close as the plain torch path's chunked ones.

    The kernels compute attention differently from torch's SDPA (bfloat16 probabilities, another
    order of additions), so a bfloat16 SDPA pass is no reference for them: float32 is. Measured over
    4 texts of 300 tokens: mean |delta logprob| 0.034-0.041 for the kernels, 0.037-0.042 for torch.
    Where the linears and the attention are both AVX-512 BF16's kernels, or both AMX tiles', every
    row is computed the same way whatever chunk it is in: the chunked logprobs equal the whole-prompt
    ones bit for bit."""
    import random

    from pydoc_data.topics import topics

    text = "".join(topics.values())
    start = random.randrange(len(text) - 3000)
    reference = LLM(embedded_artifact, dtype="float32", kernels="torch", kv_cache_memory=64 << 20)
    ids = reference.tokenizer.encode(text[start:start + 3000])[:150]
    dense = reference.engine.model.logits(torch.tensor([ids]))[0].float().log_softmax(-1)
    want = torch.tensor([dense[j - 1, ids[j]].item() for j in range(1, len(ids))])
    diffs, logprobs = {}, {}
    for kernels, budget in (("cpp", 32), ("torch", 32), ("cpp", None)):
        llm = LLM(embedded_artifact, dtype="bfloat16", kernels=kernels, amx=amx if kernels == "cpp" else None,
                  kv_cache_memory=64 << 20, **({"max_num_batched_tokens": budget} if budget else {}))
        described = llm.engine.kernels.describe(torch.bfloat16)
        print(kernels, budget, described)
        want_kernel = "torch-sdpa" if kernels == "torch" else "amx" if amx else (
            bf16_attention.name() if bf16_attention.load() is not None else "torch-sdpa")
        assert described["chunk_attention"] == want_kernel
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        if budget:
            assert llm.engine.stats["steps"] >= 150 // 32  # the prompt went in chunks
        got = torch.tensor([out.prompt_logprobs[j]["logprob"] for j in range(1, len(ids))])
        logprobs[kernels, budget], diffs[kernels, budget] = got, (got - want).abs()
    torch_mean = diffs["torch", 32].mean()
    assert 0 < torch_mean < 0.1  # bfloat16 against float32, summed over 30 layers
    assert diffs["cpp", 32].mean() <= 1.5 * torch_mean + 0.01, diffs
    # the tail, past single tokens: one low-confidence token can move ~0.4 in bfloat16 on either path (seed
    # 721202339: the kernels' largest 0.378 where torch's was 0.160, the same at b64cff8 and after it)
    tail = {path: d.quantile(0.95) for path, d in diffs.items()}
    print("95th percentile |delta logprob|", tail, "largest", {path: d.max() for path, d in diffs.items()})
    assert tail["cpp", 32] <= 2 * tail["torch", 32] + 0.05, diffs
    assert diffs["cpp", 32].max() < 0.5, diffs
    if described["chunk_attention"] in ("avx512bf16", "avx512", "avx2", "amx") and described["linear"] in ("blocks", "amx"):
        assert torch.equal(logprobs["cpp", 32], logprobs["cpp", None])
