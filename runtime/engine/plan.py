"""The plan: what runs, decided once when a runner is built, and followed by every step.

Three things decide it. The kernel set (infer.kernels.resolver) says which kernels this CPU class has
built. The loader picks each linear's kernel as it lays out the weights (runtime/model/packed_linear.py
for 16-bit linears, quant_linear.make_linear for quantized ones) and whether the model's layers fit the
one-call C++ step (FusedStep.declines). The plan adds the KV cache's format, the model's attention
features and the tuning table, and decides how each kind of row runs:

- decode rows (one query over its context): the paged decode kernel, or gather + SDPA at the batch
  sizes where the tuning table measured SDPA faster;
- verify rows (a decode and its draft tokens, speculative decoding): decode rows, each over the
  context up to its own position;
- prompt chunks: in place through the chunk kernel (fresh chunks and chunks after cached tokens
  alike), or SDPA where there is none; or as decode rows, where the cache is int8 (only the decode
  kernel reads it) or the model has sliding-window layers (the chunk kernels attend from position 0).
  A capped model (Gemma 2's attention soft-cap) takes SDPA with explicit scores: the chunk kernels
  have no cap;

and, per step (``route``), whether the one-call C++ step takes it. ModelRunner builds each step's
attention from the plan's kernels, ``StepInputs.one_call`` carries the step's path to the model, and
``describe()`` is what the load log, ``/version`` and the benchmarks print.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from infer.kernels import isa

log = logging.getLogger("infer.engine")

ONE_CALL = "one-call"  # kernels/csrc/step_layers.cpp: every layer of a step in one C++ call
LAYER_LOOP = "layer-loop"  # Transformer.forward's Python loop over the layers


@dataclass(frozen=True)
class Plan:
    backend: str  # cpp | torch | triton (infer.kernels.resolver)
    amx: bool  # AMX tiles in use (linears, chunk attention)
    cpu_class: str | None  # kernels/isa.py's active class where the C++ kernels run, else None
    device: str
    dtype: str  # the model's compute dtype
    kv_cache: str  # the KV cache's dtype: the model's, or int8
    layer_ops: str  # RMSNorm, rotary, SiLU-and-multiply: cpp | triton | torch
    linears: dict  # linear name (qkv_proj, ..., lm_head) -> "scheme kernel", with the layers where they differ
    step: str  # ONE_CALL where every layer fits kernels/csrc/step_layers.cpp, else LAYER_LOOP
    step_why: str  # the reason for ``step``: what declined the one-call step
    prompt_rows: str  # "chunks" | "decode-rows" (int8 cache, sliding-window layers)
    decode_attention: str  # cpp | triton | torch-sdpa
    prefill_attention: str  # prompt chunks: the chunk kernel (amx | avx512bf16 | avx512 | avx2) or torch-sdpa;
    # "decode" where prompt rows are decode rows
    sampler: str  # sampled rows' filters and draw: cpp (kernels/sample_rows.py) | torch (sort, softmax, cumsum, ...)
    # the callables each step's attention reads (None: that part runs gather + SDPA or index_copy_)
    decode_kernel: Callable | None = field(default=None, repr=False, compare=False)
    store_kv: Callable | None = field(default=None, repr=False, compare=False)
    chunk_kernel: Callable | None = field(default=None, repr=False, compare=False)
    tuning: object = field(default=None, repr=False, compare=False)
    draw_kernel: Callable | None = field(default=None, repr=False, compare=False)  # the sampler's, or None: torch

    @property
    def decode_rows_only(self) -> bool:
        return self.prompt_rows == "decode-rows"

    def decode_on_kernel(self, rows: int) -> bool:
        """Whether a step with ``rows`` decode rows runs them on the paged decode kernel (else gather + SDPA)."""
        if self.decode_kernel is None:
            return False
        if self.tuning is None or self.kv_cache == "int8" or not rows:
            return True  # an int8 cache is read by the decode kernel alone
        return self.tuning.decode_attention(rows) != "torch-sdpa"

    def decode_bf16_dots(self, rows: int) -> bool:
        """False where the tuning table chose the decode kernel's float path (``cpp-float``) for ``rows`` decode
        rows on a bfloat16 cache (the kernel's flag; it reads an int8 or float cache the same either way)."""
        return self.tuning is None or not rows or self.tuning.decode_attention(rows) != "cpp-float"

    def route(self, chunks: int, decode_rows: int) -> tuple[str, ...]:
        """What runs a step with ``chunks`` prompt chunks and ``decode_rows`` decode rows: (ONE_CALL,) or
        the layer loop's attention paths, each "what:kernel" (decode:cpp, decode:torch-sdpa,
        chunks:avx512bf16, chunks:torch-sdpa)."""
        decode = None
        if decode_rows:
            decode = self.decode_attention if self.decode_on_kernel(decode_rows) else "torch-sdpa"
        chunk = self.prefill_attention if chunks else None  # a chunk kernel is named by its CPU class (or amx)
        if self.step == ONE_CALL and decode in (None, "cpp") and chunk in (None, *isa.CLASSES):
            return (ONE_CALL,)
        return tuple(p for p in (f"chunks:{chunk}" if chunk else None, f"decode:{decode}" if decode else None) if p)

    def describe(self) -> dict:
        """What runs each piece, as the load log, /version and the benchmarks' JSON print it."""
        d = {"backend": self.backend, "amx": self.amx, "cpu_class": self.cpu_class, "device": self.device,
             "dtype": self.dtype, "kv_cache": self.kv_cache, "step": self.step, "step_why": self.step_why, "layer_ops": self.layer_ops,
             "decode_attention": self.decode_attention, "prompt_rows": self.prompt_rows,
             "prefill_attention": self.prefill_attention, "verify_rows": "decode-rows", "sampler": self.sampler,
             "linears": self.linears}
        if self.tuning is not None and self.decode_kernel is not None:  # the buckets the table runs on SDPA
            sdpa = [b for b in self.tuning.buckets if not self.decode_on_kernel(b)]
            if sdpa:
                d["sdpa_decode_batches"] = sdpa
            widened = [b for b in self.tuning.buckets if self.decode_on_kernel(b) and not self.decode_bf16_dots(b)]
            if widened:
                d["float_dot_decode_batches"] = widened
        return d


def sliding_window(cfg) -> tuple[int | None, tuple[bool, ...] | None]:
    """(the window, which layers slide) of a ModelConfig, or (None, None) when every layer attends in full.
    A query at position p sees positions p - window + 1 .. p in a sliding layer (transformers' rule)."""
    if not cfg.layer_windows:
        return None, None
    windows = {w for w in cfg.layer_windows if w is not None}
    if len(windows) != 1:
        raise ValueError(f"layer windows {sorted(windows)}: one window size for every sliding layer is supported")
    return windows.pop(), tuple(w is not None for w in cfg.layer_windows)


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")


def kv_cache_dtype(requested: str, artifact: str | None, model_dtype: torch.dtype, kernels) -> torch.dtype:
    """The KV cache's dtype: ``requested`` (--kv-cache-dtype), where "auto" follows the artifact's manifest
    (``artifact``: the format its build chose, None: the model's dtype). A 16-bit name means the model's
    dtype (the cache holds what the model computes); int8 is the quantized cache, which needs the C++ CPU
    kernels (the only ones that read it): ValueError naming the fix otherwise; "auto" then falls back to
    the model's dtype. Tensor-parallel ranks each allocate their own KV heads' cache in the same dtype."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={requested!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    want = artifact if requested == "auto" else requested
    if want != "int8":
        return model_dtype
    why = None
    if kernels.backend != "cpp" or kernels.decode_attention is None or kernels.store_kv is None:
        why = (f"the {kernels.backend} kernels cannot read it (only the C++ CPU kernels do: kernels=auto or cpp "
               f"on the CPU)")
    if why is None:
        return torch.int8
    if requested == "auto":
        log.warning("the artifact's KV cache is int8, but %s: using %s", why, model_dtype)
        return model_dtype
    raise ValueError(f"kv_cache_dtype=int8: {why}; use kv_cache_dtype={str(model_dtype).removeprefix('torch.')}")


PROMPT_ROWS = ("auto", "decode-rows")


def make_plan(model, kernels, kv_dtype: torch.dtype, tuning=None, prompt_rows: str = "auto") -> Plan:
    """The plan for ``model`` (loaded with the KernelSet ``kernels``), a cache of ``kv_dtype`` and ``tuning``
    (runtime/tuning.py's table, or None). ``prompt_rows`` "decode-rows" runs prompt rows as decode rows on a
    16-bit cache too: a reference that reads its cache by the same kernels as the int8 cache is read, so that
    comparing the two measures the format and not the prompt kernels' rounding (bench/kv_cache.py)."""
    if prompt_rows not in PROMPT_ROWS:
        raise ValueError(f"prompt_rows={prompt_rows!r}: choose one of {', '.join(PROMPT_ROWS)}")
    cfg = model.config
    described = kernels.describe(model.dtype)
    window, _ = sliding_window(cfg)
    decode_rows = kv_dtype == torch.int8 or window is not None or prompt_rows == "decode-rows"
    chunk = None if decode_rows or cfg.attn_softcap else kernels.prefill_attention
    prefill = "decode" if decode_rows else described["prefill_attention"] if chunk is not None else "torch-sdpa"
    if chunk is not None and kernels.chunk_attention is not chunk:
        raise AssertionError("the resolver gives chunks after cached tokens and fresh ones one kernel")  # resolver.py
    step = ONE_CALL if model.fused_step is not None else LAYER_LOOP
    return Plan(kernels.backend, kernels.amx, described["isa"], str(model.device), _name(model.dtype), _name(kv_dtype),
                described["layer_ops"], linear_kernels(model), step, model.step_path,
                "decode-rows" if decode_rows else "chunks", described["decode_attention"], prefill,
                described["sampler"], kernels.decode_attention, kernels.store_kv, chunk, tuning,
                kernels.draw_rows)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def linear_kernel(module: nn.Module) -> str:
    """"scheme kernel" of one linear: "bfloat16 blocks", "w=int4/group64 cpu-int4-blocks", "float32 torch"."""
    named = getattr(module, "kernel_name", None)  # quantized, packed and tensor-parallel linears say their own
    if named is not None:
        return named
    if isinstance(module, nn.Linear):
        return f"{_name(module.weight.dtype)} torch"
    return type(module).__name__


def linear_kernels(model) -> dict:
    """Each linear of the decoder layers and the LM head -> its kernel; where layers differ (quant.auto's
    mixed builds), "kernel: layers i,j,...; kernel2: layers ..."."""
    out = {}
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for name in names:
        by_kernel: dict[str, list[int]] = {}
        for i, layer in enumerate(model.layers):
            by_kernel.setdefault(linear_kernel(layer.get_submodule(name)), []).append(i)
        short = name.split(".")[-1]
        if len(by_kernel) == 1:
            out[short] = next(iter(by_kernel))
        else:
            out[short] = "; ".join(f"{k}: layers {','.join(map(str, v))}" for k, v in by_kernel.items())
    out["lm_head"] = linear_kernel(model.lm_head)
    return out
