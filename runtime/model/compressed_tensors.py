"""The compressed-tensors checkpoint format, read: what llm-compressor writes, as plain records.

The one reader of this format, used by the runtime's loader and by the build pipeline. A
checkpoint (``quantization_config.quant_method: compressed-tensors``) stores, per quantized
``nn.Linear``:
- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 (``32/bits`` values a word, little end
  first, each stored as ``q + 2**(bits-1)``), ``weight_scale`` [N, groups], ``weight_zero_point``
  (asymmetric; packed along the output dim), ``weight_g_idx`` (activation order), ``weight_shape``;
- ``int-quantized`` (W8A8): ``weight`` int8 [N, K], ``weight_scale`` [N, 1]; activations are
  quantized per token at run time (dynamic) or with a stored ``input_scale`` (static);
- ``float-quantized`` (FP8): ``weight`` float8_e4m3fn, ``weight_scale`` [N, 1] or [1].

``read_quantized`` parses those into ``QuantWeight`` records; ``QuantWeight.cat`` fuses q/k/v or
gate/up along the output dimension (per-tensor scales are expanded to per-channel, static input
scales take the maximum, as vLLM does). ``matches`` is compressed-tensors' target/ignore rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


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
    values: torch.Tensor | None  # [N, K]: int8 holding signed integer values, or float8_e4m3fn (see ``q``)
    scale: torch.Tensor  # [N, groups] (channel: groups=1), float
    zero: torch.Tensor | None = None  # [N, groups] int8 signed zero points (asymmetric)
    g_idx: torch.Tensor | None = None  # [K] group of each input column (activation order)
    input_scale: torch.Tensor | None = None  # static activation scale (per tensor)
    # 4-bit pack-quantized weights as stored: [N, K/8] int32 words, 8 values q + 8 a word, little end first. Kept
    # so that a kernel with a nibble layout of its own repacks them word by word (kernels/int4_linear.py's
    # pack_words); ``values`` (None until then) is unpacked from them only where something reads ``q``.
    words: torch.Tensor | None = None
    shape: tuple[int, int] | None = None  # [N, K] of ``words``

    @property
    def q(self) -> torch.Tensor:
        if self.values is None:
            self.values = unpack_int32(self.words, 4, self.shape[1])
        return self.values

    @property
    def out_features(self) -> int:
        return self.shape[0] if self.values is None else self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1] if self.values is None else self.values.shape[1]

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
        input_scale = torch.stack([s.reshape(()) for s in ins]).max() if ins else None
        if all(p.values is None for p in parts):  # still as stored: the words fuse as the values would
            return QuantWeight(first.weights, first.inputs, None, torch.cat(scales), zero, first.g_idx, input_scale,
                               torch.cat([p.words for p in parts]), (sum(p.out_features for p in parts), first.in_features))
        return QuantWeight(first.weights, first.inputs, torch.cat([p.q for p in parts]), torch.cat(scales), zero,
                           first.g_idx, input_scale)

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


def matches(target: str, name: str) -> bool:
    """compressed-tensors' rule for a target or ignore entry: ``re:REGEX`` (matched from the start),
    the class name ``Linear`` (every linear), an exact module name or a name suffix."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


def scheme_for(qcfg: dict, name: str) -> tuple[Args, Args | None] | None:
    """The (weights, input activations) args of the config group that targets module ``name``, or None."""
    if any(matches(p, name) and p != "Linear" for p in qcfg.get("ignore") or []):
        return None
    for group in (qcfg.get("config_groups") or {}).values():
        if any(matches(t, name) for t in group.get("targets") or []):
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
    words = None
    if p + "weight_packed" in hf:
        packed = hf.pop(p + "weight_packed")
        shape = hf.pop(p + "weight_shape").tolist()
        if wargs.num_bits == 4 and packed.dtype == torch.int32 and packed.shape == (shape[0], -(-shape[1] // 8)):
            words, q = packed.contiguous(), None  # unpacked only if something reads QuantWeight.q
        else:
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
    if q is not None and q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{name}: weight dtype {q.dtype} is not a quantized one (format {fmt})")
    n, k = (int(shape[0]), int(shape[1])) if q is None else q.shape
    scale = scale.reshape(n, -1) if scale.numel() >= n else scale.reshape(1, 1).expand(n, 1).contiguous()
    if zero is not None:
        zero = zero.reshape(n, -1) if zero.numel() >= n else zero.reshape(1, 1).expand(n, 1).contiguous()
    g_idx = hf.pop(p + "weight_g_idx", None)
    if g_idx is not None and scale.shape[1] > 1:
        gs = k // scale.shape[1]
        if torch.equal(g_idx.long(), torch.arange(k) // gs):
            g_idx = None  # the trivial order: plain groups
    input_scale = hf.pop(p + "input_scale", None)
    hf.pop(p + "input_zero_point", None)
    if iargs is not None and not iargs.dynamic and input_scale is None:
        raise ValueError(f"{name}: static activation quantization without an input_scale")
    if iargs is not None and not iargs.symmetric:
        raise ValueError(f"{name}: asymmetric activation quantization is not supported")
    return QuantWeight(wargs, iargs, None if q is None else q.contiguous(), scale, zero,
                       None if g_idx is None else g_idx.to(torch.int32),
                       None if iargs is None or iargs.dynamic else input_scale.float().reshape(()),
                       words, None if words is None else (n, k))
