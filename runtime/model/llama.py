"""The Llama-family decoder in one file: the model the runtime runs (Llama, Qwen2/3, Mistral, Phi-3, Gemma 1/2/3).

The families differ by a few config-driven branches (q/k norms, which projections carry biases, the
rotary embedding's scaling, a checkpoint with fused projections, the MLP's activation, Gemma's scaled
embeddings and (1 + weight) norms, Gemma 2's sandwich norms, soft-capping and attention scale, Gemma 3's
rotary of its own for the sliding layers), declared in runtime/model/families.py.

Tokens travel flattened, as one ``[T, hidden]`` tensor for the whole step, so a step can mix
prompt chunks and single decode tokens of many sequences. How attention sees the rest of each
sequence is the business of an *attention context* (``attend(layer, q, k, v)``): a dense causal
one here for whole-sequence use (evaluation, tests), a paged one in the engine.

q/k/v and gate/up are fused at load time into one matmul each: fewer, larger matmuls are what
makes a small model fast on a CPU. ``Transformer.packed_modules_mapping`` declares that layout
once; ``linear_layout`` spells it out per layer with shapes, for the loader (float and quantized
weights alike) and for the build pipeline's quantize stage. Loading is runtime/model/loader.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..artifact import CONFIG
from ..engine.attention import attention
from .families import (FAMILIES, ROPE_TYPES, check_config, hidden_act, layer_types, layer_windows,
                       partial_rotary_factor, rope_parameters, softcaps)
from .packed_linear import PackedLinear

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry a bias
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope
    packed_checkpoint: bool = False  # the checkpoint stores qkv_proj / gate_up_proj fused already
    # rope_parameters when not default rope: rope_type and the keys families.ROPE_TYPES lists for it
    rope_scaling: dict | None = field(default=None, hash=False)
    rotary_dim: int | None = None  # the leading dims of each head the rotary turns (partial rotary); None: all
    # each layer's sliding attention window (None: full attention); None when every layer attends in full
    layer_windows: tuple[int | None, ...] | None = None
    hidden_act: str = "silu"  # the MLP's activation on its gate: families.HIDDEN_ACTS
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype (Gemma)
    # RMSNorm scales by (1 + weight) in float32, then rounds (Gemma): the loader stores 1 + weight in float32
    norm_offset: bool = False
    sandwich_norms: bool = False  # attention and MLP outputs normed before the residual add (Gemma 2, 3)
    attn_softcap: float = 0.0  # attention scores become tanh(s / cap) * cap (Gemma 2); 0: none
    final_softcap: float = 0.0  # the logits likewise (Gemma 2, 3); 0: none
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power (Gemma 2, 3); None: head_dim's
    # Gemma 3: the rotary of the sliding_attention layers (rope_theta and rope_scaling as above) and which layers
    # turn with it (layer_types' sliding ones, whether or not the window cuts anything); None: one for every layer
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = field(default=None, hash=False)
    local_rope_layers: tuple[bool, ...] | None = None

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float | None:
        """The attention scores' scale, or None for head_dim ** -0.5 (the attention contexts' default)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Reads an HF ``config.json`` dict; refuses what this implementation would get wrong
        (families.check_config, the same check infer-build makes before building)."""
        family = check_config(cfg)
        model_type = family.model_type
        rope = rope_parameters(cfg)
        # Gemma 3: rope_parameters' own rope_theta wins (always set: families.layer_rope_parameters)
        theta = rope.get("rope_theta") if family.layer_rope else cfg.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            # silently assuming 10000 gives fluent nonsense on long inputs: refuse instead
            raise ValueError("config.json states no rope_theta (neither top level nor rope_parameters)")
        heads, max_pos = cfg["num_attention_heads"], cfg.get("max_position_embeddings", 2048)
        local = {}
        types = layer_types(cfg) if family.layer_rope else None
        if types and "sliding_attention" in types:
            sliding = rope_parameters(cfg, "sliding_attention")
            local = dict(local_rope_theta=float(sliding["rope_theta"]), local_rope_scaling=_scaling(sliding, cfg),
                         local_rope_layers=tuple(t == "sliding_attention" for t in types))
        bias = cfg.get("attention_bias", False)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rotary_dim = int(head_dim * partial_rotary_factor(cfg))
        attn_softcap, final_softcap, scalar = softcaps(cfg)
        if rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor turns {rotary_dim} of a head's {head_dim} dims: must be even")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", family.tied_default),
            attention_bias={"attention_bias": bias, "qkv": True, "none": False}[family.attention_bias],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            o_proj_bias=family.attention_bias == "attention_bias" and bias,
            mlp_bias=family.mlp_bias and cfg.get("mlp_bias", False),
            qk_norm=family.qk_norm,
            packed_checkpoint=family.packed_checkpoint,
            rope_scaling=_scaling(rope, cfg),
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            layer_windows=layer_windows(cfg),
            hidden_act=hidden_act(cfg)[1],
            embed_scale=family.embed_scale,
            norm_offset=family.norm_offset,
            sandwich_norms=family.sandwich_norms,
            attn_softcap=attn_softcap,
            final_softcap=final_softcap,
            query_pre_attn_scalar=scalar,
            **local,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / CONFIG).read_text()))


def _scaling(rope: dict, cfg: dict) -> dict | None:
    """ModelConfig.rope_scaling of one rotary's parameters (families.rope_parameters'): None for default rope."""
    if rope["rope_type"] in ("default", "dynamic"):  # dynamic: default rope within max_pos (families.py)
        return None
    scaling = {k: rope[k] for k in ROPE_TYPES[rope["rope_type"]] if rope.get(k) is not None}
    scaling["rope_type"] = rope["rope_type"]
    # transformers: a top-level original_max_position_embeddings (Phi-3's) wins, else max_position_embeddings
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings", 2048)
    return scaling


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, adds into it first (the pre-norm block's step).

    A weight of the model's dtype scales the normalised value rounded to that dtype (Llama's rule); a float32
    weight on a lower-precision model scales it in float32 and rounds once (Gemma's rule, its 1 + weight
    stored in float32 at load). In float32 the two rules are the same product."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = None  # kernels.layer_ops' module when it builds: one fused pass instead of ~8 ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream): with ``residual``, the stream becomes x + residual."""
        if self.ops is not None:
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps), x
            self.ops.add_rms_norm_(x, residual, self.weight, self.eps)  # x and residual are this step's own
            return x, residual
        residual = x if residual is None else x + residual
        # normalise in float32, as the reference implementation does, then scale in the model dtype
        xf = residual.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype != x.dtype:
            return (xf * self.weight).to(x.dtype), residual
        return self.weight * xf.to(x.dtype), residual


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """The rotary embedding's inverse frequencies [rotary dims / 2] and the factor its cos/sin are scaled by,
    computed as transformers' modeling_rope_utils does for each rope_type (float32 throughout)."""
    d, base, r = cfg.rotary_dims, cfg.rope_theta, cfg.rope_scaling or {"rope_type": "default"}
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / (base ** exponents)
    kind, original = r["rope_type"], r.get("original_max_position_embeddings")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":  # positions divided by factor
        return inv_freq / r["factor"], 1.0
    if kind == "llama3":  # long wavelengths divided by factor, short ones kept, a smooth ramp between
        factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":  # interpolate the slow dimensions, keep the fast ones, ramp between; scale attention
        factor = r["factor"]
        scale = r.get("attention_factor")
        if scale is None:
            def mscale(s, m=1.0):
                return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
            m, m_all = r.get("mscale"), r.get("mscale_all_dim")
            scale = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        fast, slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

        def dim_of(rotations):  # the dimension that turns ``rotations`` times over the original context
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(fast), dim_of(slow)
        if r.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
        return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, scale
    if kind == "longrope":
        # transformers picks long_factor when the current length passes the original context; keys in a KV
        # cache keep the rotation they were stored with, so one choice for the whole served context instead
        factor = r.get("factor") or cfg.max_position_embeddings / original
        scale = r.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long = cfg.max_position_embeddings > original
        ext = torch.tensor(r["long_factor"] if long else r["short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** exponents), scale
    raise ValueError(f"rope_type {kind!r}: no rule here; families.ROPE_TYPES and rope_inv_freq disagree")


def rotary_head_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Where each dim of a head goes so that a partial rotary becomes a whole-head one.

    transformers turns dims (i, i + r/2) for i < r/2 and passes dims r.. through; every rotary kernel here
    turns (i, i + head_dim/2). Storing q and k with their dims in this order (the q/k rows of qkv_proj
    permuted at load, runtime/model/loader.py) puts each turned pair where the kernels turn it and the passed
    dims on pairs whose table entries are cos 1, sin 0, which leave them bit for bit. q.k is the same sum in
    another order, so attention is unchanged, and v (and the output) keep their order.
    Returns ``order``: the stored head's dim j holds the checkpoint's dim order[j]."""
    half, r = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)
    return torch.cat([torch.arange(r), passed[:half - r], torch.arange(r, rotary_dim), passed[half - r:]])


def qkv_row_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The rows of the fused qkv projection in stored order (rotary_head_order within each q and k head,
    v as is), or None where the rotary turns whole heads."""
    if cfg.rotary_dims == cfg.head_dim:
        return None
    d, heads = cfg.head_dim, cfg.num_heads + cfg.num_kv_heads
    head = rotary_head_order(d, cfg.rotary_dims)
    rows = (torch.arange(heads)[:, None] * d + head[None, :]).reshape(-1)
    return torch.cat([rows, torch.arange(heads * d, (heads + cfg.num_kv_heads) * d)])


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by their absolute positions (cos/sin tables for every position)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, inv_freq: torch.Tensor | None = None,
                 scale: float = 1.0, rotary_dim: int | None = None):
        """``inv_freq`` and ``scale``: rope_inv_freq's, for scaled rope types (else default rope of ``theta``);
        the scale is folded into the tables, so every rotary kernel applies it. ``rotary_dim`` below
        ``head_dim``: a partial rotary, its q/k dims stored in rotary_head_order's order."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        if rotary_dim < head_dim:  # the passed dims' pairs: turned by nothing
            still = head_dim // 2 - rotary_dim // 2
            cos = torch.cat([cos, torch.ones(max_positions, still)], dim=-1)
            sin = torch.cat([sin, torch.zeros(max_positions, still)], dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)
        self.ops = None

    @classmethod
    def for_config(cls, cfg: ModelConfig, local: bool = False) -> "RotaryEmbedding":
        """The model's rotary, or with ``local`` its sliding layers' own (Gemma 3: ModelConfig.local_rope_*)."""
        if local:
            cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling)
        return cls(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, *rope_inv_freq(cfg),
                   rotary_dim=cfg.rotary_dims)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """What one forward pass needs to rotate: per-token cos/sin for the torch path."""
        if self.ops is not None:
            return positions
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def rotate_(self, x: torch.Tensor, heads: int, head_dim: int, tables) -> None:
        """Rotates the first ``heads`` heads of each row of x ([T, >= heads * head_dim]) in place."""
        if self.ops is not None:
            self.ops.rotary_(x, tables, self.cos, self.sin, heads, head_dim)
            return
        cos, sin = tables
        xh = x[:, :heads * head_dim].view(-1, heads, head_dim)
        half = head_dim // 2
        rotated = torch.cat((-xh[..., half:], xh[..., :half]), dim=-1)
        xh.copy_(xh * cos + rotated * sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Qwen3, Gemma 3: each head of q and k RMS-normed before rope
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap

    def forward(self, x, rotary: RotaryEmbedding, rope, ctx) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            d, q_end = self.head_dim, self.q_size + self.kv_size
            for norm, part in ((self.q_norm, qkv[:, :self.q_size]), (self.k_norm, qkv[:, self.q_size:q_end])):
                part.copy_(norm(part.reshape(-1, d))[0].view(part.shape))
        # rotate q and k together, in place: one pass instead of two
        rotary.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.head_dim
        q, k, v = q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d), v.view(-1, self.num_kv_heads, d)
        if self.scale is None and not self.softcap:  # every attention context's default
            out = ctx.attend(self.layer_idx, q, k, v)
        else:
            out = ctx.attend(self.layer_idx, q, k, v, self.scale, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))


# families.HIDDEN_ACTS, as transformers' ACT2FN computes each
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.ops = None  # kernels.layer_ops' module when it builds (SiLU only): silu(gate) * up in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # Gemma 2: post_attention_layernorm norms the attention output, these the MLP's input and output
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None

    def forward(self, x, residual, rotary, rope, ctx):
        """x: the previous block's output (or the embeddings, with residual None); returns the same pair."""
        x, residual = self.input_layernorm(x, residual)
        if self.pre_feedforward_layernorm is not None:  # residual + norm(attn), then residual + norm(mlp)
            x = self.post_attention_layernorm(self.self_attn(x, rotary, rope, ctx))[0]
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x))[0], residual
        x, residual = self.post_attention_layernorm(self.self_attn(x, rotary, rope, ctx), residual)
        return self.mlp(x), residual


