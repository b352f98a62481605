"""Every model family (tests/test_families.py's cases) built quantized (GPTQ W4A16) and sharded (tp=2), each
checked against transformers: the W4A16 artifact is a compressed-tensors checkpoint that transformers loads
itself, so both sides compute the same integer weights; a tp=2 build's logits (every rank taking part) and
greedy tokens against the float model's, and a quantized tp=2 build against transformers on the checkpoint its
quantize stage wrote; Gemma 3's text model (gemma3_text, tests/test_gemma3.py's family) in a shape whose KV heads
split over two ranks. What cannot be sharded (a KV head per rank at least) is refused before quantizing, and a
family these stages have no rule for before any stage."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import agree_until_a_near_tie, hf_greedy
from infer.pipeline.config import compose_recipe
from infer.pipeline.quantize import ONE_PLUS_NORMS, QUANTIZABLE, QuantError, hf_attention
from infer.pipeline.quantize import plan as quant_plan
from infer.pipeline.shard import SHARDABLE, ShardError, check_tp
from infer.pipeline.stage import BuildError
from infer.runtime import LLM, SamplingParams
from infer.runtime.model import load_model
from infer.runtime.model.families import FAMILIES
from infer.runtime.model.quant_linear import INT4_CPU_BACKENDS, disabled_backends, quantized_modules
from test_families import (CASES, COMMON, CONTEXT, INIT, ORIGINAL, PROMPT, VOCAB, WINDOW, _build, _checkpoint,
                           _tokenizer)
from test_families import _config as _family_config
from test_gemma3 import _model as _gemma3_model

GEMMA3 = "gemma3"  # this file's Gemma 3 case (tests/test_gemma3.py's has one KV head, Gemma 3 1B's: no tp=2)


def _config(case: str) -> transformers.PretrainedConfig:
    """tests/test_families.py's config of ``case``, or Gemma 3's text model with two KV heads (one per rank):
    a sliding layer (default rope of theta 1e4, the window shorter than the inputs) and a full one (linear
    scaling, theta 1e6), so a rank turning q/k with the wrong rotary shows; query_pre_attn_scalar apart from
    head_dim; a final soft-cap low enough to bend the logits at _source's weights (Gemma 3 has no attention
    soft-cap: runtime/model/families.py refuses one)."""
    if case != GEMMA3:
        return _family_config(case)
    return transformers.Gemma3TextConfig(
        **COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})



# W4A16 in groups of 16 (divides every layer's input, and each rank's half of o_proj's and down_proj's), a few
# seconds of calibration; the LM head stays float (the layer that dominates a tiny model's logits)
QUANT = ("quant.bits=4", "quant.group_size=16", "quant.ignore=[lm_head]", "calib.samples=4",
         "calib.seq_len=32")
# the families the quantize and shard stages take (every case of tests/test_families.py, and Gemma 3's); Gemma's
# case has one KV
# head (Gemma 2B's): it cannot be split over two ranks (test_tp_that_splits_a_kv_head_is_refused_...)
QUANT_CASES = [c for c in [*CASES, GEMMA3] if _config(c).model_type in QUANTIZABLE]
TP_CASES = [c for c in QUANT_CASES if _config(c).model_type in SHARDABLE and _config(c).num_key_value_heads % 2 == 0]
NEW_TOKENS = 24


def _quant(tmp_path, method: str = "gptq") -> list[str]:
    """QUANT with calibration text in the test tokenizer's words ("t17 t203 ..."): varied tokens to calibrate on."""
    data = tmp_path / "calib.txt"
    data.write_text("\n\n".join(" ".join(f"t{random.randrange(VOCAB)}" for _ in range(100)) for _ in range(8)))
    return [f"quant.method={method}", *QUANT, f"calib.data={data}"]


def _source(tmp_path, case: str) -> transformers.PreTrainedModel:
    """tests/test_families.py's checkpoint of ``case`` at its weights' scale (Gemma 2's bends its soft-caps), or
    Gemma 3's (tests/test_gemma3.py's random weights: std 0.1, norms around 0) under ``_config``."""
    if case != GEMMA3:
        return _checkpoint(tmp_path / "src", case, INIT.get(case, 0.02))
    model = _gemma3_model(_config(case), 0.1)
    model.save_pretrained(tmp_path / "src")
    _tokenizer(tmp_path / "src")
    return model


def _reference(artifact) -> transformers.PreTrainedModel:
    """transformers on a written checkpoint, computing its family as the runtime does (Gemma 2 and 3: eager
    attention, the one that soft-caps)."""
    config = json.loads((artifact / "config.json").read_text())
    return transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32,
                                                             **hf_attention(config)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, random.randint(ORIGINAL + 20, CONTEXT)))


