"""Sliding-window attention (Mistral, Phi-3, Qwen2/Qwen3 with use_sliding_window): a query at position p
sees positions p - window + 1 .. p in a sliding layer. Checked against transformers on inputs several
windows long, through the engine (chunked prefill, prefix-cache hits, preemption, the C++ decode kernel
and the SDPA fallback), and the KV memory: with every layer sliding, a sequence holds about window /
block_size blocks however long it grows."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from conftest import agree_until_a_near_tie, hf_greedy
from test_families import COMMON, VOCAB, _build, _tokenizer
from infer.runtime import LLM, SamplingParams
from infer.runtime.engine.block_manager import GIVEN_BACK
from infer.runtime.model import ModelConfig, load_model

WINDOW = 40  # not a multiple of the 16-token block: a window starts inside a block
PROMPT, NEW_TOKENS = 100, 64


def _config(case: str) -> transformers.PretrainedConfig:
    if case == "mistral":  # every layer slides
        return transformers.MistralConfig(**COMMON, head_dim=32, sliding_window=WINDOW, rope_theta=10000.0)
    if case == "mistral-long":  # the same with room for sixteen windows
        return transformers.MistralConfig(**{**COMMON, "max_position_embeddings": 1024}, head_dim=32,
                                          sliding_window=WINDOW, rope_theta=10000.0)
    if case == "qwen2-mixed":  # layer 0 full, layer 1 sliding (max_window_layers)
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                        rope_theta=10000.0)
    if case == "phi3":  # Phi-3 mini 4k's shape of window (its config says 2047 of 4096), fused checkpoint
        return transformers.Phi3Config(**COMMON, sliding_window=WINDOW, rope_theta=10000.0, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0)
    raise ValueError(case)


def _checkpoint(path, case: str) -> transformers.PreTrainedModel:
    cfg = _config(case)
    cfg.initializer_range = 0.05  # attention far from uniform, so a wrong window shows in the logits
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    _tokenizer(path)
    return model


@pytest.mark.parametrize("case", ["mistral", "qwen2-mixed", "phi3"])
def test_windowed_model_matches_transformers(tmp_path, case):
    ref = _checkpoint(tmp_path / "src", case)
    artifact = _build(tmp_path, tmp_path / "src")
    cfg = ModelConfig.from_dir(artifact)
    want_layers = (None, WINDOW) if case == "qwen2-mixed" else (WINDOW, WINDOW)
    assert cfg.layer_windows == want_layers

    ours = load_model(artifact)
    ids = torch.randint(0, VOCAB, (2, random.randint(3 * WINDOW, 200)))
    with torch.no_grad():
        want = ref(ids).logits
        full = transformers.AutoModelForCausalLM.from_config(
            type(ref.config)(**{**ref.config.to_dict(), "sliding_window": None, "use_sliding_window": False,
                                "layer_types": ["full_attention"] * ref.config.num_hidden_layers}),
            dtype=torch.float32).eval()
        full.load_state_dict(ref.state_dict())
        unwindowed = full(ids).logits
    got = ours.logits(ids)
    err = (got - want).abs().max().item()
    print(case, "length", ids.shape[1], "max |logit diff|", err, "vs a full-attention model",
          (unwindowed - want).abs().max().item())
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err
    assert (unwindowed - want).abs().max().item() > 100 * err  # the window changes the logits

    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    for kernels in ("cpp", "torch"):  # the C++ decode kernel with starts; gather + SDPA with a window mask
        blocks = 14  # three sequences of PROMPT + NEW_TOKENS: whole, 30 blocks; windowed, about 6 each
        if case == "qwen2-mixed":
            blocks = 20  # a full layer keeps every block: some sequences wait or are preempted
        llm = LLM(artifact, max_num_batched_tokens=48, max_num_seqs=3, kv_cache_memory=blocks * per_block,
                  kernels=kernels)
        engine = llm.engine
        shared = [random.randrange(VOCAB) for _ in range(64)]
        prompts = [shared + [random.randrange(VOCAB) for _ in range(PROMPT - 64)] for _ in range(3)]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, NEW_TOKENS), (case, kernels)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert engine.block_manager.prefix_hits > 0, (case, kernels)
        if case == "qwen2-mixed":
            assert engine.window is None and engine.scheduler.num_preemptions > 0
        else:
            assert engine.window == WINDOW


def test_blocks_left_behind_by_the_window_are_given_back(tmp_path):
    """Every layer sliding: a sequence of 16 windows holds at most its window, a chunk and two part-filled
    blocks, and the blocks before its window are in the free pool (their K/V cached by hash for a prefix hit);
    a 16-block cache serves it in full, although its tokens would take 40."""
    _checkpoint(tmp_path / "src", "mistral-long")
    artifact = _build(tmp_path, tmp_path / "src")
    cfg = ModelConfig.from_dir(artifact)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(artifact, max_num_batched_tokens=32, max_num_seqs=2, kv_cache_memory=16 * per_block,
              max_model_len=640)
    engine = llm.engine
    assert engine.max_request_tokens == 640  # not 16 x 16: the window bounds what a sequence holds
    seq = engine.add_request("long", [random.randrange(VOCAB) for _ in range(100)],
                             SamplingParams(temperature=0, max_tokens=540, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if seq.block_table:
            live = [b for b in seq.block_table if b != GIVEN_BACK]
            held.append(len(live))
            first = seq.num_computed_tokens - WINDOW + 1  # the next position's window
            assert all(b == GIVEN_BACK for b in seq.block_table[:max(0, first // 16 - 1)])
    print("blocks held per step: max", max(held), "last", held[-1], "steps", len(held))
    assert len(seq.output_token_ids) == 540
    assert max(held) <= -(-(WINDOW + 32) // 16) + 2, max(held)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_config_windows_follow_transformers_layer_rule():
    """layer_types where listed, else Qwen's max_window_layers, else every layer; a window of at least
    max_position_embeddings is full attention; a bad window or layer type is refused naming the key."""
    from infer.runtime.model.families import UnsupportedConfig, layer_windows

    mistral = _config("mistral").to_dict()
    assert layer_windows(mistral) == (WINDOW, WINDOW)
    assert layer_windows({**mistral, "sliding_window": 4096}) is None
    qwen = {**_config("qwen2-mixed").to_dict()}
    assert layer_windows(qwen) == (None, WINDOW)
    assert layer_windows({**qwen, "use_sliding_window": False}) is None
    assert layer_windows({**qwen, "layer_types": None, "max_window_layers": 0}) == (WINDOW, WINDOW)
    with pytest.raises(UnsupportedConfig, match=r"layer_types=\['full_attention'\] is not supported; supported: 2 "
                                                r"entries of full_attention or sliding_attention"):
        ModelConfig.from_hf({**qwen, "layer_types": ["full_attention"]})
    with pytest.raises(UnsupportedConfig, match=r"sliding_window=0 is not supported; supported: null or a positive"):
        ModelConfig.from_hf({**mistral, "sliding_window": 0})
    assert json.loads(json.dumps(layer_windows(mistral))) == [WINDOW, WINDOW]


def test_the_one_call_step_honours_windows_as_the_layer_loop_does(tmp_path):
    """bfloat16 (the C++ step's dtype): a Mistral whose every layer slides and a Qwen2 with one full and one
    sliding layer run in the one-call step, which passes each sliding layer the rows' window starts: the
    tokens are the Python loop's (up to a near tie, which bfloat16 rounding may flip) and the logprobs agree to
    bfloat16 step noise, while the same step without the window is far off."""
    from infer.kernels import step_layers

    if step_layers.load() is None:
        pytest.fail("the C++ step failed to build on this CPU")
    for case in ("mistral", "qwen2-mixed"):
        _checkpoint(tmp_path / case / "src", case)
        artifact = _build(tmp_path / case, tmp_path / case / "src", "bfloat16")
        llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", enable_prefix_caching=False)
        model = llm.engine.model
        assert model.step_path.startswith("fused C++ step"), model.step_path
        step = model.fused_step
        prompts = [[random.randrange(VOCAB) for _ in range(random.randint(2 * WINDOW, 150))] for _ in range(2)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
        got, want = (_outputs(llm, prompts, params, s) for s in (step, None))
        off = agree_until_a_near_tie(got, want)
        windows = step.window_layers
        step.window_layers = torch.zeros_like(windows)  # the same step attending to the whole context
        wrong = _outputs(llm, prompts, params, step)
        step.window_layers = windows
        wrong_off = max(abs(a["logprob"] - b["logprob"]) for w, r in zip(wrong, want)
                        for a, b in zip(w.logprobs, r.logprobs))
        print(case, "fused - loop", off, "unwindowed - loop", wrong_off)
        assert off < 0.05, off
        assert wrong_off > max(0.1, 4 * off), "the C++ step did not apply the window"


def _outputs(llm, prompts, params, fused_step):
    llm.engine.model.fused_step = fused_step  # None: the Python layer loop
    return llm.generate(prompts, params)


def test_tensor_parallel_ranks_attend_within_the_window(tmp_path):
    """tp=2: the step message carries the decode rows' window starts to the other rank (the header says
    they follow), so both ranks attend within the window: greedy tokens equal transformers'."""
    ref = _checkpoint(tmp_path / "src", "mistral")
    artifact = _build(tmp_path, tmp_path / "src", "float32", "parallel.tp=2")
    prompts = [[random.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(2)]
    with LLM(artifact, dtype="float32", kv_cache_memory=8 << 20, tuning="off", max_num_batched_tokens=48) as llm:
        assert llm.engine.window == WINDOW and len(llm.engine.ranks.procs) == 1
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, 24)