class Transformer(nn.Module):
    # the checkpoint's projections this model runs as one matmul, in output order (HF names per layer)
    packed_modules_mapping = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    # the linears of a layer, fused or not
    layer_linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # not initialised: every weight comes from a checkpoint (loader.py builds the model on the meta device),
        # where torch's normal_ would first import torch._dynamo, 1-3 s of every load
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding.for_config(cfg)
        # Gemma 3: the sliding layers turn q and k with a rotary of their own
        self.rotary_local = RotaryEmbedding.for_config(cfg, local=True) if cfg.local_rope_layers else None
        # Gemma's embedding scale: float32 sqrt(hidden_size), as transformers rounds it, cast to the model's dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, device="cpu")) if cfg.embed_scale else None
        self.fused_step = None  # runtime/model/fused_step.py's, where every layer fits it: steps in C++
        self.step_path = "python layer loop: no C++ step was set up (runtime/model/loader.py sets one up)"

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden] (normed)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if ctx.one_call and self.fused_step is not None:  # the plan's route: every layer in one C++ call
            return self.norm(*self.fused_step(x, positions, ctx))[0]
        rope = self.rotary.tables(positions, x.dtype)
        local = self.config.local_rope_layers
        if local:
            local_rope = self.rotary_local.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if local and local[i]:
                x, residual = layer(x, residual, self.rotary_local, local_rope, ctx)
            else:
                x, residual = layer(x, residual, self.rotary, rope, ctx)
        return self.norm(x, residual)[0]

    def use_fused_ops(self, ops) -> None:
        """Runs RMSNorm, rotary and the MLP's activation through kernels.layer_ops' module (None: torch ops).
        Its RMSNorm is Llama's rule (weights of the model's dtype) and its activation SiLU: other norms and
        MLPs stay on torch ops."""
        for m in self.modules():
            if (isinstance(m, RotaryEmbedding) or isinstance(m, RMSNorm) and m.weight.dtype == self.dtype
                    or isinstance(m, MLP) and m.act is F.silu):
                m.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; Gemma 2's final soft-cap applied in float32. A packed bfloat16 head returns its float32
        sums unrounded: logits rounded to bfloat16 (a step of 0.125 at 20) tie and flip between runs that differ
        by less (kernels/csrc/bf16_linear.cpp); other heads' outputs are widened."""
        head = self.lm_head
        logits = head(hidden, float_out=True) if isinstance(head, PackedLinear) else head(hidden).float()
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Whole-sequence forward for a [B, L] batch without padding: logits [B, L, vocab] (float32)."""
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(b)
        hidden = self(input_ids.reshape(-1), positions, DenseCausalContext(b, length, self.config.layer_windows))
        return self.compute_logits(hidden).view(b, length, -1)


class DenseCausalContext:
    """Attention over B equal-length sequences given whole, with no KV cache; a sliding-window layer's
    query at position i sees positions i - window + 1 .. i (``layer_windows``: ModelConfig's)."""
    one_call = False  # the layer loop: the one-call C++ step reads a paged cache

    def __init__(self, batch: int, length: int, layer_windows: tuple[int | None, ...] | None = None):
        self.batch, self.length, self.layer_windows = batch, length, layer_windows

    def attend(self, layer_idx, q, k, v, scale: float | None = None, softcap: float = 0.0):
        """``scale`` None: head_dim ** -0.5; ``softcap``: Gemma 2's, explicit scores (SDPA has none)."""
        b, n = self.batch, self.length
        q, k, v = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        window = self.layer_windows[layer_idx] if self.layer_windows else None
        visible = None  # causal
        if window is not None and window < n:
            i = torch.arange(n, device=q.device)
            visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        out = attention(q, k, v, visible, scale, softcap)
        return out.transpose(1, 2).reshape(b * n, -1, q.shape[-1])


@dataclass(frozen=True)
class HFLinear:
    name: str  # HF module name, e.g. model.layers.0.self_attn.q_proj
    in_features: int
    out_features: int


@dataclass(frozen=True)
class FusedLinear:
    name: str  # this model's module name, e.g. layers.0.self_attn.qkv_proj
    parts: tuple[HFLinear, ...]  # the checkpoint's linears concatenated into it, in output order


def linear_layout(cfg: ModelConfig) -> list[FusedLinear]:
    """Every linear of the model (the LM head last) with the checkpoint linears it is made of (one, where
    the checkpoint stores it fused already: Phi-3's qkv_proj and gate_up_proj)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out_features = {"q_proj": q, "k_proj": kv, "v_proj": kv, "qkv_proj": q + 2 * kv, "o_proj": h,
                    "gate_proj": inter, "up_proj": inter, "gate_up_proj": 2 * inter, "down_proj": h}
    in_features = {"o_proj": q, "down_proj": inter}
    layout = []
    for i in range(cfg.num_layers):
        for module in Transformer.layer_linears:
            parts = (module,) if cfg.packed_checkpoint else Transformer.packed_modules_mapping.get(module, (module,))
            layout.append(FusedLinear(f"layers.{i}.{module}", tuple(
                HFLinear(f"model.layers.{i}.{part}", in_features.get(part.rpartition(".")[2], h),
                         out_features[part.rpartition(".")[2]]) for part in parts)))
    layout.append(FusedLinear("lm_head", (HFLinear("lm_head", h, cfg.vocab_size),)))
    return layout
