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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from infer.runtime.artifact import CONFIG, dump_json
from infer.runtime.memory import weight_budget
from infer.runtime.model.compressed_tensors import matches
from infer.runtime.model.families import FAMILIES
from infer.runtime.model.llama import HFLinear, ModelConfig, linear_layout

from .config import BuildConfig
from .stage import copy_carried_files

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
    wide: list[str] = field(default_factory=list)  # of the targets, those at quant.wide_bits (second group)
    wide_scheme: dict | None = None
    smoothing_strength: float | None = None  # w8a8: the one SmoothQuant alpha of this build (0: none)

    def record(self) -> dict:
        out = {"method": self.method, "format": self.format, "scheme": self.scheme, "ignore": self.ignore,
               "quantized_layers": len(self.targets)}
        if self.wide:
            out.update(wide_layers=self.wide, wide_scheme=self.wide_scheme)
        if self.smoothing_strength is not None:
            out["smoothing_strength"] = self.smoothing_strength
        return out


# the families (runtime/model/families.py) llm-compressor quantizes here, each checked against transformers on
# the checkpoint it writes (tests/test_families_quant.py): a decoder layer class for its sequential pipeline and
# AWQ smoothing mappings for each (llmcompressor AWQ_MAPPING_REGISTRY: Llama's for llama, qwen2, qwen3, mistral;
# Phi-3's own for its fused qkv_proj / gate_up_proj). A family the runtime serves but not listed is refused by
# name before any stage.
QUANTIZABLE = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text")
# methods that fold scales into a norm's weight before the linears it feeds
SMOOTHING = {"awq": "AWQ", "w8a8": "SmoothQuant"}
# families whose RMSNorm multiplies by (1 + weight) (Gemma 1, 2, 3; Gemma 3's q/k norms too).
# llm-compressor 0.14 turns those norms into plain-weight ones for the whole oneshot (modeling/offset_norm.py),
# but of its mappings only Gemma 2's and 3's AWQ ones are right for their sandwich norms (MLP smoothed from
# pre_feedforward_layernorm): its SmoothQuant mapping for them is Llama's (post_attention_layernorm, which in
# Gemma 2/3 feeds the residual, not gate/up), Gemma 1's are Llama's defaults, and no check here tells a right
# smoothing of these norms from a wrong one (a tiny model's int4 error hides it), so smoothing stays refused
ONE_PLUS_NORMS = tuple(t for t, f in FAMILIES.items() if f.norm_offset)
FLOAT_WIDENED = ("fp8", "w8a8")  # quant.auto's wider format for these: float (the layer joins quant.ignore)


def auto_problem(cfg: BuildConfig) -> str | None:
    """Why ``quant.auto=true`` cannot work with the other quant settings (None: it can), naming the fix."""
    q = cfg.quant
    method = q.method.value
    if not q.auto:
        return None
    if method in ("gptq", "awq"):
        if q.bits != 4:
            return (f"quant.auto=true: with {method} the wider format is int{q.wide_bits} (quant.wide_bits), "
                    f"which needs quant.bits=4 (got {q.bits}); set quant.bits=4, or use method w8a8 or fp8, "
                    f"whose wider format is float")
        return None
    if method in FLOAT_WIDENED:
        if q.wide_layers:
            return (f"quant.auto=true: with {method} the widened layers stay in float (they join quant.ignore); "
                    f"quant.wide_layers={list(q.wide_layers)} (int{q.wide_bits} weight-only) does not apply; "
                    f"remove quant.wide_layers")
        if len(smoothing_candidates(cfg)) > 1:
            return (f"quant.auto=true with quant.smoothing_strength={smoothing_candidates(cfg)}: the gates choose "
                    f"one thing at a time; set one SmoothQuant strength (smollm2_135m_w8a8's gates chose 0.8 at "
                    f"128 x 512 calibration) and let quant.auto choose the float layers")
        return None
    return (f"quant.auto=true: method {method} quantizes nothing, so there is nothing to widen; valid with: "
            f"gptq, awq (widened to int8), w8a8, fp8 (widened to float)")