def _served(artifact, ids: torch.Tensor, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """A tp=2 artifact served in float32: its whole-sequence logits (every rank taking part) and greedy tokens
    through the engine (prompts past the original context, chunked)."""
    with LLM(artifact, dtype="float32", kv_cache_memory=8 << 20, tuning="off", max_num_batched_tokens=48) as llm:
        model = llm.engine.model
        assert len(llm.engine.ranks.procs) == 1 and model.fused_step is None
        assert model.step_path.startswith("python layer loop: a tensor-parallel rank"), model.step_path
        logits = model.logits(ids)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return logits, [o.token_ids for o in outs]


def _prompts() -> list[list[int]]:
    return [[random.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(2)]


# AWQ too, one case of each family whose norms are plain weights (AWQ scales them; llm-compressor's mappings:
# Llama's for llama, qwen2, qwen3, mistral, Phi-3's own for its fused qkv_proj / gate_up_proj)
AWQ_CASES = ["llama3", "qwen2-yarn", "qwen3", "mistral", "phi4-partial"]
assert {_config(c).model_type for c in AWQ_CASES} == set(QUANTIZABLE) - set(ONE_PLUS_NORMS)


@pytest.mark.parametrize("case,method", [(c, "gptq") for c in QUANT_CASES] + [(c, "awq") for c in AWQ_CASES])
def test_w4a16_build_matches_transformers_on_its_checkpoint(tmp_path, case, method):
    float_model = _source(tmp_path, case)
    artifact = _build(tmp_path, tmp_path / "src", "float32", *_quant(tmp_path, method))
    q = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert json.loads((artifact / "manifest.json").read_text())["quantize"]["method"] == method
    ref = _reference(artifact)
    ids = _ids()
    with torch.no_grad():
        want, unquantized = ref(ids).logits, float_model(ids).logits
    scale = want.abs().max().item()

    # the same integer weights computed in float32 by plain torch ops: only the layout can differ
    with disabled_backends(*INT4_CPU_BACKENDS):
        exact = load_model(artifact, torch.float32, "torch")
        floor_model = load_model(artifact, torch.bfloat16, "torch")
    assert list(quantized_modules(exact).values()) == ["dequant"] * (4 * exact.config.num_layers)
    exact_err = (exact.logits(ids) - want).abs().max().item()
    # as served (bfloat16, the int4 kernels), against plain torch ops in bfloat16 on the same weights
    served = load_model(artifact)
    assert served.dtype == torch.bfloat16 and set(quantized_modules(served).values()) <= {*INT4_CPU_BACKENDS, "dequant"}
    served_err = (served.logits(ids) - want).abs().max().item()
    floor = (floor_model.logits(ids) - want).abs().max().item()
    effect = (want - unquantized).abs().max().item()
    print(case, method, "length", ids.shape[1], "logit scale", scale, "| float32 dequant", exact_err, "| served",
          set(quantized_modules(served).values()), served_err, "| bf16 torch floor", floor, "| int4 vs float", effect)
    assert exact_err < 1e-5 * max(1.0, scale), exact_err  # measured: 0 to 5e-7
    assert served_err < 3 * floor + 2e-3, (served_err, floor)  # measured: served 4e-3 to 7e-3 (gemma2 0.04, floor 0.04)
    assert effect > 100 * max(exact_err, 1e-6), "the artifact's weights are not the quantized ones"
    if method == "awq":  # where its grid search found a scale better than none, that scale is in a norm
        src, out = load_file(tmp_path / "src" / "model.safetensors"), load_file(artifact / "model.safetensors")
        print("norms AWQ scaled:", [n for n in src if "norm" in n and not torch.equal(src[n], out[n])])


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_build_matches_transformers(tmp_path, case):
    ref = _source(tmp_path, case)
    artifact = _build(tmp_path, tmp_path / "src", "float32", "parallel.tp=2")
    layout = json.loads((artifact / "tensor_parallel.json").read_text())["tensors"]
    cfg = _config(case)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = "model.layers.0.self_attn."
    if cfg.model_type == "phi3":  # fused in the checkpoint: each rank gets its q, k and v heads, its gate and up
        assert layout[attn + "qkv_proj.weight"]["split"] == "column_parts"
        assert layout[attn + "qkv_proj.weight"]["parts"] == [cfg.num_attention_heads * d,
                                                               cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]
        assert layout["model.layers.0.mlp.gate_up_proj.weight"]["parts"] == [cfg.intermediate_size] * 2
    if cfg.model_type in ("qwen3", "gemma3_text"):  # per head: every rank's heads take the same weights
        assert layout[attn + "q_norm.weight"]["split"] == layout[attn + "k_norm.weight"]["split"] == "replicated"
    if cfg.model_type in ("gemma2", "gemma3_text"):  # sandwich norms: every rank applies them to the summed output
        for norm in ("post_attention", "pre_feedforward", "post_feedforward"):
            assert layout[f"model.layers.1.{norm}_layernorm.weight"]["split"] == "replicated"

    ids, prompts = _ids(), _prompts()
    with torch.no_grad():
        want = ref(ids).logits
    got, tokens = _served(artifact, ids, prompts)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(case, "tp=2 float32: length", ids.shape[1], "max |logit diff|", err, "logit scale", scale)
    assert err < 1e-5 * max(1.0, scale), err  # measured: 2e-7 to 5e-7, gemma2 3e-6 at scale 2.8 (the sums' order)
    assert tokens == hf_greedy(ref, prompts, NEW_TOKENS)


@pytest.mark.parametrize("case,symmetric", [("phi4-partial", False), ("llama-bias-dynamic", True), ("qwen3", True),
                                            ("gemma2", True), (GEMMA3, True)])
def test_w4a16_tp2_matches_transformers_on_the_quantized_checkpoint(tmp_path, monkeypatch, case, symmetric):
    """Quantized, then sharded: Phi-4-mini's fused int4 qkv_proj (values, group scales, asymmetric zero points
    packed 8 to a word along the output) split per part with its partial rotary reordered per rank, Llama's
    row-parallel biases counted once, Qwen3's q/k norms, Gemma 2's soft-caps, scale, sandwich norms and windows on
    every rank, Gemma 3's (1 + weight) q/k norms and its sliding layers' own rotary. Every rank dequantizes (int4
    kernels off), so the float32 logits must equal transformers' on the checkpoint the quantize stage wrote, up to the order of sums."""
    _source(tmp_path, case)
    quant = [*_quant(tmp_path), f"quant.symmetric={str(symmetric).lower()}"]
    assert _build(tmp_path, tmp_path / "src", "float32", *quant) == tmp_path / "out"
    single = shutil.move(tmp_path / "out", tmp_path / "tp1")
    ref = _reference(single)
    artifact = _build(tmp_path, tmp_path / "src", "float32", "parallel.tp=2", *quant)  # same cache: same quantize
    stages = [json.loads((a / "manifest.json").read_text())["stages"] for a in (single, artifact)]
    assert stages[0]["quantize"] == stages[1]["quantize"] and "shard" in stages[1]
    layout = json.loads((artifact / "tensor_parallel.json").read_text())["tensors"]
    column = [t["split"] for n, t in layout.items()
              if re.search(r"\.(qkv|q|gate_up|up)_proj\.weight_(packed|scale)$", n)]
    assert len(column) == 4 * 2 and set(column) == {"column_parts" if case.startswith("phi") else "column"}
    zeros = [t for n, t in layout.items() if n.endswith("qkv_proj.weight_zero_point")]
    if not symmetric:  # int32 words of 8 zero points: q, k, v parts of 64, 32, 32 rows are 8, 4, 4 words
        assert zeros and all(t["split"] == "column_parts" and t["parts"] == [8, 4, 4] for t in zeros), zeros

    monkeypatch.setenv("INFER_LINEAR_BACKENDS_DISABLE", ",".join(INT4_CPU_BACKENDS))  # inherited by rank 1
    ids, prompts = _ids(), _prompts()
    with torch.no_grad():
        want = ref(ids).logits
    got, tokens = _served(artifact, ids, prompts)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(case, "W4A16 tp=2, dequantized in float32: length", ids.shape[1], "max |logit diff|", err, "scale", scale)
    assert err < 1e-5 * max(1.0, scale), err
    assert tokens == hf_greedy(ref, prompts, NEW_TOKENS)


def test_bf16_tp2_ranks_decode_with_their_sums(tmp_path):
    """A rank's model runs the Python layer loop: the one-call C++ step has no all-reduce between layers, and a
    bfloat16 tp=2 build decoding on it (as it did before runtime/parallel/layers.py switched it off) gave
    logprobs 0.1 off the tp=1 build's on this test's model (measured, AVX2 host); summed: 2e-3, bfloat16 sums in
    another order."""
    _checkpoint(tmp_path / "src", "qwen2-yarn")
    _build(tmp_path, tmp_path / "src", "bfloat16")
    single = shutil.move(tmp_path / "out", tmp_path / "tp1")
    sharded = _build(tmp_path, tmp_path / "src", "bfloat16", "parallel.tp=2")
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=0)
    got = {}
    for name, artifact in (("tp1", single), ("tp2", sharded)):
        with LLM(artifact, kv_cache_memory=8 << 20, tuning="off") as llm:
            print(name, llm.engine.model.step_path)
            got[name] = llm.generate(prompts, params)
    # a random model's answers may part at a near tie (two tokens within 0.05, which sums in another order can
    # flip: seed 152224382's first tokens); up to there, and over every prompt token, the logprobs agree
    err = agree_until_a_near_tie(got["tp2"], got["tp1"], tie=0.05)
    prompt_err = max(abs(a["logprob"] - b["logprob"]) for g, w in zip(got["tp2"], got["tp1"])
                     for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]))
    print("bfloat16 tp=2 - tp=1 max |logprob diff|", err, "over the prompts", prompt_err)
    assert err < 2e-2 and prompt_err < 2e-2, (err, prompt_err)


