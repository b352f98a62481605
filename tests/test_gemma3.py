"""Gemma 3's text model (model_type gemma3_text, Gemma3ForCausalLM): per-head q/k norms scaling by (1 + weight), a
rotary per layer type (sliding layers: default rope of rope_local_base_freq; full layers: rope_theta with
rope_scaling), sliding and full layers mixed, query_pre_attn_scalar, sandwich norms, scaled embeddings, GeGLU,
tied head. A small random-weight checkpoint made with transformers' own Gemma3TextConfig, built by infer-build,
is checked against transformers' eager float32 model: logits on inputs several windows long, and greedy tokens
through the engine (chunked prefill, prefix caching, preemption)."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
import torch
import transformers

from conftest import greedy_gaps, hf_greedy
from test_families import COMMON, VOCAB, _build, _tokenizer
from infer.kernels import isa, step_layers
from infer.runtime import LLM, SamplingParams
from infer.runtime.model import ModelConfig, load_model
from infer.runtime.model.families import UnsupportedConfig, check_config
from infer.runtime.model.llama import RotaryEmbedding

CONTEXT, WINDOW = 256, 24  # the window: a block and a half; test inputs run several windows past it
PROMPT, NEW_TOKENS = 80, 64
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def _config(**over) -> transformers.Gemma3TextConfig:
    """Gemma 3 1B's head layout (4 query heads of 256, one KV head) at a small hidden size; the 4B/12B/27B
    models' linear rope scaling (factor 8) on the full layers; query_pre_attn_scalar apart from head_dim (as the
    27B's is) so a scale taken from head_dim shows."""
    return transformers.Gemma3TextConfig(**{
        **COMMON, "num_hidden_layers": len(TYPES), "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 144, "sliding_window": WINDOW, "layer_types": TYPES, "rope_parameters": ROPE,
        "max_position_embeddings": CONTEXT, **over})


def _model(cfg, init: float = 0.1) -> transformers.PreTrainedModel:
    """Random float32 weights (std ``init``: attention far from uniform, so a wrong rotary or window moves the
    logits); norms random around 0 (Gemma stores weight - 1), which HF would leave at 0 and hide a missing 1 +."""
    cfg.initializer_range = init
    model = transformers.Gemma3ForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def _checkpoint(path) -> transformers.PreTrainedModel:
    model = _model(_config())
    model.save_pretrained(path)
    _tokenizer(path)
    return model


def _variant(ref, **over) -> transformers.PreTrainedModel:
    """``ref``'s weights under another config (what a mistake would compute)."""
    model = _model(_config(**over))
    model.load_state_dict(ref.state_dict())
    return model


