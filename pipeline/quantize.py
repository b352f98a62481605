"""The quantize stage: an HF checkpoint in, a compressed-tensors checkpoint out.

The algorithms are llm-compressor's (``oneshot`` with GPTQModifier, AWQModifier,
SmoothQuantModifier, QuantizationModifier). This module owns what surrounds them:

- ``plan(cfg, checkpoint_config)`` maps the recipe's ``quant.*`` keys onto a compressed-tensors
  scheme and checks everything that can be checked *before* calibration starts (group sizes
  against every targeted layer's input size, ``quant.ignore`` patterns against the model's
  layers, method/key combinations), raising ``QuantError`` naming the key, the layer and the
  valid choices;
- ``calibration_windows`` turns ``calib.*`` into token windows (see ``datasets``);
- ``quantize`` runs ``oneshot`` layer by layer (llm-compressor's sequential pipeline: one
  decoder layer's activations at a time), single-threaded-deterministically, with AWQ's
  ``pin_memory`` made a no-op where there is no accelerator, and writes the compressed
  checkpoint (``quantization_config.quant_method: compressed-tensors``).

Scheme per method (weights; activations):
  gptq  int{4,8}, group ``group_size`` (-1: per channel), sym/asym, optional activation order;
        16-bit activations (W4A16 / W8A16, ``pack-quantized``)
  awq   int4 like gptq after AWQ's activation-aware scaling (``pack-quantized``)
  w8a8  SmoothQuant (``smoothing_strength``) then GPTQ: int8 per-channel symmetric weights,
        int8 dynamic per-token symmetric activations (``int-quantized``)
  fp8   float8 e4m3 per-channel weights, dynamic per-token fp8 activations (FP8_DYNAMIC,
        ``float-quantized``); data-free, so no calibration
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from infer.runtime.model.compressed_tensors import matches
from infer.runtime.model.llama import HFLinear, ModelConfig, linear_layout

from .config import BuildConfig

log = logging.getLogger("infer.build")


class QuantError(ValueError):
    """Quantization settings that cannot work; the message names the recipe key and the valid choices."""


@dataclass
class QuantPlan:
    method: str
    scheme: dict  # compressed-tensors QuantizationScheme fields (weights / input_activations)
    format: str  # pack-quantized | int-quantized | float-quantized
    ignore: list[str]
    targets: list[str] = field(default_factory=list)  # the linear layers that will be quantized
    needs_calibration: bool = True

    def record(self) -> dict:
        return {"method": self.method, "format": self.format, "scheme": self.scheme, "ignore": self.ignore,
                "quantized_layers": len(self.targets)}


def model_linears(config: dict) -> list[HFLinear]:
    """Every nn.Linear of a Llama/Qwen2 checkpoint, by HF name, from its config.json alone (the
    runtime's declared layout, so what is quantized here is what the runtime fuses)."""
    return [part for fused in linear_layout(ModelConfig.from_hf(config)) for part in fused.parts]


def _divisor_choices(sizes: set[int]) -> list[int]:
    g = 0
    for s in sizes:
        g = s if g == 0 else __import__("math").gcd(g, s)
    return [c for c in (8, 16, 32, 64, 128, 256, 512, 1024) if g % c == 0] + [-1]


def plan(cfg: BuildConfig, config: dict) -> QuantPlan:
    """The scheme the recipe asks for, checked against the model; raises QuantError before any work."""
    q = cfg.quant
    method = q.method.value
    if config.get("quantization_config"):
        raise QuantError(f"quant.method={method}: the source checkpoint is already quantized "
                         f"({config['quantization_config'].get('quant_method')}); build it with quant=none "
                         f"to package it as it is")
    if config.get("model_type") not in ("llama", "qwen2"):
        raise QuantError(f"quant.method={method}: model_type {config.get('model_type')!r} is not supported; "
                         f"supported: llama, qwen2")
    linears = model_linears(config)
    for pattern in q.ignore:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise QuantError(f"quant.ignore: {pattern!r} is not a valid regular expression ({e})") from None
        if not any(matches(pattern, lin.name) for lin in linears):
            raise QuantError(f"quant.ignore: {pattern!r} matches no linear layer of this model; use a layer name "
                             f"(lm_head, model.layers.0.mlp.down_proj), a suffix (down_proj) or re:REGEX")
    targets = [lin for lin in linears if not any(matches(p, lin.name) for p in q.ignore)]
    if not targets:
        raise QuantError(f"quant.ignore={list(q.ignore)}: leaves no layer to quantize")

    if method in ("w8a8", "fp8"):
        if q.group_size != -1:
            raise QuantError(f"quant.group_size={q.group_size}: {method} quantizes weights per output channel; "
                             f"valid choices: -1")
        if not q.symmetric:
            raise QuantError(f"quant.symmetric=false: {method} is symmetric only; valid choices: true")
    if q.act_order and method != "gptq":
        raise QuantError(f"quant.act_order=true: activation order is a GPTQ option; {method} takes false")
    if q.act_order and q.group_size == -1:
        raise QuantError("quant.act_order=true: activation order needs groups; set quant.group_size (e.g. 64)")
    if q.group_size != -1:
        bad = [lin for lin in targets if lin.in_features % q.group_size]
        if bad:
            choices = _divisor_choices({lin.in_features for lin in targets})
            first = bad[0]
            raise QuantError(f"quant.group_size={q.group_size} does not divide the input size of layer {first.name} "
                             f"(in_features {first.in_features}; {len(bad)} layers affected); valid choices for this "
                             f"model: {', '.join(map(str, choices))}")

    if method in ("gptq", "awq"):
        weights = {"num_bits": q.bits, "type": "int", "symmetric": q.symmetric, "dynamic": False,
                   "strategy": "group" if q.group_size != -1 else "channel",
                   "group_size": q.group_size if q.group_size != -1 else None}
        if method == "gptq":
            weights["actorder"] = "group" if q.act_order else None
        scheme, fmt = {"weights": weights}, "pack-quantized"
    elif method == "w8a8":
        scheme = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                        "strategy": "token"}}
        fmt = "int-quantized"
    elif method == "fp8":
        scheme = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                        "strategy": "token"}}
        fmt = "float-quantized"
    else:  # pragma: no cover - config validation admits no other method
        raise QuantError(f"quant.method={method}: unknown")
    return QuantPlan(method, scheme, fmt, list(q.ignore), [lin.name for lin in targets],
                     needs_calibration=method != "fp8")


