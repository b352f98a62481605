"""Quantized linear layers: compressed-tensors checkpoints executed without expanding the model to float.

A checkpoint written by llm-compressor (``quantization_config.quant_method: compressed-tensors``)
stores, per quantized ``nn.Linear``:
- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 (``32/bits`` values a word, little end
  first, each stored as ``q + 2**(bits-1)``), ``weight_scale`` [N, groups], ``weight_zero_point``
  (asymmetric; packed along the output dim), ``weight_g_idx`` (activation order), ``weight_shape``;
- ``int-quantized`` (W8A8): ``weight`` int8 [N, K], ``weight_scale`` [N, 1]; activations are
  quantized per token at run time (dynamic) or with a stored ``input_scale`` (static);
- ``float-quantized`` (FP8): ``weight`` float8_e4m3fn, ``weight_scale`` [N, 1] or [1].

``read_quantized`` parses those into ``QuantWeight`` records, ``QuantWeight.cat`` fuses q/k/v or
gate/up along the output dimension (per-tensor scales are expanded to per-channel, static input
scales take the maximum, as vLLM does), and ``make_linear`` asks the registered **backends**, in
order, for a module that runs it. A backend is anything with ``name``, ``supports(w, device)`` and
``build(w, bias, dtype)``; ``register_backend`` puts a new one (a Triton GPU kernel, say) first.

CPU backends here, fastest first:
- ``cpu-int4``: ``aten._weight_int4pack_mm_for_cpu`` (run in bfloat16) on weights packed once at load by
  ``_convert_weight_to_int4pack_for_cpu`` (int4, groups of 32..256; symmetric or asymmetric;
  activation order handled by permuting the weight's columns at load and the input at run time);
- ``cpu-int8-weight``: ``aten._weight_int8pack_mm`` (int8 per-channel symmetric, 16-bit activations);
- ``cpu-w8a8``: dynamic per-token int8 activations and ``torch._int_mm`` (int32 accumulation);
- ``cpu-fp8``: per-token fp8 activations; fp8 codes multiplied as bfloat16 (exact widening), since
  this torch's CPU ``_scaled_mm`` is a slow reference path;
- ``dequant``: everything else, dequantizing one layer's weight per call (never the whole model).
Activation quantization follows compressed-tensors exactly (scale = absmax / (range/2), round,
clamp), so the runtime computes what transformers' decompressing forward computes.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

INT4_COMPUTE_DTYPE = torch.bfloat16  # see Int4PackLinear

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
                   "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")


@dataclass(frozen=True)
class Args:
    """The parts of compressed-tensors QuantizationArgs the runtime acts on."""
    num_bits: int
    type: str  # int | float
    strategy: str  # tensor | channel | group | token
    symmetric: bool = True
    group_size: int | None = None
    dynamic: bool = False

    @classmethod
    def from_config(cls, d: dict | None) -> "Args | None":
        if not d:
            return None
        return cls(num_bits=d["num_bits"], type=d.get("type", "int"), strategy=d.get("strategy") or "tensor",
                   symmetric=d.get("symmetric", True), group_size=d.get("group_size"),
                   dynamic=bool(d.get("dynamic", False)))


@dataclass
class QuantWeight:
    """One quantized linear's weight: integer (or fp8) values and how to scale them back."""
    weights: Args
    inputs: Args | None  # activation quantization, None for weight-only schemes
    q: torch.Tensor  # [N, K]: int8 holding signed integer values, or float8_e4m3fn
    scale: torch.Tensor  # [N, groups] (channel: groups=1), float
    zero: torch.Tensor | None = None  # [N, groups] int8 signed zero points (asymmetric)
    g_idx: torch.Tensor | None = None  # [K] group of each input column (activation order)
    input_scale: torch.Tensor | None = None  # static activation scale (per tensor)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def group_size(self) -> int:
        return self.in_features // self.scale.shape[1]

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Fuses projections that read the same input along the output dimension."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(p.weights != first.weights or p.inputs != first.inputs for p in parts):
            raise ValueError("fused projections use different quantization schemes")
        if any((p.g_idx is None) != (first.g_idx is None) or
               (p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)) for p in parts):
            raise ValueError("fused projections use different activation orders")
        groups = max(p.scale.shape[1] for p in parts)
        scales = [p.scale.expand(p.out_features, groups) if p.scale.shape[1] == 1 else p.scale for p in parts]
        if len({s.shape[1] for s in scales}) != 1:
            raise ValueError("fused projections use different group sizes")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        ins = [p.input_scale for p in parts if p.input_scale is not None]
        return QuantWeight(first.weights, first.inputs, torch.cat([p.q for p in parts]), torch.cat(scales), zero,
                           first.g_idx, torch.stack([s.reshape(()) for s in ins]).max() if ins else None)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] (one layer's worth: used per call by the fallback, or for fusing)."""
        n, k = self.q.shape
        scale = self.scale.float()
        if self.g_idx is not None:
            idx = self.g_idx.long()
            w = self.q.float()
            if self.zero is not None:
                w = w - self.zero.float()[:, idx]
            return (w * scale[:, idx]).to(dtype)
        g = scale.shape[1]
        w = self.q.float().view(n, g, k // g)
        if self.zero is not None:
            w = w - self.zero.float()[:, :, None]
        return (w * scale[:, :, None]).view(n, k).to(dtype)


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` undone for 4 and 8 bits: signed int8 values."""
    if 32 % num_bits:
        raise ValueError(f"{num_bits}-bit packing is not supported (4 or 8)")
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, count, 1).t().contiguous()
    per = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32)
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [rows, words, per]
    vals = vals.reshape(packed.shape[0], packed.shape[1] * per)[:, :count]
    return (vals - (1 << (num_bits - 1))).to(torch.int8)


# ---------------------------------------------------------------------------- reading a checkpoint

def _match(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


def scheme_for(qcfg: dict, name: str) -> tuple[Args, Args | None] | None:
    """The (weights, input activations) args of the config group that targets module ``name``, or None."""
    if any(_match(p, name) and p != "Linear" for p in qcfg.get("ignore") or []):
        return None
    for group in (qcfg.get("config_groups") or {}).values():
        if any(_match(t, name) for t in group.get("targets") or []):
            return Args.from_config(group.get("weights")), Args.from_config(group.get("input_activations"))
    return None


def is_quantized_config(config: dict) -> bool:
    q = config.get("quantization_config") or {}
    return q.get("quant_method") == "compressed-tensors"


def read_quantized(hf: dict[str, torch.Tensor], qcfg: dict, name: str) -> QuantWeight | None:
    """Pops module ``name``'s compressed tensors from ``hf`` (HF names) into a QuantWeight; None when
    the checkpoint stores that module unquantized."""
    p = name + "."
    if p + "weight_packed" not in hf and p + "weight_scale" not in hf:
        return None
    scheme = scheme_for(qcfg, name)
    if scheme is None:
        raise ValueError(f"{name}: quantized tensors but no quantization_config group targets it")
    wargs, iargs = scheme
    fmt = qcfg.get("format")
    if wargs.type == "float" and wargs.num_bits != 8 or wargs.num_bits not in (4, 8):
        raise ValueError(f"{name}: {wargs.num_bits}-bit {wargs.type} weights are not supported (int4, int8, fp8)")
    if p + "weight_global_scale" in hf:
        raise ValueError(f"{name}: NVFP4-style global scales are not supported")
    scale = hf.pop(p + "weight_scale")
    if p + "weight_packed" in hf:
        packed = hf.pop(p + "weight_packed")
        shape = hf.pop(p + "weight_shape").tolist()
        q = unpack_int32(packed, wargs.num_bits, int(shape[1]))
        zero = hf.pop(p + "weight_zero_point", None)
        if zero is not None:
            zero = unpack_int32(zero, wargs.num_bits, int(shape[0]), dim=0) if zero.dtype == torch.int32 else zero.to(torch.int8)
    else:
        q = hf.pop(p + "weight")
        zero = hf.pop(p + "weight_zero_point", None)
        if zero is not None and not torch.count_nonzero(zero):
            zero = None
        if zero is not None:
            zero = zero.to(torch.int8)
    if q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{name}: weight dtype {q.dtype} is not a quantized one (format {fmt})")
    n = q.shape[0]
    scale = scale.reshape(n, -1) if scale.numel() >= n else scale.reshape(1, 1).expand(n, 1).contiguous()
    if zero is not None:
        zero = zero.reshape(n, -1) if zero.numel() >= n else zero.reshape(1, 1).expand(n, 1).contiguous()
    g_idx = hf.pop(p + "weight_g_idx", None)
    if g_idx is not None and scale.shape[1] > 1:
        gs = q.shape[1] // scale.shape[1]
        if torch.equal(g_idx.long(), torch.arange(q.shape[1]) // gs):
            g_idx = None  # the trivial order: plain groups
    input_scale = hf.pop(p + "input_scale", None)
    hf.pop(p + "input_zero_point", None)
    if iargs is not None and not iargs.dynamic and input_scale is None:
        raise ValueError(f"{name}: static activation quantization without an input_scale")
    if iargs is not None and not iargs.symmetric:
        raise ValueError(f"{name}: asymmetric activation quantization is not supported")
    return QuantWeight(wargs, iargs, q.contiguous(), scale, zero, None if g_idx is None else g_idx.to(torch.int32),
                       None if iargs is None or iargs.dynamic else input_scale.float().reshape(()))


# ---------------------------------------------------------------------------- activation quantization

def quantize_activations(x: torch.Tensor, args: Args, static_scale: torch.Tensor | None):
    """x [M, K] float -> (values, scale [M, 1] or [1, 1] float32) as compressed-tensors computes them."""
    xf = x.float().contiguous()  # the kernels read the quantized values as row-major
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float()
    else:
        if args.strategy == "token":
            absmax = xf.abs().amax(dim=-1, keepdim=True)
        else:  # dynamic per-tensor
            absmax = xf.abs().amax().reshape(1, 1)
        half_range = 127.5 if args.type == "int" else 448.0
        scale = absmax / half_range
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    scaled = xf / scale
    if args.type == "int":
        return torch.round(scaled.clamp(-128, 127)).to(torch.int8), scale
    return scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def fake_quantize_activations(x: torch.Tensor, args: Args, static_scale: torch.Tensor | None) -> torch.Tensor:
    v, s = quantize_activations(x, args, static_scale)
    return (v.float() * s).to(x.dtype)


# ---------------------------------------------------------------------------- modules

class QuantLinear(nn.Module):
    """Base of the quantized linears: y = x W^T (+ b) for x [..., K]."""
    backend = "?"

    def __init__(self, w: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = w.in_features, w.out_features
        self.scheme = _describe(w)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}, backend={self.backend}"


def _describe(w: QuantWeight) -> str:
    s = f"w={w.weights.type}{w.weights.num_bits}/{w.weights.strategy}"
    if w.scale.shape[1] > 1:
        s += f"{w.group_size}"
    if w.zero is not None:
        s += "/asym"
    if w.inputs is not None:
        s += f" a={w.inputs.type}{w.inputs.num_bits}/{'dynamic-' if w.inputs.dynamic else 'static-'}{w.inputs.strategy}"
    return s


class Int4PackLinear(QuantLinear):
    """int4 grouped weights, packed once for ``aten._weight_int4pack_mm_for_cpu``.

    The kernel runs in bfloat16 by default: in this torch its float32 variant is several times
    slower than the float32 dense matmul it replaces, its bfloat16 one several times faster.
    ``compute_dtype=torch.float32`` gives the exact float32 result (used to check the packing)."""
    backend = "cpu-int4"

    def __init__(self, w: QuantWeight, bias, dtype, compute_dtype: torch.dtype | None = None):
        super().__init__(w, bias, dtype)
        self.compute_dtype = compute_dtype or INT4_COMPUTE_DTYPE
        q, scale, zero = w.q, w.scale.float(), w.zero
        perm = None
        if w.g_idx is not None:  # activation order: sort columns by group so groups are contiguous
            perm = torch.argsort(w.g_idx.long(), stable=True)
            q = q[:, perm]
        self.register_buffer("perm", perm, persistent=False)
        self.group_size = w.group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            (q.to(torch.int32) + 8).contiguous(), 1), persistent=False)
        # the kernel computes (u - 8) * scale + zero for the unsigned nibble u = q + 8
        zeros = torch.zeros_like(scale) if zero is None else -zero.float() * scale
        self.register_buffer("scales_zeros", torch.stack([scale, zeros], -1).transpose(0, 1).contiguous()
                             .to(self.compute_dtype), persistent=False)

    def matmul(self, x):
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.compute_dtype).contiguous(), self.packed,
                                                       self.group_size, self.scales_zeros)
        return y.to(x.dtype)


class Int8WeightLinear(QuantLinear):
    """int8 per-channel symmetric weights, 16/32-bit activations: ``aten._weight_int8pack_mm``."""
    backend = "cpu-int8-weight"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.register_buffer("weight_int8", w.q.contiguous(), persistent=False)
        self.register_buffer("scales", w.scale.reshape(-1).to(dtype).contiguous(), persistent=False)

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scales)


class W8A8Linear(QuantLinear):
    """int8 weights and int8 per-token activations: ``torch._int_mm`` with int32 accumulation."""
    backend = "cpu-w8a8"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.args, self.out_dtype = w.inputs, dtype
        self.register_buffer("weight_t", w.q.t().contiguous(), persistent=False)  # [K, N]
        self.register_buffer("wscale", w.scale.reshape(1, -1).float(), persistent=False)
        self.register_buffer("input_scale", w.input_scale, persistent=False)

    def matmul(self, x):
        xq, xs = quantize_activations(x, self.args, self.input_scale)
        acc = torch._int_mm(xq, self.weight_t)
        return (acc.float() * (xs * self.wscale)).to(x.dtype)


class FP8Linear(QuantLinear):
    """fp8 e4m3 weights and per-token fp8 activations, multiplied as bfloat16 codes.

    This torch's CPU ``_scaled_mm`` is a slow reference path (measured ~15x slower than the dense
    float32 matmul), and converting fp8 to float per call is slower still. Every e4m3 value is exactly
    a bfloat16 value, so the weight's codes are widened once at load to bfloat16 (half the bytes of
    float32, exact), activations are quantized to fp8 per token exactly as compressed-tensors does
    and widened the same way, and the product of codes runs on the bfloat16 matmul (AMX where
    present, float32 accumulation) before the two scales are applied."""
    backend = "cpu-fp8"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.args = w.inputs
        self.register_buffer("weight_codes", w.q.to(torch.bfloat16).contiguous(), persistent=False)  # [N, K]
        self.register_buffer("wscale", w.scale.reshape(1, -1).float().contiguous(), persistent=False)
        self.register_buffer("input_scale", w.input_scale, persistent=False)

    def matmul(self, x):
        xq, xs = quantize_activations(x, self.args, self.input_scale)
        acc = torch.nn.functional.linear(xq.to(torch.bfloat16), self.weight_codes)
        return (acc.float() * (xs * self.wscale)).to(x.dtype)


class DequantLinear(QuantLinear):
    """Any scheme: keeps the compressed weight and dequantizes this one layer per call."""
    backend = "dequant"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.w, self.dtype = w, dtype
        for k in ("q", "scale", "zero", "g_idx", "input_scale"):
            if getattr(w, k) is not None:
                self.register_buffer(k, getattr(w, k), persistent=False)

    def matmul(self, x):
        w = replace(self.w, q=self.q, scale=self.scale, zero=getattr(self, "zero", None),
                    g_idx=getattr(self, "g_idx", None))
        if w.inputs is not None:
            x = fake_quantize_activations(x, w.inputs, getattr(self, "input_scale", None))
        return x @ w.dequantize(x.dtype).t()


# ---------------------------------------------------------------------------- backends

class LinearBackend(Protocol):
    name: str

    def supports(self, w: QuantWeight, device: torch.device) -> bool: ...

    def build(self, w: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module: ...


@dataclass(frozen=True)
class _Backend:
    name: str
    cls: type
    test: object  # (QuantWeight, device) -> bool

    def supports(self, w, device):
        return self.test(w, device)

    def build(self, w, bias, dtype):
        return self.cls(w, bias, dtype)


def _cpu(device):
    return torch.device(device).type == "cpu"


def _has(op: str) -> bool:
    try:
        getattr(torch.ops.aten, op)
        return True
    except (AttributeError, RuntimeError):
        return False


_INT4 = _has("_weight_int4pack_mm_for_cpu") and _has("_convert_weight_to_int4pack_for_cpu")
_INT8 = _has("_weight_int8pack_mm")

BACKENDS: list = [
    _Backend("cpu-int4", Int4PackLinear, lambda w, d: _cpu(d) and _INT4 and w.inputs is None and
             w.weights.type == "int" and w.weights.num_bits == 4 and w.scale.shape[1] > 1 and
             w.group_size in (32, 64, 128, 256) and w.in_features % w.group_size == 0),
    _Backend("cpu-int8-weight", Int8WeightLinear, lambda w, d: _cpu(d) and _INT8 and w.inputs is None and
             w.weights.type == "int" and w.weights.num_bits == 8 and w.scale.shape[1] == 1 and w.zero is None),
    _Backend("cpu-w8a8", W8A8Linear, lambda w, d: _cpu(d) and w.inputs is not None and w.inputs.type == "int" and
             w.inputs.num_bits == 8 and w.weights.type == "int" and w.weights.num_bits == 8 and
             w.scale.shape[1] == 1 and w.zero is None and w.inputs.strategy in ("token", "tensor")),
    _Backend("cpu-fp8", FP8Linear, lambda w, d: _cpu(d) and w.inputs is not None and
             w.inputs.type == "float" and w.weights.type == "float" and w.scale.shape[1] == 1 and
             w.inputs.strategy in ("token", "tensor")),
    _Backend("dequant", DequantLinear, lambda w, d: True),
]


def register_backend(backend: LinearBackend, first: bool = True) -> None:
    """Adds a backend (e.g. a Triton kernel for CUDA) ahead of the built-in ones."""
    BACKENDS.insert(0 if first else len(BACKENDS) - 1, backend)


_DISABLED: set[str] = set()


@contextlib.contextmanager
def disabled_backends(*names: str):
    """Within the block, models load without these backends (e.g. ``disabled_backends("cpu-int4")``
    to run int4 layers through ``dequant``). ``INFER_LINEAR_BACKENDS_DISABLE=a,b`` does the same
    for a whole process."""
    added = set(names) - _DISABLED
    _DISABLED.update(added)
    try:
        yield
    finally:
        _DISABLED.difference_update(added)


def make_linear(w: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device | str = "cpu", disable: tuple[str, ...] = ()) -> nn.Module:
    """The first registered backend that supports ``w`` on ``device`` builds its module."""
    off = set(disable) | _DISABLED | {n for n in os.environ.get("INFER_LINEAR_BACKENDS_DISABLE", "").split(",") if n}
    off.discard("dequant")  # the fallback that always works
    for b in BACKENDS:
        if b.name not in off and b.supports(w, torch.device(device)):
            return b.build(w, bias, dtype)
    raise ValueError(f"no linear backend supports {_describe(w)} on {device}")  # pragma: no cover


__all__ = ["Args", "QuantWeight", "QuantLinear", "LinearBackend", "BACKENDS", "register_backend", "make_linear",
           "read_quantized", "is_quantized_config", "unpack_int32"]


# ---------------------------------------------------------------------------- the model's fused layout

def take_quantized(hf: dict[str, torch.Tensor], qcfg: dict, num_layers: int) -> dict[str, QuantWeight]:
    """Pops every quantized linear out of ``hf`` (HF names), fused the way runtime.model fuses floats:
    returns {model module name: QuantWeight}. Where a fused group mixes quantized and float parts, or
    schemes that cannot be concatenated, its quantized parts are dequantized (that group only) back
    into ``hf`` as float ``.weight`` tensors, so the float path fuses them as usual."""
    out: dict[str, QuantWeight] = {}
    groups = []
    for i in range(num_layers):
        hp, mp = f"model.layers.{i}.", f"layers.{i}."
        groups += [(mp + "self_attn.qkv_proj", [hp + f"self_attn.{n}_proj" for n in "qkv"]),
                   (mp + "self_attn.o_proj", [hp + "self_attn.o_proj"]),
                   (mp + "mlp.gate_up_proj", [hp + "mlp.gate_proj", hp + "mlp.up_proj"]),
                   (mp + "mlp.down_proj", [hp + "mlp.down_proj"])]
    groups.append(("lm_head", ["lm_head"]))
    for fused, names in groups:
        parts = [read_quantized(hf, qcfg, n) for n in names]
        if all(p is None for p in parts):
            continue
        if all(p is not None for p in parts):
            try:
                out[fused] = QuantWeight.cat(parts)
                continue
            except ValueError:
                pass
        for n, p in zip(names, parts):
            if p is not None:
                hf[n + ".weight"] = p.dequantize(torch.float32)
    return out


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module name: backend} of the quantized linears in a model."""
    return {n: m.backend for n, m in model.named_modules() if isinstance(m, QuantLinear)}


__all__ += ["take_quantized", "quantized_modules", "disabled_backends"]
