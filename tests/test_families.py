"""The model families users bring (runtime/model/families.py), each built by infer-build from a small
random-weight checkpoint made with transformers' own config class and checked against transformers:
logits in float32 on inputs longer than the rope scaling's original context, and greedy tokens through
the engine (chunked prefill, prefix caching, preemption). Unsupported keys are refused before any work."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from conftest import REPO, greedy_gaps, hf_greedy, run_cli
from infer.kernels import isa, step_layers
from infer.pipeline.build import build
from infer.pipeline.config import compose_recipe
from infer.runtime import LLM, SamplingParams
from infer.runtime.model import ModelConfig, load_model
from infer.runtime.model.families import FAMILIES, UnsupportedConfig, check_config, markdown_table

VOCAB, ORIGINAL, CONTEXT = 320, 64, 256  # original_max_position_embeddings: test inputs go past it
PROMPT, NEW_TOKENS = 80, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=CONTEXT, rms_norm_eps=1e-5)


def _config(case: str) -> transformers.PretrainedConfig:
    """One config per family, with that family's special keys set."""
    if case == "llama3":  # Llama 3.1-shaped rotary scaling
        return transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    if case == "llama-bias-dynamic":  # attention and MLP biases, dynamic NTK (default rope within the context)
        return transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if case == "qwen2-yarn":  # Qwen2.5's long-context recipe
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    if case == "qwen3":  # q/k norms, head_dim apart from hidden / heads, linear scaling
        return transformers.Qwen3Config(**COMMON, head_dim=32, rope_parameters={
            "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0})
    if case == "mistral":  # explicit head_dim; a window no smaller than the context
        return transformers.MistralConfig(**COMMON, head_dim=32, sliding_window=CONTEXT, rope_theta=1000000.0)
    if case == "phi3-longrope":  # Phi-3 128k's rotary scaling; the checkpoint stores qkv and gate_up fused
        half = 16 // 2
        return transformers.Phi3Config(**COMMON, original_max_position_embeddings=ORIGINAL, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.0 + 2.0 * i for i in range(half)]})
    if case == "phi4-partial":  # Phi-4-mini's shape: rotary over part of each head (here half), longrope on it
        quarter = 16 // 4
        return transformers.Phi3Config(**COMMON, original_max_position_embeddings=ORIGINAL, bos_token_id=1,
                                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(quarter)],
            "long_factor": [1.0 + 2.0 * i for i in range(quarter)]})
    if case == "gemma":  # GeGLU, embeddings times sqrt(hidden) (48: not a round float), (1 + weight) norms,
        # head_dim 256 apart from hidden / heads, one KV head (Gemma 2B's), tied head
        return transformers.GemmaConfig(**{**COMMON, "hidden_size": 48, "num_key_value_heads": 1}, head_dim=256,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if case == "gemma2":  # sliding (layer 0) and full (layer 1) layers, a window shorter than the inputs; both
        # soft-caps low enough to bend the scores and logits of _checkpoint's weights (GEMMA2_INIT); the attention
        # scale from query_pre_attn_scalar (24), not head_dim (32); sandwich norms
        return transformers.Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(case)


CASES = ["llama3", "llama-bias-dynamic", "qwen2-yarn", "qwen3", "mistral", "phi3-longrope", "phi4-partial", "gemma",
         "gemma2"]
WINDOW = 24  # gemma2's sliding window: test prompts and inputs run past it
INIT = {"gemma2": 0.1}  # weights' std where 0.02 would leave the soft-caps idle


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer.json over the whole vocabulary (token i is "t{i}"): the engine needs one."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def _checkpoint(path: Path, case: str, init: float = 0.02) -> transformers.PreTrainedModel:
    """A random float32 model of ``case`` saved as safetensors; norms and biases random too (HF sets them
    to ones and zeros, which would hide a missing or misplaced one). ``init``: the weights' std."""
    cfg = _config(case)
    cfg.initializer_range = init
    # transformers' SDPA attention drops attn_logit_softcapping (only its eager attention caps): eager there
    eager = {"attn_implementation": "eager"} if FAMILIES[cfg.model_type].softcaps else {}
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **eager).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:  # Gemma stores weight - 1 (its RMSNorm scales by 1 + weight)
                p.normal_(0.0 if FAMILIES[cfg.model_type].norm_offset else 1.0, 0.3)
    model.save_pretrained(path)
    _tokenizer(path)
    return model


