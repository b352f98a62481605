"""The Llama / Qwen2 decoder in one file: the model the runtime runs.

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

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


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
    attention_bias: bool
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Reads an HF ``config.json`` dict; refuses what this implementation would get wrong."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: default")
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            # silently assuming 10000 gives fluent nonsense on long inputs: refuse instead
            raise ValueError("config.json states no rope_theta (neither top level nor rope_parameters)")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, adds into it first (the pre-norm block's step)."""

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
        return self.weight * xf.to(x.dtype), residual


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place by their absolute positions (cos/sin tables for every position)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.ops = None

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
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, rotary: RotaryEmbedding, rope, ctx) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # rotate q and k together, in place: one pass instead of two
        rotary.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.head_dim
        out = ctx.attend(self.layer_idx, q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d),
                         v.view(-1, self.num_kv_heads, d))
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = None  # kernels.layer_ops' module when it builds: silu(gate) * up in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rotary, rope, ctx):
        """x: the previous block's output (or the embeddings, with residual None); returns the same pair."""
        x, residual = self.input_layernorm(x, residual)
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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.fused_step = None  # runtime/model/fused_step.py's, where every layer fits it: steps in C++

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden] (normed)."""
        x, residual = self.embed_tokens(input_ids), None
        fused = self.fused_step(x, positions, ctx) if self.fused_step is not None else None
        if fused is not None:  # every layer in one C++ call
            return self.norm(*fused)[0]
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, rope, ctx)
        return self.norm(x, residual)[0]

    def use_fused_ops(self, ops) -> None:
        """Runs RMSNorm, rotary and the MLP's activation through kernels.layer_ops' module (None: torch ops)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, RotaryEmbedding, MLP)):
                m.ops = ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Whole-sequence forward for a [B, L] batch without padding: logits [B, L, vocab] (float32)."""
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(b)
        hidden = self(input_ids.reshape(-1), positions, DenseCausalContext(b, length))
        return self.compute_logits(hidden).view(b, length, -1)


class DenseCausalContext:
    """Attention over B equal-length sequences given whole, with no KV cache."""

    def __init__(self, batch: int, length: int):
        self.batch, self.length = batch, length

    def attend(self, layer_idx, q, k, v):
        b, n = self.batch, self.length
        q, k, v = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
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
    """Every linear of the model (the LM head last) with the checkpoint linears it is made of."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out_features = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d,
                    "o_proj": h, "gate_proj": inter, "up_proj": inter, "down_proj": h}
    in_features = {"o_proj": cfg.num_heads * d, "down_proj": inter}
    layout = []
    for i in range(cfg.num_layers):
        for module in Transformer.layer_linears:
            parts = Transformer.packed_modules_mapping.get(module, (module,))
            layout.append(FusedLinear(f"layers.{i}.{module}", tuple(
                HFLinear(f"model.layers.{i}.{part}", in_features.get(part.rpartition(".")[2], h),
                         out_features[part.rpartition(".")[2]]) for part in parts)))
    layout.append(FusedLinear("lm_head", (HFLinear("lm_head", h, cfg.vocab_size),)))
    return layout