@pytest.mark.parametrize("case,tp,match", [
    ("qwen3", 4, r"parallel.tp=4: num_key_value_heads=2 is not divisible by 4 \(each rank needs whole KV heads\).*"
                 r"\[1, 2\]"),
    ("gemma", 2, r"parallel.tp=2: num_key_value_heads=1 is not divisible by 2 .*: \[1\]"),
])
def test_tp_that_splits_a_kv_head_is_refused_before_quantizing(tmp_path, case, tp, match):
    """Replaces tests/test_families.py's Qwen3 refusal: every family shards now, but not into part of a KV
    head; a local checkpoint's build stops before any stage, naming the sizes that would work."""
    _checkpoint(tmp_path / "src", case)
    with pytest.raises(BuildError, match=match):
        _build(tmp_path, tmp_path / "src", "float32", f"parallel.tp={tp}", *_quant(tmp_path))
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").glob("stages/*/*")), "a stage ran"  # a local source: before the load stage


def test_a_family_the_stages_have_no_rule_for_is_refused_naming_the_known_ones(tmp_path):
    """Every family the runtime serves quantizes and shards (this file's cases); another model_type (Gemma 3's
    multimodal checkpoint, which the runtime refuses too) is refused by both stages by name."""
    assert set(QUANTIZABLE) == set(SHARDABLE) == set(FAMILIES)
    cfg = {**_config("gemma2").to_dict(), "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    with pytest.raises(ShardError, match=r"parallel.tp=2: sharding knows model_type llama, qwen2, qwen3, mistral, "
                                         r"phi3, gemma, gemma2, gemma3_text, not Gemma3ForConditionalGeneration "
                                         r"\(model_type 'gemma3'\); build it with parallel.tp=1"):
        check_tp(cfg, 2)
    recipe = compose_recipe([f"model.source={tmp_path}", *_quant(tmp_path)])
    with pytest.raises(QuantError, match=r"quant.method=gptq: model_type 'gemma3' is not supported; supported: "
                                         r"llama, qwen2, qwen3, mistral, phi3, gemma, gemma2, gemma3_text; build it "
                                         r"with quant=none"):
        quant_plan(recipe, cfg)


@pytest.mark.parametrize("case,method", [(c, m) for c in ("gemma", "gemma2", GEMMA3) for m in ("awq", "w8a8")])
def test_gemma_refuses_smoothing_methods_before_calibrating(tmp_path, case, method):
    """AWQ and SmoothQuant fold scales into a norm's weight, which Gemma multiplies by as (1 + weight)."""
    _source(tmp_path, case)
    model_type = _config(case).model_type
    with pytest.raises(BuildError, match=rf"quant.method={method}: .* folds its scales into the RMSNorm weights, "
                                         rf"which model_type '{model_type}' applies as \(1 \+ weight\).*use "
                                         r"quant.method=gptq"):
        _build(tmp_path, tmp_path / "src", "float32", f"quant.method={method}", "quant.bits=4" if method == "awq"
               else "quant.bits=8", "quant.group_size=16" if method == "awq" else "quant.group_size=-1")
    assert not list((tmp_path / "cache").glob("stages/*/*")), "a stage ran"  # a local source: before the load stage


@pytest.mark.parametrize("case,per_layer", [("gemma2", 4), (GEMMA3, 6)])
def test_quantize_gives_back_one_plus_norms_as_they_were(tmp_path, case, per_layer):
    """llm-compressor's oneshot turns every (1 + weight) norm into a plain one and back in the checkpoint's dtype
    (modeling/offset_norm.py): in bfloat16 that rounds a weight to 1 + weight's coarser steps. GPTQ smooths
    nothing, so the quantize stage writes the source's norms back, bit for bit (Gemma 3's q/k norms too)."""
    _source(tmp_path, case)
    artifact = _build(tmp_path, tmp_path / "src", "bfloat16", *_quant(tmp_path))
    src, out = load_file(tmp_path / "src" / "model.safetensors"), load_file(artifact / "model.safetensors")
    norms = [n for n in src if n.endswith("norm.weight")]
    moved = {n: (out[n].float() - src[n].to(torch.bfloat16).float()).abs().max().item() for n in norms}
    print("norm weights moved by the quantize stage:", moved)
    assert len(norms) == per_layer * 2 + 1 and not any(moved.values())