def _build(tmp_path: Path, src: Path, dtype: str = "float32", *extra: str) -> Path:
    return build(compose_recipe([f"model.source={src}", f"model.dtype={dtype}", "tune.enabled=false",
                                 "eval.enabled=false", "artifact.name=tiny", f"output_dir={tmp_path / 'out'}",
                                 f"cache_dir={tmp_path / 'cache'}", *extra])).artifact


@pytest.mark.parametrize("case", CASES)
def test_family_builds_and_matches_transformers(tmp_path, case):
    ref = _checkpoint(tmp_path / "src", case, INIT.get(case, 0.02))
    artifact = _build(tmp_path, tmp_path / "src")
    config = json.loads((artifact / "config.json").read_text())
    for key in ("rope_parameters", "head_dim", "sliding_window", "attention_bias", "mlp_bias"):
        assert config.get(key) == json.loads((tmp_path / "src" / "config.json").read_text()).get(key), key

    # logits on fresh inputs past the original context, float32 both sides
    ours = load_model(artifact)
    ids = torch.randint(0, VOCAB, (2, random.randint(ORIGINAL + 20, CONTEXT)))
    with torch.no_grad():
        want = ref(ids).logits
    got = ours.logits(ids)
    err = (got - want).abs().max().item()
    print(case, "length", ids.shape[1], "max |logit diff|", err, "logit scale", want.abs().max().item())
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err  # measured: 2e-7 to 5e-7 (gemma2: 3e-6 at logit scale 3)
    if FAMILIES[ref.config.model_type].softcaps:  # the triton decode kernel has no soft-cap: refused at load
        with pytest.raises(ValueError, match=r"attn_logit_softcapping=2.0, Gemma 2\) runs on the C\+\+ decode kernel "
                                             r"or torch SDPA; the triton decode kernel has no soft-cap yet"):
            load_model(artifact, kernels=lambda dtype: SimpleNamespace(backend="triton"))

    # greedy tokens through the engine: chunked prefill, shared prefixes (cache hits), preemption
    cfg = ModelConfig.from_dir(artifact)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    blocks = 16  # three sequences of PROMPT + NEW_TOKENS need 27: some must wait or be preempted
    llm = LLM(artifact, max_num_batched_tokens=48, max_num_seqs=3, kv_cache_memory=blocks * per_block)
    shared = [random.randrange(VOCAB) for _ in range(48)]
    prompts = [shared + [random.randrange(VOCAB) for _ in range(PROMPT - 48)] for _ in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, NEW_TOKENS)
    engine = llm.engine
    assert engine.block_manager.prefix_hits > 0 and engine.stats["steps"] > NEW_TOKENS
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.num_blocks


HAS_STEP = isa.at_least("avx2")


@pytest.mark.skipif(not HAS_STEP, reason="this CPU has no AVX2 + FMA: no C++ step to check")
@pytest.mark.parametrize("case,fused", [("qwen2-yarn", True), ("llama3", True), ("phi4-partial", True),
                                        ("qwen3", False), ("llama-bias-dynamic", False), ("gemma", False),
                                        ("gemma2", False)])