def test_gemma3_builds_and_matches_transformers(tmp_path):
    ref = _checkpoint(tmp_path / "src")
    artifact = _build(tmp_path, tmp_path / "src")
    config = json.loads((artifact / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["rope_parameters"] == ROPE
    cfg = ModelConfig.from_dir(artifact)
    assert cfg.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in TYPES)
    assert cfg.local_rope_layers == tuple(t == "sliding_attention" for t in TYPES)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta, cfg.local_rope_scaling) == (
        1e6, 8.0, 1e4, None)
    assert cfg.qk_norm and cfg.norm_offset and cfg.sandwich_norms and cfg.tie_word_embeddings
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (0.0, 0.0, 144 ** -0.5)

    # logits on fresh inputs several windows long, float32 both sides
    ours = load_model(artifact)
    ids = torch.randint(0, VOCAB, (2, random.randint(4 * WINDOW, CONTEXT)))
    with torch.no_grad():
        want = ref(ids).logits
        exact = copy.deepcopy(ref).double()(ids).logits  # float64: what float32 rounding is measured against
        # what a model with one rotary for every layer (the full layers'), or without the window, computes
        one_rope = _variant(ref, rope_parameters={t: ROPE["full_attention"] for t in ROPE})(ids).logits
        no_window = _variant(ref, layer_types=["full_attention"] * len(TYPES))(ids).logits
    got = ours.logits(ids)
    err = (got - want).abs().max().item()
    ours64, theirs64 = ((x.double() - exact).abs().max().item() for x in (got, want))
    off_rope, off_window = (one_rope - want).abs().max().item(), (no_window - want).abs().max().item()
    print("length", ids.shape[1], "max |logit diff|", err, "logit scale", want.abs().max().item(),
          "| vs float64: ours", ours64, "transformers' float32", theirs64,
          "| one rotary for all layers:", off_rope, "| no window:", off_window)
    # float32 rounding: measured 5.7e-6 at logit scale 3.9; each side 6e-6 to 8e-6 off float64
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err
    assert ours64 < 3 * theirs64 + 1e-6, (ours64, theirs64)
    assert min(off_rope, off_window) > 100 * err  # the checks see the local rope and the window

    # greedy tokens through the engine: chunked prefill, shared prefixes (cache hits), preemption, on the C++
    # decode kernel (window starts) and on gather + SDPA (window mask)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    blocks = 16  # three sequences of PROMPT + NEW_TOKENS need 27 (full layers keep every block): some must wait
    shared = [random.randrange(VOCAB) for _ in range(48)]
    prompts = [shared + [random.randrange(VOCAB) for _ in range(PROMPT - 48)] for _ in range(3)]
    wants = hf_greedy(ref, prompts, NEW_TOKENS)
    for kernels in ("cpp", "torch"):
        llm = LLM(artifact, max_num_batched_tokens=48, max_num_seqs=3, kv_cache_memory=blocks * per_block,
                  kernels=kernels)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outs] == wants, kernels
        engine = llm.engine
        print(kernels, engine.model.step_path, "steps", engine.stats["steps"], "preemptions",
              engine.scheduler.num_preemptions, "prefix hits", engine.block_manager.prefix_hits)
        assert engine.block_manager.prefix_hits > 0 and engine.stats["steps"] > NEW_TOKENS
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert engine.window is None  # full layers keep every block


def test_gemma3_rotary_tables_per_layer_type_match_transformers():
    """Each layer type's cos/sin against transformers' Gemma3RotaryEmbedding, with the config in each spelling
    transformers 5 reads: rope_parameters keyed by layer type, and the older rope_scaling, rope_theta and
    rope_local_base_freq (with sliding_window_pattern for the layer types), each key left out too (the class
    defaults: 1e6, 1e4, a pattern of 6, a window of 4096)."""
    base = {k: v for k, v in _config(num_hidden_layers=8, layer_types=TYPES * 2).to_dict().items()
            if k not in ("rope_parameters", "layer_types", "sliding_window", "_sliding_window_pattern")}
    spellings = [
        {"rope_parameters": ROPE, "layer_types": TYPES * 2, "sliding_window": WINDOW},
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0}}, "rope_theta": 5e5,
         "rope_local_base_freq": 2e4},
        {"rope_theta": 5e5, "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "sliding_window_pattern": 3, "sliding_window": WINDOW},
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        {},
    ]
    positions = torch.arange(CONTEXT)[None]
    for keys in spellings:
        raw = {**base, **keys}
        hf_cfg = transformers.Gemma3TextConfig(**raw)
        cfg = ModelConfig.from_hf(raw)
        types = hf_cfg.layer_types
        assert cfg.local_rope_layers == tuple(t == "sliding_attention" for t in types), keys
        window = hf_cfg.sliding_window if hf_cfg.sliding_window < CONTEXT else None
        assert (cfg.layer_windows or (None,) * len(types)) == tuple(
            window if t == "sliding_attention" else None for t in types), keys
        rotary = transformers.Gemma3ForCausalLM(hf_cfg).model.rotary_emb
        for layer_type, ours in (("full_attention", RotaryEmbedding.for_config(cfg)),
                                 ("sliding_attention", RotaryEmbedding.for_config(cfg, local=True))):
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, layer_type)
            assert torch.allclose(ours.cos, cos[0], atol=1e-6, rtol=1e-6), (keys, layer_type)
            assert torch.allclose(ours.sin, sin[0], atol=1e-6, rtol=1e-6), (keys, layer_type)
    # the class defaults: full layers 1e6 with no scaling, sliding ones 1e4; every 6th layer full
    cfg = ModelConfig.from_hf(base)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.local_rope_theta) == (1e6, None, 1e4)
    assert cfg.local_rope_layers == (True,) * 5 + (False,) + (True,) * 2