def calibration_windows(cfg: BuildConfig, tokenizer_dir: Path) -> tuple[list[list[int]], dict]:
    """The calibration token windows and their record (data, sizes, sha256 of the tokens)."""
    from tokenizers import Tokenizer

    from infer.eval.datasets import DataError, load_texts, texts_digest, token_windows, windows_digest

    c = cfg.calib
    try:
        texts = load_texts(c.data, "calibration", key="calib.data")
    except DataError as e:
        raise QuantError(str(e)) from None
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    class _Enc:  # tokenizers' Tokenizer, spoken to as token_windows expects
        @staticmethod
        def encode(text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens).ids

    try:
        windows = token_windows(texts, _Enc, c.seq_len, c.samples, c.seed)
    except DataError as e:
        raise QuantError(str(e)) from None
    record = {"data": c.data, "documents": len(texts), "text_sha256": texts_digest(texts), "samples": len(windows),
              "seq_len": c.seq_len, "seed": c.seed, "tokens_sha256": windows_digest(windows)}
    return windows, record


@contextlib.contextmanager
def _cpu_safe_awq():
    """AWQ pins its cached activations for faster host-to-device copies; without an accelerator
    ``pin_memory`` raises ("Cannot access accelerator device when none is available"). Pinning is a
    pure transfer optimisation, so on a CPU-only machine it is skipped."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def _modifiers(p: QuantPlan, cfg: BuildConfig) -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = {k: QuantizationArgs(**{kk: vv for kk, vv in v.items() if vv is not None}) for k, v in p.scheme.items()}
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **args)}
    if p.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return [GPTQModifier(config_groups=groups, ignore=p.ignore, dampening_frac=cfg.quant.dampening_frac,
                             actorder="group" if cfg.quant.act_order else None)]
    if p.method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=p.ignore)]
    if p.method == "w8a8":
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=cfg.quant.smoothing_strength),
                GPTQModifier(config_groups=groups, ignore=p.ignore, dampening_frac=cfg.quant.dampening_frac)]
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups=groups, ignore=p.ignore)]


COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                "chat_template.jinja")


def quantize(checkpoint: Path, out: Path, cfg: BuildConfig, p: QuantPlan, windows: list[list[int]]) -> dict:
    """The stage body: ``oneshot`` over ``checkpoint`` into ``out`` as a compressed-tensors checkpoint."""
    import time

    import torch
    import transformers
    from datasets import Dataset

    config = json.loads((checkpoint / "config.json").read_text())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.get("dtype") or config.get("torch_dtype") or "float32", torch.float32)
    log.info("quantize: %s %s on %d layers, calibration %s", p.method, p.format, len(p.targets),
             f"{len(windows)} x {len(windows[0])} tokens" if p.needs_calibration else "none (data-free)")
    torch.manual_seed(cfg.calib.seed)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype, low_cpu_mem_usage=True)
    model.eval()
    dataset = None
    if p.needs_calibration:
        dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    from llmcompressor import oneshot

    with _cpu_safe_awq():
        oneshot(model=model, dataset=dataset, recipe=_modifiers(p, cfg),
                num_calibration_samples=len(windows) if dataset is not None else 0,
                max_seq_length=cfg.calib.seq_len, shuffle_calibration_samples=False,
                pipeline="sequential" if dataset is not None else "datafree")
    calibrated = time.perf_counter() - start
    model.save_pretrained(out, save_compressed=True)
    for name in COPIED_FILES:  # the source's tokenizer files, byte for byte
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)
    _normalise_config(out, config)
    return {"method": p.method, "format": p.format, "oneshot_seconds": round(calibrated, 3),
            "quantized_layers": len(p.targets)}


def _normalise_config(out: Path, source_config: dict) -> None:
    """save_pretrained writes transformers' view of the config; keep the source's top-level rope_theta
    (readers that fall back to 10000 silently produce nonsense) and sorted keys for stable bytes."""
    from infer.runtime.artifact import dump_json

    config = json.loads((out / "config.json").read_text())
    for key in ("rope_theta",):
        if key in source_config and key not in config:
            config[key] = source_config[key]
    dump_json(config, out / "config.json")