def test_fused_step_takes_scaled_rope_and_declines_what_it_lacks(tmp_path, case, fused):
    """The C++ step rotates with the model's own tables (YaRN's attention scaling and llama3's frequencies
    included): its tokens equal the Python loop's and its logprobs agree to bfloat16 step noise, while the
    same step given unscaled tables is far off. What it does not implement (q/k norms, o_proj and MLP
    biases) it declines, and the model says so (``model.step_path``).

    Not bit for bit: on this CPU class the C++ step and the Python loop differ by up to ~5e-5 in a logprob
    at some context lengths with default rope too (a plain Llama, measured), so that is not the tables."""
    from infer.runtime.model.llama import RotaryEmbedding

    assert step_layers.load() is not None, "the C++ step failed to build on a CPU that has AVX2 + FMA"
    _checkpoint(tmp_path / "src", case, init=0.2)  # weights large enough that attention moves the logits
    artifact = _build(tmp_path, tmp_path / "src", "bfloat16")
    # no prefix caching: the second run would start from the first's cached blocks, another path
    llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", enable_prefix_caching=False)
    model = llm.engine.model
    print(case, model.step_path)
    if not fused:
        assert model.fused_step is None
        assert re.search(r"python layer loop: (q/k norms|an o_proj bias|hidden_act gelu_pytorch_tanh \(GeGLU MLP\)|"
                         r"Gemma 2's sandwich norms, attention soft-cap and query_pre_attn_scalar)", model.step_path), \
            model.step_path
        return
    step = model.fused_step
    assert step is not None and step.rotary is model.rotary and model.step_path.startswith("fused C++ step")
    prompts = [[random.randrange(VOCAB) for _ in range(random.randint(ORIGINAL + 5, 100))] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)

    def logprobs(fused_step):
        model.fused_step = fused_step
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], torch.tensor([[a["logprob"] for a in o.logprobs] for o in outs])

    (got_ids, got), (want_ids, want) = logprobs(step), logprobs(None)
    assert got_ids == want_ids
    off = (got - want).abs().max().item()
    print("fused - loop", off)
    # bfloat16 step noise: the two paths round a few intermediates differently, and with weights this large a
    # logprob moves by up to ~0.03 at some seeds (measured 0.025 at seed 285101226, before and after the
    # sliding-window change); tables that are wrong move it by far more
    assert off < 0.05, off
    cfg = model.config
    step.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                  rotary_dim=cfg.rotary_dims)  # unscaled
    _, wrong = logprobs(step)
    print("unscaled - loop", (wrong - want).abs().max().item())
    assert (wrong - want).abs().max() > max(0.1, 4 * off), "the C++ step did not use the tables it was given"


def test_rope_scaling_matches_transformers_tables():
    """cos/sin (attention scaling folded in) for every rope type against transformers' rotary module; with a
    partial rotary, the turned pairs' columns match and the passed dims' pairs are cos 1, sin 0."""
    from infer.runtime.model.llama import RotaryEmbedding

    for case in CASES:
        hf_cfg = _config(case)
        cfg = ModelConfig.from_hf(hf_cfg.to_dict())
        ours = RotaryEmbedding.for_config(cfg)
        rotary = transformers.AutoModelForCausalLM.from_config(hf_cfg).model.rotary_emb
        positions = torch.arange(CONTEXT)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        half, r = cfg.head_dim // 2, cfg.rotary_dims // 2
        turned = torch.cat([torch.arange(r), torch.arange(half, half + r)])
        assert cos.shape[-1] == 2 * r and (r < half) == (case == "phi4-partial"), case
        assert torch.allclose(ours.cos[:, turned], cos[0], atol=1e-6, rtol=1e-6), case
        assert torch.allclose(ours.sin[:, turned], sin[0], atol=1e-6, rtol=1e-6), case
        passed = torch.ones(cfg.head_dim, dtype=torch.bool)
        passed[turned] = False
        assert (ours.cos[:, passed] == 1).all() and (ours.sin[:, passed] == 0).all(), case