def smoothing_candidates(cfg: BuildConfig) -> list[float]:
    """quant.smoothing_strength as a list of candidates (one number: one candidate)."""
    s = cfg.quant.smoothing_strength
    return [float(x) for x in (s if isinstance(s, (list, tuple)) else [s])]


def model_linears(config: dict) -> list[HFLinear]:
    """Every nn.Linear of a checkpoint, by HF name, from its config.json alone (the
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
    if config.get("model_type") not in QUANTIZABLE:
        raise QuantError(f"quant.method={method}: model_type {config.get('model_type')!r} is not supported; "
                         f"supported: {', '.join(QUANTIZABLE)}; build it with quant=none")
    if config.get("model_type") in ONE_PLUS_NORMS and method in SMOOTHING and not (
            method == "w8a8" and smoothing_candidates(cfg) == [0.0]):
        raise QuantError(f"quant.method={method}: {SMOOTHING[method]} folds its scales into the RMSNorm weights, which "
                         f"model_type {config['model_type']!r} applies as (1 + weight), and its llm-compressor mapping "
                         f"is not checked for that here; use quant.method=gptq or fp8"
                         + (", or w8a8 with quant.smoothing_strength=0" if method == "w8a8" else ""))
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
    strengths = smoothing_candidates(cfg)
    if len(strengths) > 1 and method != "w8a8":
        raise QuantError(f"quant.smoothing_strength={strengths}: candidates are a w8a8 setting (SmoothQuant); "
                         f"{method} takes one number")
    if len(strengths) > 1:
        raise QuantError(f"quant.smoothing_strength={strengths}: several candidates are chosen between by the eval "
                         f"gates (infer-build chooses and builds them in turn); one build takes one number")
    problem = auto_problem(cfg)
    if problem:
        raise QuantError(problem)
    wide = []
    for pattern in q.wide_layers:
        hits = [lin.name for lin in targets if matches(pattern, lin.name)]
        if not hits:
            raise QuantError(f"quant.wide_layers: {pattern!r} matches no quantized linear layer of this model "
                             f"(ignored layers stay float); use a layer name, a suffix or re:REGEX")
        wide += [h for h in hits if h not in wide]
    if wide and (method not in ("gptq", "awq") or q.bits != 4):
        raise QuantError(f"quant.wide_layers: widening to {q.wide_bits} bits applies to 4-bit gptq/awq only "
                         f"(method {method}, bits {q.bits})")
    wide = [lin.name for lin in targets if lin.name in wide]  # model order

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
        if method == "gptq":  # "static": columns ordered by activation while quantizing, plain groups stored
            weights["actorder"] = "group" if q.act_order else "static"
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
    wide_scheme = None
    if wide:
        wide_scheme = {"weights": {"num_bits": q.wide_bits, "type": "int", "symmetric": True, "dynamic": False,
                                   "strategy": "channel"}}
        if method == "gptq":
            wide_scheme["weights"]["actorder"] = "static"
    return QuantPlan(method, scheme, fmt, list(q.ignore), [lin.name for lin in targets],
                     needs_calibration=method != "fp8", wide=wide, wide_scheme=wide_scheme,
                     smoothing_strength=strengths[0] if method == "w8a8" else None)


def calibration_windows(cfg: BuildConfig, tokenizer_dir: Path) -> tuple[list[list[int]], dict]:
    """The calibration token windows and their record (data, sizes, sha256 of the tokens).

    ``calib.chat_fraction`` of the windows are conversations rendered through the checkpoint's chat
    template (the data's own ``messages``, else turns built from its documents), the rest raw text;
    a checkpoint without a chat template gets raw windows only, and the record says so."""
    import hashlib

    from infer.eval.datasets import (DataError, chat_windows, conversations_from_texts, load_conversations,
                                     load_texts, texts_digest, token_windows, windows_digest)
    from infer.runtime.engine.tokenizer import Tokenizer

    c = cfg.calib
    try:
        texts = load_texts(c.data, "calibration", key="calib.data")
        conversations = load_conversations(c.data, key="calib.data")
    except DataError as e:
        raise QuantError(str(e)) from None
    tok = Tokenizer(tokenizer_dir)
    n_chat = round(c.chat_fraction * c.samples)
    chat = {"fraction": c.chat_fraction, "samples": 0}
    if n_chat and tok.chat_template is None:
        if conversations:
            raise QuantError(f"calib.data={c.data}: holds conversations but the checkpoint has no chat template to "
                             f"render them; add one (chat_template in tokenizer_config.json) or use text data")
        log.warning("calib.chat_fraction=%s: the checkpoint has no chat template; calibrating on raw text only",
                    c.chat_fraction)
        chat["skipped"] = "the checkpoint has no chat template"
        n_chat = 0

    def render(messages):
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))

    try:
        raw = token_windows(texts, tok, c.seq_len, c.samples - n_chat, c.seed) if c.samples > n_chat else []
        if n_chat:
            source = conversations or conversations_from_texts(texts, c.seed)
            chat.update(samples=n_chat, conversations=len(source),
                        source="calib.data messages" if conversations else "built from calib.data documents",
                        template_sha256=hashlib.sha256(tok.chat_template.encode()).hexdigest())
            windows = raw + chat_windows(source, render, c.seq_len, n_chat, c.seed)
        else:
            windows = raw
    except DataError as e:
        raise QuantError(str(e)) from None
    record = {"data": c.data, "documents": len(texts), "text_sha256": texts_digest(texts), "samples": len(windows),
              "seq_len": c.seq_len, "seed": c.seed, "raw_samples": len(raw), "chat": chat,
              "tokens_sha256": windows_digest(windows)}
    return windows, record


@contextlib.contextmanager
def _layer_progress(layers: int):
    """Logs each calibrated piece with the time it took and an estimate of the time left. llm-compressor's
    sequential pipeline calibrates one subgraph at a time (a decoder layer each, then what follows the last)
    and restarts its progress bars for each; a 7B build runs for hours, so the stage says how many."""
    import time

    from llmcompressor.core import LifecycleCallbacks

    original = LifecycleCallbacks.__dict__["sequential_epoch_end"]
    total, ends = layers + 1, [time.perf_counter()]

    def epoch_end(*args, **kwargs):
        result = original.__get__(None, LifecycleCallbacks)(*args, **kwargs)
        ends.append(time.perf_counter())
        done = len(ends) - 1
        # the first subgraph (the embeddings, up to the first layer) is quick: the estimate is the layers' pace
        each = (ends[-1] - ends[1]) / (done - 1) if done > 1 else ends[1] - ends[0]
        log.info("quantize: %d/%d subgraphs calibrated (one a decoder layer), %.1f s each, about %.1f min left",
                 done, total, each, max(total - done, 0) * each / 60)
        return result

    LifecycleCallbacks.sequential_epoch_end = epoch_end
    try:
        yield
    finally:
        LifecycleCallbacks.sequential_epoch_end = original


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
    from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, QuantizationScheme

    # actorder is the GPTQ modifier's to apply (and the two must not disagree): not part of the stored args
    args = {k: QuantizationArgs(**{kk: vv for kk, vv in v.items() if vv is not None and kk != "actorder"})
            for k, v in p.scheme.items()}
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **args)}
    if p.wide:  # two groups: every target named, so that no layer matches both
        wide_args = {k: QuantizationArgs(**{kk: vv for kk, vv in v.items() if vv is not None and kk != "actorder"})
                     for k, v in p.wide_scheme.items()}
        groups = {"group_0": QuantizationScheme(targets=[t for t in p.targets if t not in p.wide], **args),
                  "group_1": QuantizationScheme(targets=list(p.wide), **wide_args)}
    if p.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        # llm-compressor's own default is actorder="static" (weight columns quantized in decreasing order
        # of their Hessian diagonal, no g_idx in the checkpoint); passing None here switched it off, which
        # cost the embedded model ~9 points of perplexity (docs/quantization.md, "GPTQ against llm-compressor")
        return [GPTQModifier(config_groups=groups, ignore=p.ignore, dampening_frac=cfg.quant.dampening_frac,
                             actorder=ActivationOrdering.GROUP if cfg.quant.act_order else ActivationOrdering.STATIC)]
    if p.method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=p.ignore)]
    if p.method == "w8a8":
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        smooth = [SmoothQuantModifier(smoothing_strength=p.smoothing_strength)] if p.smoothing_strength else []
        return smooth + [GPTQModifier(config_groups=groups, ignore=p.ignore, dampening_frac=cfg.quant.dampening_frac,
                                      actorder=ActivationOrdering.STATIC)]
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups=groups, ignore=p.ignore)]


def hf_attention(config: dict) -> dict:
    """transformers' loading arguments that compute this family as the runtime does: its SDPA attention drops
    Gemma 2's attn_logit_softcapping (only the eager attention caps), so calibration would see other activations.
    Every family with soft-cap keys runs eager: Gemma 3 too (no attention soft-cap), the attention its runtime is
    checked against (tests/test_gemma3.py)."""
    return {"attn_implementation": "eager"} if FAMILIES[config["model_type"]].softcaps else {}


def quantize(checkpoint: Path, out: Path, cfg: BuildConfig, p: QuantPlan, windows: list[list[int]]) -> dict:
    """The stage body: ``oneshot`` over ``checkpoint`` into ``out`` as a compressed-tensors checkpoint."""
    import time

    import torch
    import transformers
    from datasets import Dataset

    config = json.loads((checkpoint / CONFIG).read_text())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.get("dtype") or config.get("torch_dtype") or "float32", torch.float32)
    log.info("quantize: %s %s on %d layers, calibration %s", p.method, p.format, len(p.targets),
             f"{len(windows)} x {len(windows[0])} tokens" if p.needs_calibration else "none (data-free)")
    torch.manual_seed(cfg.calib.seed)
    start = time.perf_counter()
    try:
        with _weights_within(checkpoint, cfg, out) as placement:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch_dtype, low_cpu_mem_usage=True, **placement, **hf_attention(config))
            model.eval()
            return _calibrate_and_save(model, checkpoint, out, cfg, p, windows, config, start)
    finally:
        model = None
        _release_calibration_memory()


def _release_calibration_memory() -> None:
    """Gives the calibrated model's memory back before the next stage: llm-compressor's session keeps the model
    (and its modifiers' state) after ``oneshot`` until reset, and glibc keeps freed heap pages. The 7B AWQ build
    held 10 GiB anonymous into the tune stage, which then loaded the 6 GiB artifact beside it (18.1 GiB peak)."""
    import ctypes
    import gc

    from llmcompressor.core import reset_session

    reset_session()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def _calibrate_and_save(model, checkpoint: Path, out: Path, cfg: BuildConfig, p: QuantPlan, windows: list[list[int]],
                        config: dict, start: float) -> dict:
    import time

    import torch
    from datasets import Dataset

    dataset = None
    if p.needs_calibration:
        dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    from llmcompressor import oneshot

    # oneshot turns every (1 + weight) norm into a plain one and back in the checkpoint's dtype
    # (llmcompressor/modeling/offset_norm.py): in bfloat16 that moved Gemma 2's norm weights by up to 2^-8. These
    # families are refused the smoothing methods (ONE_PLUS_NORMS), so their norms go back as they came
    norms = ({n: t.detach().clone() for n, t in model.named_parameters() if n.endswith("norm.weight")}
             if config.get("model_type") in ONE_PLUS_NORMS else {})
    with _cpu_safe_awq(), _layer_progress(config["num_hidden_layers"]):
        oneshot(model=model, dataset=dataset, recipe=_modifiers(p, cfg),
                num_calibration_samples=len(windows) if dataset is not None else 0,
                max_seq_length=cfg.calib.seq_len, shuffle_calibration_samples=False,
                pipeline="sequential" if dataset is not None else "datafree")
    with torch.no_grad():
        for name, weight in norms.items():
            model.get_parameter(name).copy_(weight)
    calibrated = time.perf_counter() - start
    model.save_pretrained(out, save_compressed=True, max_shard_size="2GB")  # a shard's worth in memory at a time
    copy_carried_files(checkpoint, out)  # the source's tokenizer files, byte for byte
    _normalise_config(out, config)
    return {"method": p.method, "format": p.format, "oneshot_seconds": round(calibrated, 3),
            "quantized_layers": len(p.targets)}


def memory_budget(cfg: BuildConfig) -> int:
    """Bytes of weights the quantize stage may hold in memory (quant.memory_gib, else the runtime's weight_budget)."""
    if cfg.quant.memory_gib is not None:
        return int(cfg.quant.memory_gib * 2**30)
    return weight_budget()


@contextlib.contextmanager
def _weights_within(checkpoint: Path, cfg: BuildConfig, out: Path):
    """from_pretrained's placement arguments: none when the checkpoint fits the budget; otherwise as many layers
    as fit stay in memory and the rest wait on disk, in a folder beside the stage's output that goes with it.
    Without this a 7B bfloat16 model (15 GB) was resident whole, and every layer the calibration rewrote
    (AWQ's scales) stayed in anonymous memory besides: ~0.7 GiB more a layer, ~20 GiB by the last of 28,
    before the compressed copy is written."""
    size, budget = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")), memory_budget(cfg)
    if size <= budget:
        yield {}
        return
    from compressed_tensors.offload import load_offloaded_model

    folder = Path(tempfile.mkdtemp(prefix=".offload-", dir=out.parent))
    log.info("quantize: %.1f GiB of weights against a budget of %.1f GiB (quant.memory_gib): layers beyond it wait "
             "on disk in %s", size / 2**30, budget / 2**30, folder)
    try:
        with load_offloaded_model():
            yield {"device_map": "auto_offload", "max_memory": {"cpu": budget}, "offload_folder": str(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _normalise_config(out: Path, source_config: dict) -> None:
    """save_pretrained writes transformers' view of the config; keep the source's top-level rope_theta
    (readers that fall back to 10000 silently produce nonsense) and sorted keys for stable bytes."""
    config = json.loads((out / CONFIG).read_text())
    for key in ("rope_theta",):
        if key in source_config and key not in config:
            config[key] = source_config[key]
    dump_json(config, out / CONFIG)


# ---------------------------------------------------------------------------- accuracy-gated mixed precision

def fused_groups(config: dict, targets: list[str]) -> list[tuple[str, list[HFLinear]]]:
    """The runtime's fused linears (q/k/v, o, gate/up, down per layer) whose parts are all quantized:
    the unit of widening, since a fused linear keeps one representation."""
    names = set(targets)
    return [(f.name, list(f.parts)) for f in linear_layout(ModelConfig.from_hf(config))
            if f.parts and all(p.name in names for p in f.parts)]


def widening_cost(parts: list[HFLinear], cfg: BuildConfig, scale_bytes: int = 4) -> int:
    """Bytes a fused linear grows by at quant.wide_bits per channel instead of quant.bits in groups."""
    q = cfg.quant
    cost = 0
    for p in parts:
        n, k = p.out_features, p.in_features
        groups = 1 if q.group_size == -1 else k // q.group_size
        narrow = n * k * q.bits // 8 + n * groups * scale_bytes * (1 if q.symmetric else 2)
        cost += n * k * q.wide_bits // 8 + n * scale_bytes - narrow
    return cost


def float_widening_cost(parts: list[HFLinear], float_bytes: int = 4, scale_bytes: int = 4) -> int:
    """Bytes a fused linear grows by in float (``float_bytes`` a weight: the checkpoint's dtype) instead of
    8 bits a weight with one scale per output channel (fp8, w8a8)."""
    return sum(p.out_features * p.in_features * (float_bytes - 1) - p.out_features * scale_bytes for p in parts)


def fake_quant_scheme(method: str) -> dict:
    """The runtime's quantization args (weights per channel, activations per token, dynamic) of an 8-bit
    method, for ``layer_sensitivity``'s fake quantization."""
    kind = {"fp8": "float", "w8a8": "int"}[method]
    return {"weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                                  "strategy": "token"}}


def layer_sensitivity(float_dir: Path, quant_dir: Path | None, windows: list[list[int]], groups,
                      fake_quant: str | None = None) -> dict[str, float]:
    """Mean KL(float || float with only this fused linear quantized), per token over ``windows``: how much
    quantizing that one linear costs the output distribution.

    ``fake_quant=None`` (gptq, awq: weight-only): the linear's weights are replaced by ``quant_dir``'s
    quantized ones, dequantized. ``fake_quant="fp8"|"w8a8"``: the linear is fake-quantized in place as the
    runtime computes the scheme (weights round-to-nearest per output channel, its inputs per token,
    dynamic: scale absmax / 448 for e4m3, absmax / 127.5 for int8; ``quant_dir`` is not read). For fp8 that
    is exactly what the build writes (FP8_DYNAMIC is data-free); for w8a8 it leaves out SmoothQuant and
    GPTQ's error compensation, so it ranks the linears by the scheme's own error.

    In transformers, float32: each decoder layer's inputs are kept from one float pass, so a linear in
    layer L costs a forward of layers L.. only."""
    import torch
    import transformers

    from infer.runtime.model.compressed_tensors import Args, read_quantized
    from infer.runtime.model.loader import read_state_dict
    from infer.runtime.model.quant_linear import fake_quantize_activations

    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, dtype=torch.float32, **hf_attention(json.loads((Path(float_dir) / CONFIG).read_text()))).eval()
    if fake_quant is None:
        qcfg = json.loads((Path(quant_dir) / CONFIG).read_text())["quantization_config"]
        qstate = read_state_dict(quant_dir)
    else:
        fq = {k: Args.from_config(v) for k, v in fake_quant_scheme(fake_quant).items()}
    layers = model.model.layers
    captured: dict[int, tuple] = {}

    def keep(i):
        def hook(module, args, kwargs):
            captured[i] = (args, kwargs)
        return hook

    ids = torch.tensor(windows)
    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits.float().log_softmax(-1)
    for h in handles:
        h.remove()

    def from_layer(i):
        args, kwargs = captured[i]
        hidden = args[0] if args else kwargs["hidden_states"]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        for layer in layers[i:]:
            out = layer(hidden, *args[1:], **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return model.lm_head(model.model.norm(hidden)).float().log_softmax(-1)

    out = {}
    with torch.no_grad():
        for name, parts in groups:
            i = int(name.split(".")[1])
            saved, hooks = {}, []
            for p in parts:
                mod = model.get_submodule(p.name)
                saved[p.name] = mod.weight.data
                if fake_quant is None:
                    mod.weight.data = read_quantized(dict(qstate), qcfg, p.name).dequantize(torch.float32)
                else:
                    mod.weight.data = fake_quantize_activations(saved[p.name], fq["weights"], None)
                    hooks.append(mod.register_forward_pre_hook(
                        lambda m, a: (fake_quantize_activations(a[0].reshape(-1, a[0].shape[-1]),
                                                                fq["input_activations"], None).reshape(a[0].shape),)))
            lq = from_layer(i)
            out[name] = float((ref.exp() * (ref - lq)).sum(-1).mean())
            for h in hooks:
                h.remove()
            for p in parts:
                model.get_submodule(p.name).weight.data = saved[p.name]
    return out


def auto_steps(cfg: BuildConfig, record: dict, build_unpublished):
    """The candidates of ``quant.auto``, lazily: every layer quantized first (the recipe as it is, auto off);
    when that fails its gates, each fused linear's sensitivity (``layer_sensitivity`` on calibration windows,
    against the unquantized model) and widening cost, then the most sensitive linears per byte widened in
    steps of quant.auto_steps (shares of the budget: quant.size_budget_pct of the plain artifact's size).

    The wider format: gptq/awq (4-bit) widen to quant.wide_bits (int8 per channel, ``quant.wide_layers``);
    fp8 and w8a8 (8-bit) widen to float, the checkpoint's dtype (the layer joins ``quant.ignore``)."""
    from dataclasses import replace

    method = cfg.quant.method.value
    to_float = method in FLOAT_WIDENED  # gate.choose_and_build has refused what auto_problem names
    plain = replace(cfg, quant=replace(cfg.quant, auto=False, **({} if to_float else {"wide_layers": []})))
    key = "quant.ignore" if to_float else "quant.wide_layers"
    yield "plain", {key: list(plain.quant.ignore) if to_float else []}, plain
    from .config import baseline_config

    packaged = build_unpublished(plain).artifact
    unquantized = build_unpublished(replace(baseline_config(cfg), model=cfg.model))  # the gates' baseline, model.dtype
    config = json.loads((unquantized.artifact / CONFIG).read_text())
    p = plan(plain, config)
    groups = fused_groups(config, p.targets)
    windows, _ = calibration_windows(plain, packaged)
    pick = [windows[0], windows[-1]] if len(windows) > 1 else windows[:1]  # a raw and a chat window
    pick = [w[:256] for w in pick]
    log.info("quant.auto: sensitivity of %d fused linears on %d windows of %d tokens%s", len(groups), len(pick),
             len(pick[0]), f" ({method} fake-quantized)" if to_float else "")
    sens = layer_sensitivity(unquantized.artifact, packaged, pick, groups, fake_quant=method if to_float else None)
    dtype = config.get("dtype") or config.get("torch_dtype")
    float_bytes = scale_bytes = 2 if dtype in ("bfloat16", "float16") else 4  # both the checkpoint's dtype
    if to_float:
        cost = {name: float_widening_cost(parts, float_bytes, scale_bytes) for name, parts in groups}
        wide_format = f"float ({dtype or 'float32'}, quant.ignore)"
    else:
        cost = {name: widening_cost(parts, plain, scale_bytes) for name, parts in groups}
        wide_format = f"int{cfg.quant.wide_bits} per channel, weight-only (quant.wide_layers)"
    size = sum(f.stat().st_size for f in Path(packaged).glob("*.safetensors"))
    budget = size * cfg.quant.size_budget_pct / 100
    order = sorted(sens, key=lambda n: -sens[n] / cost[n])  # most error removed per byte first
    total_params = sum(lin.out_features * lin.in_features for _, parts in groups for lin in parts)
    record.update(sensitivity={n: float(f"{v:.6g}") for n, v in sens.items()}, widening_cost_bytes=cost,
                  plain_size_bytes=size, budget_bytes=int(budget), order=order, wide_format=wide_format)
    parts = dict(groups)
    chosen: list[str] = []
    for share in cfg.quant.auto_steps:
        total, pick_names = 0, []
        for n in order:
            if total + cost[n] <= share * budget:
                pick_names.append(n)
                total += cost[n]
        if not pick_names or pick_names == chosen or (to_float and len(pick_names) == len(order)):
            continue  # nothing new, or (float) nothing left quantized; every linear at int8 is still W8A16
        chosen = pick_names
        layers = [lin.name for n in chosen for lin in parts[n]]
        if to_float:
            params = sum(lin.out_features * lin.in_features for n in chosen for lin in parts[n])
            label = (f"{len(chosen)} fused linears in float ({100 * params / total_params:.0f}% of the quantized "
                     f"weights; +{total / 1e6:.1f} MB, {share:g} of the budget)")
            ignore = [*plain.quant.ignore, *layers]
            yield label, {"quant.ignore": ignore}, replace(plain, quant=replace(plain.quant, ignore=ignore))
        else:
            label = (f"{len(chosen)} fused linears at {cfg.quant.wide_bits} bits (+{total / 1e6:.1f} MB, "
                     f"{share:g} of the budget)")
            yield label, {"quant.wide_layers": layers}, replace(plain, quant=replace(plain.quant, wide_layers=layers))
