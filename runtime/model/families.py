"""What the runtime implements, declared once: the model families (config.json's ``model_type``) and,
per family, the config keys whose values change the maths.

``ModelConfig.from_hf`` reads a config through ``check_config``, ``infer-build`` calls the same
function on the source's config.json before any stage runs (so nothing is built that ``infer-run``
would refuse), and docs/families.md's table is ``markdown_table()``. A family's differences are a few
flags here and a few branches in runtime/model/llama.py, not another model file.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

# rope_type -> the keys of rope_parameters (or the older rope_scaling) it reads; the required ones
# are in REQUIRED_ROPE_KEYS. The maths is runtime/model/llama.py's rope_inv_freq.
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    # transformers rescales by the current length only past max_position_embeddings; the engine never
    # serves past it (its max_model_len is at most that), so within what is served this is default rope
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    # short_factor when the served context (max_position_embeddings) fits original_max_position_embeddings,
    # else long_factor for every position (see rope_inv_freq)
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
}
REQUIRED_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor",
                      "high_freq_factor"), "yarn": ("factor",), "longrope": ("short_factor", "long_factor")}
# hidden_act -> what the MLP computes on its gate (times up): SiLU (SwiGLU), GELU's tanh approximation (GeGLU,
# Gemma), exact GELU
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
# families transformers knows that this runtime does not implement yet, and what they need that it lacks
NOT_YET = {
    "gemma3": "the vision tower and its image tokens",
}
# the attention types of layer_types, and so the keys of a rope_parameters given per layer type (Gemma 3)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    model_type: str
    examples: str
    # which projections carry a bias, and what decides it: "attention_bias" (the key sets q/k/v and o),
    # "qkv" (q/k/v always, o never: Qwen2), "none"
    attention_bias: str = "none"
    mlp_bias: bool = False  # reads the mlp_bias key (gate/up/down)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3; Gemma 3, by 1 + weight)
    # the key that switches sliding_window on (Qwen's use_sliding_window); None: sliding_window alone
    window_flag: str | None = None
    packed_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    # partial_rotary_factor below 1 (rotary over the first part of each head, Phi-4-mini): transformers' modeling
    # code rotates only that part for these families
    partial_rotary: bool = False
    rope_types: tuple[str, ...] = tuple(ROPE_TYPES)
    rope_aliases: dict = field(default_factory=dict)  # older names transformers maps for this family
    # the keys naming the MLP's activation, the first one set wins. Gemma: hidden_activation first, as vLLM and
    # transformers 4.x read it (Gemma's configs pair hidden_act "gelu" with hidden_activation "gelu_pytorch_tanh",
    # the GELU it was trained with; transformers 5 reads hidden_act alone)
    act_keys: tuple[str, ...] = ("hidden_act",)
    default_act: str = "silu"  # where config.json names none (transformers' class default)
    # Gemma: embeddings times sqrt(hidden_size) (in the model's dtype), RMSNorm scaling by (1 + weight)
    embed_scale: bool = False
    norm_offset: bool = False
    tied_default: bool = False  # tie_word_embeddings where config.json leaves it out (transformers' class default)
    # Gemma 2: the attention output and the MLP's output RMS-normed before each joins the residual stream
    # (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by pre_feedforward_layernorm
    sandwich_norms: bool = False
    # Gemma 2 and 3: the soft-cap keys the family reads (attn_logit_softcapping, final_logit_softcapping:
    # tanh(x / cap) * cap on the attention scores, on the logits) and query_pre_attn_scalar (the attention scale is
    # its -1/2 power, not head_dim's), each with transformers' class default for config.json leaving it out
    softcaps: dict = field(default_factory=dict)
    # Gemma 2 and 3: where config.json lists no layer_types, layer i attends in full when (i + 1) % window_pattern
    # is 0 and slides otherwise (transformers' rule: Gemma 2's 2, even layers sliding; Gemma 3's 6, or its
    # pattern_key sliding_window_pattern); default_window: sliding_window where config.json leaves it out
    window_pattern: int = 0
    pattern_key: str | None = None
    default_window: int | None = None
    # Gemma 3: each layer type rotates with its own rope (layer_rope_parameters): full_attention layers with
    # rope_theta and rope_scaling, sliding_attention ones with default rope of rope_local_base_freq
    layer_rope: bool = False
    # keys this runtime takes only as null, and why: an implementation would disagree with another
    null_keys: dict = field(default_factory=dict)


FAMILIES = {f.model_type: f for f in (
    Family("llama", "Llama 2, Llama 3.x, SmolLM2", attention_bias="attention_bias", mlp_bias=True),
    Family("qwen2", "Qwen2, Qwen2.5 (YaRN for long context)", attention_bias="qkv", window_flag="use_sliding_window"),
    Family("qwen3", "Qwen3 (dense)", attention_bias="attention_bias", qk_norm=True, window_flag="use_sliding_window"),
    Family("mistral", "Mistral 7B v0.2/v0.3, Mistral Nemo", attention_bias="none"),
    Family("phi3", "Phi-3, Phi-3.5 mini, Phi-4-mini", attention_bias="none", packed_checkpoint=True, partial_rotary=True,
           rope_types=("default", "longrope"), rope_aliases={"su": "longrope", "yarn": "longrope"}),
    Family("gemma", "Gemma 1 (2B, 7B), CodeGemma", attention_bias="attention_bias",
           act_keys=("hidden_activation", "hidden_act"), default_act="gelu_pytorch_tanh", embed_scale=True,
           norm_offset=True, tied_default=True),
    Family("gemma2", "Gemma 2 (2B, 9B, 27B)", attention_bias="attention_bias",
           act_keys=("hidden_activation", "hidden_act"), default_act="gelu_pytorch_tanh", embed_scale=True,
           norm_offset=True, tied_default=True, sandwich_norms=True, window_pattern=2, default_window=4096,
           softcaps={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}),
    # transformers 5 reads Gemma 3's activation from hidden_activation alone
    Family("gemma3_text", "Gemma 3 text (1B; the 4B/12B/27B language models)", attention_bias="attention_bias",
           qk_norm=True, act_keys=("hidden_activation",), default_act="gelu_pytorch_tanh", embed_scale=True,
           norm_offset=True, tied_default=True, sandwich_norms=True, window_pattern=6,
           pattern_key="sliding_window_pattern", default_window=4096, layer_rope=True,
           softcaps={"final_logit_softcapping": None, "query_pre_attn_scalar": 256},
           null_keys={"attn_logit_softcapping": "transformers' Gemma 3 attention never applies it and vLLM's does"}),
)}


class UnsupportedConfig(ValueError):
    """A config.json this runtime would compute wrongly; the message names the key, the supported values
    and what to do."""


def _refuse(key: str, value, supported, why: str = "") -> UnsupportedConfig:
    return UnsupportedConfig(f"config.json {key}={value!r} is not supported{why}; supported: {supported}")


def layer_rope_parameters(cfg: dict) -> dict[str, dict]:
    """Gemma 3's rotary parameters per layer type as transformers 5 reads them (Gemma3TextConfig's
    convert_rope_params_to_dict): rope_parameters keyed by layer type, where an entry left out is default rope;
    rope_scaling on top of full_attention's; a rope_theta not stated there from rope_theta (full_attention) and
    rope_local_base_freq (sliding_attention), else the class's 1e6 and 1e4."""
    given = cfg.get("rope_parameters") or {}
    rope = {t: dict(given.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    rope["full_attention"].update(cfg.get("rope_scaling") or {})
    rope["full_attention"].setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    rope["sliding_attention"].setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
    return rope


def rope_parameters(cfg: dict, layer_type: str = "full_attention") -> dict:
    """The rotary embedding's parameters as transformers reads them: rope_parameters (transformers 5),
    else rope_scaling, with rope_type named (the older ``type`` too) and Phi-3's aliases resolved; for a family
    with a rope per layer type (Gemma 3), ``layer_type``'s."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is not None and family.layer_rope:
        rope = layer_rope_parameters(cfg)[layer_type]
    else:
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    rope["rope_type"] = family.rope_aliases.get(kind, kind) if family else kind
    rope.pop("type", None)
    return rope


def partial_rotary_factor(cfg: dict) -> float:
    """The share of each head the rotary embedding turns (rope_parameters, else the top-level key)."""
    return float(rope_parameters(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))


def hidden_act(cfg: dict) -> tuple[str, str]:
    """(the config key naming the MLP's activation, the activation): the first of the family's act_keys that
    is set, else its default_act."""
    family = FAMILIES[cfg["model_type"]]
    key = next((k for k in family.act_keys if cfg.get(k) is not None), None)
    return (key, cfg[key]) if key else (family.act_keys[-1], family.default_act)


def sliding_window(cfg: dict) -> int | None:
    """The attention window the config asks for, or None (full attention)."""
    family = FAMILIES[cfg["model_type"]]
    if family.window_flag is not None and not cfg.get(family.window_flag, False):
        return None
    return cfg.get("sliding_window", family.default_window)


def layer_types(cfg: dict) -> list[str] | None:
    """Each layer's attention type as transformers reads the config: ``layer_types`` where listed, else the
    family's rule (Gemma 2/3: every window_pattern-th layer full; Qwen2/Qwen3: sliding from
    ``max_window_layers`` on), else None (every layer alike). Refuses a list it cannot read."""
    family, layers = FAMILIES[cfg["model_type"]], cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None and family.window_pattern:
        pattern = (cfg.get(family.pattern_key) if family.pattern_key else None) or family.window_pattern
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if types is None and family.window_flag is not None:
        first = cfg.get("max_window_layers", layers)
        types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != layers
                              or set(types) - set(LAYER_TYPES)):
        raise _refuse("layer_types", types, f"{layers} entries of full_attention or sliding_attention")
    return types


def layer_windows(cfg: dict) -> tuple[int | None, ...] | None:
    """Each layer's attention window (None: full attention), or None when every layer attends in full:
    a window set, the sliding_attention layers of ``layer_types`` slide, or every layer where there are none
    (Mistral, Phi-3). A window of at least max_position_embeddings never cuts anything the engine serves, so
    it counts as full."""
    window, layers = sliding_window(cfg), cfg["num_hidden_layers"]
    if window is None or window >= cfg.get("max_position_embeddings", 2048):
        return None
    types = layer_types(cfg)
    if types is None:
        return (window,) * layers
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(windows) else None


def softcaps(cfg: dict) -> tuple[float, float, float | None]:
    """(attention logit soft-cap, final logit soft-cap, query_pre_attn_scalar) as the family reads them: caps of
    0.0 where none, the scalar None where the scale is head_dim's. The family's class defaults where config.json
    leaves a key out (Gemma 2: 50.0, 30.0, 256; Gemma 3: no caps, 256): an explicit null turns a cap off."""
    keys = FAMILIES[cfg["model_type"]].softcaps
    attn, final, scalar = (cfg.get(k, keys.get(k)) for k in ("attn_logit_softcapping", "final_logit_softcapping",
                                                              "query_pre_attn_scalar"))
    return float(attn or 0.0), float(final or 0.0), None if scalar is None else float(scalar)


def check_config(cfg: dict) -> Family:
    """Raises UnsupportedConfig for a family or key value this runtime does not implement; returns the family."""
    model_type = cfg.get("model_type")
    family = FAMILIES.get(model_type)
    if model_type in NOT_YET:
        raise UnsupportedConfig(f"model_type {model_type!r} is not supported yet: {NOT_YET[model_type]} are not "
                                f"implemented; supported: {', '.join(FAMILIES)} (gemma: Gemma 1, gemma2: Gemma 2, "
                                f"gemma3_text: Gemma 3's text model, Gemma3ForCausalLM)")
    if family is None:
        raise UnsupportedConfig(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    key, act = hidden_act(cfg)
    if act not in HIDDEN_ACTS:
        raise _refuse(key, act, ", ".join(HIDDEN_ACTS))
    if cfg.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", cfg["use_bidirectional_attention"], "null or false (causal)")
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if family.layer_rope:
        _check_layer_rope(cfg)
    elif not isinstance(raw, dict) or any(isinstance(v, dict) for v in raw.values()):
        raise _refuse("rope_parameters", raw, "one flat dict for every layer", " (per-layer rotary parameters)")
    for layer_type in LAYER_TYPES if family.layer_rope else LAYER_TYPES[:1]:
        rope = rope_parameters(cfg, layer_type)
        kind = rope["rope_type"]
        where = f"rope_parameters.{layer_type}" if family.layer_rope else "rope_parameters"
        if kind not in family.rope_types:
            aliases = "".join(f", {a} (= {b})" for a, b in family.rope_aliases.items())
            raise _refuse(f"{where}.rope_type", kind, ", ".join(family.rope_types) + aliases,
                          f" for model_type {model_type}")
        missing = [k for k in REQUIRED_ROPE_KEYS.get(kind, ()) if rope.get(k) is None]
        if missing:
            raise UnsupportedConfig(f"config.json {where} (rope_type {kind}) lacks {', '.join(missing)}; "
                                    f"rope_type {kind} reads {', '.join(ROPE_TYPES[kind])}")
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
        if partial != 1.0 and not family.partial_rotary:
            raise _refuse("partial_rotary_factor", partial, f"1.0 (rotary over the whole head) for model_type "
                          f"{model_type}; below 1.0 for "
                          f"{', '.join(f.model_type for f in FAMILIES.values() if f.partial_rotary)}")
        if not 0.0 < partial <= 1.0:
            raise _refuse("partial_rotary_factor", partial, "a fraction in (0, 1]")
    for key, why in family.null_keys.items():
        if cfg.get(key) is not None:
            raise _refuse(key, cfg[key], f"null for model_type {model_type}", f" ({why})")
    window = sliding_window(cfg)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise _refuse("sliding_window", window, "null or a positive number of tokens")
    layer_windows(cfg)  # refuses layer_types it cannot read
    if family.layer_rope:
        layer_types(cfg)  # its rope follows them whatever the window
    for key in family.softcaps:
        value = cfg.get(key, 1.0)  # left out: the class default
        nullable = key != "query_pre_attn_scalar"
        if (value is None and not nullable or value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0)):
            raise _refuse(key, value, "a positive number" + (" or null (no soft-capping)" if nullable else ""))
    return family


def _check_layer_rope(cfg: dict) -> None:
    """Refuses a Gemma 3 rotary that transformers 5.17 reads otherwise than the config seems to say, or not at
    all: a rope_parameters not keyed by layer type (its Gemma3TextConfig fails on one), and a rope type spelled
    ``type`` (kept there beside rope_type default, which wins: default rope, where vLLM reads the type)."""
    given = cfg.get("rope_parameters") or {}
    if not isinstance(given, dict) or set(given) - set(LAYER_TYPES) or not all(
            v is None or isinstance(v, dict) for v in given.values()):
        raise _refuse("rope_parameters", given, "a dict keyed by layer type: {\"full_attention\": {...}, "
                      "\"sliding_attention\": {...}} (or the older rope_scaling, rope_theta and rope_local_base_freq)",
                      f" for model_type {cfg['model_type']}")
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or any(isinstance(v, dict) for v in scaling.values()):
        raise _refuse("rope_scaling", scaling, "one flat dict (the full_attention layers' scaling)")
    for layer_type, rope in layer_rope_parameters(cfg).items():
        kind = rope.get("rope_type", rope.get("type"))
        if "type" in rope and rope["type"] != kind:
            raise UnsupportedConfig(
                f"config.json's {layer_type} rotary names type={rope['type']!r} but rope_type={kind!r}: "
                f"transformers 5 reads rope_type ({kind}) and vLLM type, so the two would compute different models; "
                f"write rope_type={rope['type']!r} (or drop type)")


def markdown_table() -> str:
    """docs/families.md's table of supported families and keys, made from the declarations above."""
    rows = ["| model_type | e.g. | rope_type | q/k norm | biases | head_dim | LM head | sliding_window |",
            "|---|---|---|---|---|---|---|---|"]
    bias = {"attention_bias": "q/k/v/o per `attention_bias`", "qkv": "q/k/v always, o none", "none": "none"}
    for f in FAMILIES.values():
        types = ", ".join(f"`{t}`" for t in f.rope_types) + "".join(f", `{a}` (= `{b}`)" for a, b in
                                                                       f.rope_aliases.items())
        biases = bias[f.attention_bias] + ("; gate/up/down per `mlp_bias`" if f.mlp_bias else "")
        window = (f"off unless `{f.window_flag}`; sliding from `max_window_layers` on, or per `layer_types`"
                  if f.window_flag else "even layers, or per `layer_types`" if f.window_pattern == 2
                  else f"all but every {f.window_pattern}th layer (`{f.pattern_key}`), or per `layer_types`"
                  if f.window_pattern else "every layer, or per `layer_types`")
        if f.partial_rotary:
            types += "; `partial_rotary_factor`"
        rows.append(f"| `{f.model_type}` | {f.examples} | {types} | {'yes' if f.qk_norm else 'no'} | {biases} "
                    f"| `head_dim` or hidden/heads | tied or untied | {window} |")
    notes = (
        f"Every family: `hidden_act` {', '.join(HIDDEN_ACTS)}; `partial_rotary_factor` 1.0 unless its rope_type "
        "cell says otherwise; `rope_theta` stated; `use_bidirectional_attention` off. "
        + ", ".join(f"`{f.model_type}`" for f in FAMILIES.values() if f.embed_scale or f.norm_offset)
        + ": embeddings times sqrt(hidden_size), RMSNorm scaling by (1 + weight), the activation read from "
        + " else ".join(f"`{k}`" for k in next(f.act_keys for f in FAMILIES.values() if f.norm_offset)) + "."
        + " ".join(f" `{f.model_type}`: also `attn_logit_softcapping` and `final_logit_softcapping` (tanh(x / cap) "
                   "* cap on the attention scores and the logits; null: none), the attention scale "
                   "`query_pre_attn_scalar`^-1/2, post-attention and pre/post-feedforward norms, and (without "
                   "`layer_types`) even layers sliding, odd ones full." for f in FAMILIES.values()
                   if "attn_logit_softcapping" in f.softcaps)
        + " ".join(f" `{f.model_type}`: the same keys and norms but no attention soft-cap (`attn_logit_softcapping` "
                   f"null: {f.null_keys['attn_logit_softcapping']}), q/k norms by (1 + weight), the activation from "
                   "`hidden_activation` alone, and a rotary per layer type: full layers `rope_theta` (default 1e6) "
                   "with `rope_scaling`, sliding layers default rope of `rope_local_base_freq` (default 1e4), or "
                   "`rope_parameters` keyed by `full_attention` and `sliding_attention`." for f in FAMILIES.values()
                   if f.layer_rope)
        + " A `sliding_window` below max_position_embeddings: a sliding layer's query sees the last "
        "`sliding_window` positions (transformers' rule); where every layer slides, the KV blocks behind the window "
        "go back to the pool, so a conversation holds about a window of cache however long it grows. Such models "
        "run every token as a decode row over its own window, on the CPU kernels or SDPA (not triton)."
        + " Not yet: " + "; ".join(f"`{t}` (lacks {why})" for t, why in NOT_YET.items()) + ". "
        "Keys each `rope_type` reads: " + "; ".join(
            f"`{t}`: " + (", ".join(f"`{k}`" for k in keys) if keys else "none") for t, keys in ROPE_TYPES.items())
        + ". `dynamic` equals `default` within max_position_embeddings, which the engine never serves past; "
        "`longrope` uses `long_factor` for every position when max_position_embeddings exceeds "
        "`original_max_position_embeddings`, else `short_factor` (transformers chooses by the current length, "
        "which a KV cache cannot follow). Anything else is refused by `infer-build` before any stage runs, and "
        "by `infer-run`, naming the key and the supported values.")
    return "\n".join(rows) + "\n\n" + textwrap.fill(notes, 104, break_long_words=False, break_on_hyphens=False) + "\n"