@pytest.mark.parametrize("key,value,match", [
    ("sliding_window", 0, r"sliding_window=0 is not supported; supported: null or a positive number of tokens"),
    ("rope_parameters", {"rope_type": "foo", "rope_theta": 10000.0},
     r"rope_parameters.rope_type='foo' is not supported for model_type mistral; supported: default, linear, "
     r"dynamic, llama3, yarn, longrope"),
    ("hidden_act", "relu", r"hidden_act='relu' is not supported; supported: silu, gelu_pytorch_tanh, gelu"),
    ("model_type", "gemma3", r"model_type 'gemma3' is not supported yet: the vision tower and its image tokens are "
                             r"not implemented; supported: llama, qwen2, qwen3, mistral, phi3, gemma, gemma2, "
                             r"gemma3_text \(gemma: Gemma 1, gemma2: Gemma 2, gemma3_text: Gemma 3's text model, "
                             r"Gemma3ForCausalLM\)"),
    ("model_type", "falcon", r"model_type 'falcon' is not supported; supported: llama, qwen2, qwen3, mistral, phi3, "
                             r"gemma"),
    ("use_bidirectional_attention", True, r"use_bidirectional_attention=True is not supported; supported: null or "
                                          r"false \(causal\)"),
])
def test_unsupported_keys_are_refused_naming_key_and_values(key, value, match):
    cfg = _config("mistral").to_dict()
    cfg[key] = value
    with pytest.raises(UnsupportedConfig, match=match):
        check_config(cfg)
    with pytest.raises(UnsupportedConfig, match=match):
        ModelConfig.from_hf(cfg)


def test_gemma2_config_reads_as_transformers():
    """Gemma 2's keys as transformers reads them: without layer_types even layers slide (Gemma2Config's default,
    what the hub's config.json files rely on), the soft-caps and query_pre_attn_scalar default to the class's
    (50, 30, 256) and an explicit null turns a cap off; bad values are refused naming the key."""
    cfg = _config("gemma2").to_dict()
    want = transformers.Gemma2Config(**{**COMMON, "num_hidden_layers": 5}, sliding_window=WINDOW).layer_types
    bare = {k: v for k, v in cfg.items() if k not in ("layer_types", "attn_logit_softcapping",
                                                      "final_logit_softcapping", "query_pre_attn_scalar")}
    got = ModelConfig.from_hf({**bare, "num_hidden_layers": 5})
    assert got.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in want)
    assert (got.attn_softcap, got.final_softcap, got.query_pre_attn_scalar, got.attn_scale) == (50.0, 30.0, 256.0,
                                                                                                 256 ** -0.5)
    got = ModelConfig.from_hf({**cfg, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (got.attn_softcap, got.final_softcap, got.attn_scale) == (0.0, 0.0, 24 ** -0.5)
    assert got.sandwich_norms and got.hidden_act == "gelu_pytorch_tanh"
    for key, value in (("attn_logit_softcapping", 0), ("final_logit_softcapping", "30"), ("query_pre_attn_scalar", -1),
                       ("query_pre_attn_scalar", None)):
        with pytest.raises(UnsupportedConfig, match=rf"config.json {key}={value!r} is not supported; supported: a "
                                                    r"positive number"):
            check_config({**cfg, key: value})


def test_infer_build_refuses_before_any_stage(tmp_path):
    """A Mistral with an activation the runtime lacks: infer-build stops before the load stage (nothing
    cached, nothing published), naming the key, the value and what is supported."""
    src = tmp_path / "src"
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, hidden_act="relu"))
    model.save_pretrained(src)
    _tokenizer(src)
    run = run_cli("infer-build", f"model.source={src}", f"output_dir={tmp_path / 'out'}",
                  f"cache_dir={tmp_path / 'cache'}", "tune.enabled=false")
    print(run.stderr[-2000:])
    assert run.returncode == 1
    assert re.search(r"src: config.json hidden_act='relu' is not supported; supported: silu", run.stderr)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").glob("**/load*")), "a stage ran"