def test_gemma3_older_config_spelling_and_final_softcap_match_transformers(tmp_path):
    """A config.json in the spelling the hub's Gemma 3 checkpoints use (rope_scaling, rope_theta,
    rope_local_base_freq, sliding_window_pattern; no layer_types, no rope_parameters), with a final logit
    soft-cap low enough to bend the logits: the runtime's float32 logits equal transformers' reading the same
    directory."""
    src = tmp_path / "src"
    _model(_config()).save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4,
               sliding_window_pattern=3, final_logit_softcapping=3.0)
    (src / "config.json").write_text(json.dumps(raw))
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert ref.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                      "sliding_attention"]
    assert ref.config.rope_parameters == ROPE
    ours = load_model(src, kernels="torch")
    assert ours.config.final_softcap == 3.0
    ids = torch.randint(0, VOCAB, (2, random.randint(4 * WINDOW, CONTEXT)))
    with torch.no_grad():
        want = ref(ids).logits
    err = (ours.logits(ids) - want).abs().max().item()
    print("length", ids.shape[1], "max |logit diff|", err, "logit scale (cap 3)", want.abs().max().item())
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err
    assert want.abs().max().item() > 2.0  # logits where tanh(x / 3) * 3 bends well away from x


@pytest.mark.parametrize("key,value,match", [
    ("rope_parameters", {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
     r"rope_parameters=.* is not supported for model_type gemma3_text; supported: a dict keyed by layer type"),
    ("rope_scaling", {"type": "linear", "factor": 8.0},
     r"full_attention rotary names type='linear' but rope_type='default': transformers 5 reads rope_type"),
    ("rope_parameters", {**ROPE, "sliding_attention": {"rope_type": "foo", "rope_theta": 1e4}},
     r"rope_parameters.sliding_attention.rope_type='foo' is not supported for model_type gemma3_text"),
    ("attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0 is not supported \(transformers' Gemma 3 "
                                     r"attention never applies it and vLLM's does\); supported: null"),
    ("layer_types", ["sliding_attention"], r"layer_types=\['sliding_attention'\] is not supported; supported: 4 "
                                           r"entries of full_attention or sliding_attention"),
    ("query_pre_attn_scalar", None, r"query_pre_attn_scalar=None is not supported; supported: a positive number"),
])
def test_gemma3_config_values_it_would_misread_are_refused(key, value, match):
    cfg = {**_config().to_dict(), key: value}
    if key == "rope_scaling":  # the older spelling: rope_scaling with top-level thetas
        cfg.pop("rope_parameters")
    with pytest.raises(UnsupportedConfig, match=match):
        ModelConfig.from_hf(cfg)


def test_gemma3_multimodal_is_refused_naming_the_text_model():
    cfg = {**_config().to_dict(), "model_type": "gemma3"}
    with pytest.raises(UnsupportedConfig, match=r"model_type 'gemma3' is not supported yet: the vision tower and "
                                                r"its image tokens are not implemented; supported: .*gemma3_text: "
                                                r"Gemma 3's text model, Gemma3ForCausalLM"):
        check_config(cfg)


@pytest.mark.skipif(not isa.at_least("avx2"), reason="this CPU has no AVX2 + FMA: no C++ step to decline")
def test_gemma3_runs_the_python_layer_loop_in_bfloat16(tmp_path):
    """The one-call C++ step turns every layer with one rotary table: it declines Gemma 3, saying why, and the
    Python layer loop serves it in bfloat16 to transformers' float32 argmax within bfloat16 noise."""
    assert step_layers.load() is not None, "the C++ step failed to build on a CPU that has AVX2 + FMA"
    ref = _checkpoint(tmp_path / "src")
    artifact = _build(tmp_path, tmp_path / "src", "bfloat16")
    llm = LLM(artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off")
    model = llm.engine.model
    print(model.step_path)
    assert model.fused_step is None
    assert re.match(r"python layer loop: a rotary of their own for the sliding layers \(Gemma 3's "
                    r"rope_local_base_freq\)", model.step_path), model.step_path
    prompts = [[random.randrange(VOCAB) for _ in range(random.randint(40, 90))] for _ in range(2)]
    for gap, off in greedy_gaps(llm, ref, prompts):
        # bfloat16 noise at these weights (std 0.1, logits up to ~4): measured gaps 0 to 0.03, logprobs 0.02 to 0.054
        assert gap < 0.1 and off < 0.1, (gap, off)

