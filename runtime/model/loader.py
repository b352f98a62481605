"""Loads a model from an HF-format directory: the one weight loader, float and quantized alike.

Tensors are read by HF name, then mapped onto the model through ``linear_layout`` (the fused
layout declared on the model): each fused linear is either concatenated from float parts or built
as a quantized linear from compressed-tensors parts (runtime/model/compressed_tensors.py); every
other tensor (embeddings, norms) keeps its HF name without the ``model.`` prefix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from ..artifact import CONFIG, INDEX, ArtifactError, inside
from .compressed_tensors import QuantWeight, is_quantized_config, read_quantized
from .llama import ModelConfig, RotaryEmbedding, Transformer, linear_layout, qkv_row_order, rotary_head_order

log = logging.getLogger("infer.model")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one, or the shards its index names).

    For a plain directory only; an artifact's files come from its verified manifest
    (``Artifact.weight_files()``). Either way no index entry may lead out of the directory."""
    index = path / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()), key=str)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        return [inside(path, n, f"{INDEX} entry") for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def read_state_dict(path: str | Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, by HF name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files if files is not None else weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def take_quantized(hf: dict[str, torch.Tensor], qcfg: dict, cfg: ModelConfig) -> dict[str, QuantWeight]:
    """Pops every quantized linear out of ``hf``, fused as the model fuses floats: {module: QuantWeight}.

    Where a fused group mixes quantized and float parts, or schemes that cannot be concatenated, its
    quantized parts are dequantized (that group only) back into ``hf`` as float ``.weight`` tensors,
    so the float path fuses them as usual."""
    out: dict[str, QuantWeight] = {}
    for linear in linear_layout(cfg):
        names = [p.name for p in linear.parts]
        parts = [read_quantized(hf, qcfg, n) for n in names]
        if all(p is None for p in parts):
            continue
        if all(p is not None for p in parts):
            try:
                out[linear.name] = QuantWeight.cat(parts)
                continue
            except ValueError:
                pass
        for n, p in zip(names, parts):
            if p is not None:
                hf[n + ".weight"] = p.dequantize(torch.float32)
    return out


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig,
                       quantized: frozenset[str] | set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Maps HF tensor names onto this model's, concatenating the fused linears' parts.

    ``quantized``: modules taken out already as quantized linears (``take_quantized``); only their
    biases are mapped here. A tied LM head takes no tensor of its own."""
    out: dict[str, torch.Tensor] = {}
    for linear in linear_layout(cfg):
        names = [p.name for p in linear.parts]
        if linear.name == "lm_head" and cfg.tie_word_embeddings:
            hf.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
            continue
        if linear.name not in quantized:
            out[linear.name + ".weight"] = torch.cat([hf.pop(n + ".weight") for n in names])
        if all(n + ".bias" in hf for n in names):
            out[linear.name + ".bias"] = torch.cat([hf.pop(n + ".bias") for n in names])
    for name in list(hf):  # embeddings and norms: the HF name without the "model." prefix
        if "rotary_emb" not in name:
            out[name.removeprefix("model.")] = hf.pop(name)
    return out


def store_partial_rotary(state: dict[str, torch.Tensor], quantized: dict[str, QuantWeight], cfg: ModelConfig) -> None:
    """A partial rotary's q/k dims put where the whole-head rotary kernels turn them (llama.rotary_head_order):
    the qkv projection's rows (weight, bias, or a quantized weight's values, scales and zero points, whose
    groups run along the input) and the q/k norms' weights, in place."""
    rows = qkv_row_order(cfg)
    if rows is None:
        return
    head = rotary_head_order(cfg.head_dim, cfg.rotary_dims)
    for i in range(cfg.num_layers):
        name = f"layers.{i}.self_attn.qkv_proj"
        for key in (name + ".weight", name + ".bias"):
            if key in state:
                state[key] = state[key][rows]
        if name in quantized:
            w = quantized[name]
            quantized[name] = dataclasses.replace(w, values=w.q[rows], words=None, shape=None, scale=w.scale[rows],
                                                  zero=None if w.zero is None else w.zero[rows])
        for norm in ("q_norm", "k_norm"):
            key = f"layers.{i}.self_attn.{norm}.weight"
            if key in state:
                state[key] = state[key][head]


def store_norm_offset(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Gemma's RMSNorm scales by (1 + weight) in float32 (transformers' GemmaRMSNorm): every norm weight (Gemma 3's
    q/k norms too), already in the model's dtype, becomes 1 + weight computed and kept in float32, in place. The
    model's RMSNorm multiplies a float32 weight in float32 before rounding, so this is transformers' arithmetic
    exactly (its model in that dtype), in every dtype."""
    if cfg.norm_offset:
        for key in state:
            if key.endswith("norm.weight"):
                state[key] = 1.0 + state[key].float()


def _compute_dtype(stored: torch.dtype, quantized: dict) -> torch.dtype:
    """The checkpoint's float dtype, except that an integer weight-only checkpoint (W4A16, W8A16, or the two
    mixed as quant.auto widens layers) stored in float32 runs in bfloat16: "A16" says 16-bit activations, the
    int4 and int8 kernels of the one-call step serve bfloat16 models, and a float32 embedding / LM head would be
    the largest read of every decode step (113 of 170 MB on the embedded model). ``dtype=torch.float32``
    (``--dtype float32``) still asks for it."""
    weight_only = quantized and all(w.inputs is None and w.weights.type == "int" and w.weights.num_bits in (4, 8)
                                    for w in quantized.values())
    return torch.bfloat16 if weight_only and stored == torch.float32 else stored


def load_model(path: str | Path, dtype: torch.dtype | None = None, kernels="auto", hf_config: dict | None = None,
               files: list[Path] | None = None, tuning=None, config: ModelConfig | None = None,
               device: torch.device | str = "cpu") -> Transformer:
    """Builds the model from an HF-format directory (config.json + safetensors).

    ``kernels``: a ``KernelSet`` from infer.kernels.resolver, a function of the compute dtype giving
    one, or a backend name for the resolver (``auto``: RMSNorm, rotary and SiLU through
    kernels/layer_ops and bfloat16 linears prepacked for AMX tiles or oneDNN, runtime/model/packed_linear.py;
    ``torch``: every step in plain torch ops). The choice changes speed and rounding, not the maths.
    ``hf_config`` and ``files``: what a verified artifact already parsed and listed (else read here).
    ``tuning``: a runtime.tuning.Tuning measured on this machine: its per-shape linear kernels.
    ``config``: the model to build when it is not the checkpoint's own: a tensor-parallel rank's, with
    its share of the heads and MLP channels (runtime/parallel/layers.py), loaded from its rank file.
    ``device``: where the weights go (``kernels`` must suit it: resolver.resolve(..., device=)); each
    tensor is read on the CPU and copied there once."""
    path = Path(path)
    device = torch.device(device)
    hf_config = hf_config if hf_config is not None else json.loads((path / CONFIG).read_text())
    cfg = config or ModelConfig.from_hf(hf_config)
    hf = read_state_dict(path, files)
    quantized = {}
    if hf_config.get("quantization_config"):  # compressed-tensors: quantized linears keep their packed weights
        if not is_quantized_config(hf_config):
            raise ValueError(f"quantization_config.quant_method "
                             f"{hf_config['quantization_config'].get('quant_method')!r} is not supported; "
                             f"supported: compressed-tensors")
        quantized = take_quantized(hf, hf_config["quantization_config"], cfg)
    state = fuse_hf_state_dict(hf, cfg, set(quantized))
    store_partial_rotary(state, quantized, cfg)
    dtype = dtype or _compute_dtype(state["embed_tokens.weight"].dtype, quantized)
    if isinstance(kernels, str):
        from infer.kernels.resolver import resolve

        kernels = resolve(kernels, dtype=dtype, head_dim=cfg.head_dim, device=device)
    elif callable(kernels):
        kernels = kernels(dtype)
    if cfg.attn_softcap and kernels.backend == "triton":
        raise ValueError(f"attention logit soft-capping (config.json attn_logit_softcapping={cfg.attn_softcap}, "
                         f"Gemma 2) runs on the C++ decode kernel or torch SDPA; the triton decode kernel has no "
                         f"soft-cap yet: use kernels=cpp or kernels=torch")
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    unused = sorted(k for k in state if k not in expected)
    if unused:
        raise ValueError(f"checkpoint has tensors this model does not use: {unused[:5]} ...")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    store_norm_offset(state, cfg)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings and "lm_head" not in quantized:
        model.lm_head.weight = model.embed_tokens.weight
    if quantized:
        from .quant_linear import make_linear, place_streamed

        for name in list(quantized):  # each stored weight let go once its kernel's layout is built
            qweight = quantized.pop(name)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    make_linear(qweight, state.get(name + ".bias"), dtype, device).to(device))
            del qweight
        place_streamed(model)  # CPU buffers only
    del state, hf  # the model holds what it uses: packing below then frees each plain weight as it goes
    model.rotary = RotaryEmbedding.for_config(cfg).to(device)
    if cfg.local_rope_layers:  # Gemma 3's sliding layers' own
        model.rotary_local = RotaryEmbedding.for_config(cfg, local=True).to(device)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {missing[:5]}")
    model.use_fused_ops(kernels.layer_ops if dtype in (torch.float32, torch.bfloat16, torch.float16) else None)
    if dtype == torch.bfloat16 and kernels.linear_kernel(dtype) != "torch":
        from .packed_linear import pack_linears

        pack_linears(model, kernels.amx_linear, kernels.onednn_linear,
                     (lambda i, o, runs: tuning.linear(i, o, dtype, runs)) if tuning is not None else None,
                     kernels.bf16_linear)
    # which path runs a step, and why: logged, and kept as model.step_path for whoever reports the plan
    model.step_path = "python layer loop: no C++ step kernel on this CPU / kernel set"
    if kernels.step_layers is not None:
        from .fused_step import FusedStep

        why = FusedStep.declines(model)
        if why is None:
            model.fused_step = FusedStep(model, kernels)
            model.step_path = "fused C++ step (kernels/csrc/step_layers.cpp)"
        else:
            model.step_path = f"python layer loop: {why}"
    log.info("%s: steps run on the %s", cfg.model_type, model.step_path)
    model.kernels = kernels
    return model.eval().requires_grad_(False)