def test_gemma_rounds_as_transformers_in_bfloat16(tmp_path):
    """Gemma in bfloat16 rounds where transformers does: the scaled embeddings and every (1 + weight) norm bit
    for bit (a 1 + weight folded into a bfloat16 weight would not be), each activation as ACT2FN computes it.
    The C++ step declines GeGLU, so the Python layer loop runs it, on the C++ linears and paged attention
    where this CPU has them: its logits are transformers' bfloat16 ones to bfloat16 noise, and the engine's
    greedy tokens are transformers' float32 argmax to that noise."""
    from transformers.activations import ACT2FN

    from infer.runtime.model.families import HIDDEN_ACTS
    from infer.runtime.model.llama import ACTIVATIONS
    from infer.runtime.model.packed_linear import PackedLinear

    ref = _checkpoint(tmp_path / "src", "gemma")
    artifact = _build(tmp_path, tmp_path / "src", "bfloat16")
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    ours = load_model(artifact, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 100))
    scale = torch.tensor(ours.embed_scale, dtype=torch.bfloat16)
    assert torch.equal(ours.embed_tokens(ids) * scale, ref16.model.embed_tokens(ids))
    x = torch.randn(50, 48).mul(3).to(torch.bfloat16)
    for i, layer in enumerate(ours.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(layer, name)(x)[0], getattr(ref16.model.layers[i], name)(x)), (i, name)
    assert torch.equal(ours.norm(x)[0], ref16.model.norm(x))
    for act in HIDDEN_ACTS:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.randn(1000).mul(4).to(dtype)
            assert torch.equal(ACTIVATIONS[act](g), ACT2FN[act](g)), (act, dtype)
    with torch.no_grad():
        want = ref16(ids).logits.float()
    err = (ours.logits(ids) - want).abs().max().item()
    print("bfloat16: max |logit diff| vs transformers in bfloat16", err, "logit scale", want.abs().max().item())
    assert err < 0.03 * max(1.0, want.abs().max().item()), err  # measured 0.008; a norm without its 1 + is off by 1

    llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off")
    model = llm.engine.model
    print(model.step_path, model.kernels.describe())
    assert model.fused_step is None and model.step_path.startswith("python layer loop: hidden_act gelu_pytorch_tanh")
    if HAS_STEP:  # the C++ kernels this CPU has: bfloat16 linears, paged decode attention
        assert type(model.layers[0].self_attn.qkv_proj) is PackedLinear
        assert model.kernels.describe()["decode_attention"] == "cpp"
    prompts = [[random.randrange(VOCAB) for _ in range(random.randint(20, 90))] for _ in range(2)]
    for gap, off in greedy_gaps(llm, ref, prompts):
        assert gap < 0.05 and off < 0.05, (gap, off)


def test_gemma_config_keys():
    """Gemma's activation is hidden_activation where set (its configs pair hidden_act "gelu" with
    hidden_activation "gelu_pytorch_tanh"), else hidden_act, else transformers' default; the head is tied when
    config.json leaves it out."""
    cfg = {k: v for k, v in _config("gemma").to_dict().items() if k != "tie_word_embeddings"}
    assert ModelConfig.from_hf(cfg).tie_word_embeddings
    assert ModelConfig.from_hf({**cfg, "hidden_act": "gelu"}).hidden_act == "gelu"
    assert ModelConfig.from_hf({k: v for k, v in cfg.items() if k != "hidden_act"}).hidden_act == "gelu_pytorch_tanh"
    assert ModelConfig.from_hf({k: v for k, v in _config("llama3").to_dict().items() if k != "hidden_act"}).hidden_act \
        == "silu"
    both = {**cfg, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}
    assert ModelConfig.from_hf(both).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(UnsupportedConfig, match=r"hidden_activation='relu' is not supported; supported: silu, "):
        check_config({**both, "hidden_activation": "relu"})
    assert not ModelConfig.from_hf(_config("mistral").to_dict()).tie_word_embeddings


def test_phi3_aliases_and_family_declaration():
    cfg = _config("phi3-longrope").to_dict()
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "su"}
    assert ModelConfig.from_hf(cfg).rope_scaling["rope_type"] == "longrope"
    cfg["rope_parameters"]["rope_type"] = "llama3"
    with pytest.raises(UnsupportedConfig, match=r"supported: default, longrope, su \(= longrope\)"):
        ModelConfig.from_hf(cfg)
    assert set(FAMILIES) == {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text"}


def test_the_families_page_lists_families_from_the_declaration():
    readme = (REPO / "docs" / "families.md").read_text()
    start, end = "<!-- families: markdown_table() -->\n", "<!-- /families -->"
    assert start in readme and end in readme
    section = readme[readme.index(start) + len(start):readme.index(end)]
    assert section == markdown_table()


def test_merged_trtllm_config_keeps_rope_scaling():
    """pipeline/merge.py's HF config for a TensorRT-LLM checkpoint keeps its rotary scaling: the merged
    config gives the same rotary tables as the HF config it came from."""
    from infer.pipeline.merge import _hf_config
    from infer.runtime.model.llama import RotaryEmbedding

    hf = _config("llama3").to_dict()
    scaling = {k: v for k, v in hf["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    trt = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT,
           "rotary_base": hf["rope_parameters"]["rope_theta"], "rotary_scaling": {"type": "llama3", **scaling}}
    merged = _hf_config(trt, "llama", 16, True, "F32", {})
    ours, want = (RotaryEmbedding.for_config(ModelConfig.from_hf(c)) for c in (merged, hf))
    assert ModelConfig.from_hf(merged).rope_scaling["rope_type"] == "llama3"
    assert torch.equal(ours.cos, want.cos) and torch.equal(ours.sin, want.sin)


def test_older_config_spellings_read_alike():
    """rope_scaling with a top-level rope_theta (configs written before transformers 5) gives the tables
    rope_parameters does; Qwen's sliding_window counts only with use_sliding_window."""
    from infer.runtime.model.llama import RotaryEmbedding

    new = _config("llama3").to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = {"type": "llama3", **{k: v for k, v in new["rope_parameters"].items()
                                                if k not in ("rope_type", "rope_theta")}}
    a, b = (RotaryEmbedding.for_config(ModelConfig.from_hf(c)) for c in (new, old))
    assert torch.equal(a.cos, b.cos) and ModelConfig.from_hf(old).rope_scaling["factor"] == 8.0
    qwen = {**_config("qwen2-yarn").to_dict(), "sliding_window": 32, "use_sliding_window": False}
    check_config(qwen)  # Qwen2.5's config.json: a window stated, switched off
    assert ModelConfig.from_hf(qwen).layer_windows is None
    switched_on = {**qwen, "use_sliding_window": True, "max_window_layers": 1, "layer_types": None}
    assert ModelConfig.from_hf(switched_on).layer_windows == (None, 32)


def test_partial_rotary_reorders_a_quantized_qkv_as_a_float_one():
    """A quantized qkv_proj (values, group scales, zero points) is stored in the same row order as the float
    one, so a W4/W8 Phi-4-mini computes what its float model does (runtime/model/loader.store_partial_rotary)."""
    from infer.runtime.model.compressed_tensors import Args, QuantWeight
    from infer.runtime.model.loader import store_partial_rotary

    cfg = ModelConfig.from_hf(_config("phi4-partial").to_dict())
    assert cfg.rotary_dims == cfg.head_dim // 2
    rows, k, groups = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size, 4
    g = torch.Generator().manual_seed(random.randrange(2**31))
    q = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.int8)
    w = QuantWeight(Args(4, "int", "group", False, k // groups), None, q, torch.rand(rows, groups, generator=g),
                    torch.randint(0, 16, (rows, groups), generator=g, dtype=torch.int8))
    name = "layers.0.self_attn.qkv_proj"
    state = {name + ".weight": w.dequantize(torch.float32), name + ".bias": torch.randn(rows, generator=g)}
    quantized = {name: w}
    bias = state[name + ".bias"].clone()
    store_partial_rotary(state, quantized, cfg)
    assert torch.equal(quantized[name].dequantize(torch.float32), state[name + ".weight"])
    assert not torch.equal(state[name + ".weight"], w.dequantize(torch.float32))  # rows did move
    assert torch.equal(state[name + ".bias"].sort().values, bias.sort().values)  # moved, none lost
