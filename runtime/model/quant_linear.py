"""Quantized linear layers: compressed-tensors weights executed without expanding the model to float.

``make_linear`` asks the registered **backends**, in order, for a module that runs a
``QuantWeight`` (runtime/model/compressed_tensors.py reads them from a checkpoint). A backend is
anything with ``name``, ``supports(w, device)`` and ``build(w, bias, dtype)``; ``register_backend``
puts a new one (a Triton GPU kernel, say) first.

CPU backends here, fastest first:
- ``cpu-int4-blocks``: kernels/csrc/int4_linear.cpp on every CPU class from AVX2 up: int4 grouped
  weights (symmetric or asymmetric, any group size dividing K into multiples of 8, activation order as
  below) packed once at load in 32-column blocks, nibbles turned into ``vdpbf16ps`` operands (AVX-512
  BF16) or float32 FMA operands (AVX-512F, AVX2) in registers, float32 sums, bfloat16 output;
- ``cpu-int4``: ``aten._weight_int4pack_mm_for_cpu`` (run in bfloat16) on weights packed once at load by
  ``_convert_weight_to_int4pack_for_cpu`` (int4, groups of 32..256; symmetric or asymmetric;
  activation order handled by permuting the weight's columns at load and the input at run time);
- ``cpu-int8-blocks`` (bfloat16 models): kernels/csrc/int8_linear.cpp on every CPU class from AVX2 up: int8
  per-channel symmetric weights (W8A16) packed once at load in column blocks, widened to float32 in
  registers, float32 sums, bias in float32, bfloat16 output rounded once;
- ``cpu-int8-weight``: ``aten._weight_int8pack_mm`` (int8 per-channel symmetric, 16-bit activations);
- ``cpu-w8a8-blocks`` (bfloat16 models): the same source's W8A8 kernel: dynamic per-token int8 activations
  quantized inside the call exactly as ``quantize_activations`` does, exact int32 sums (vpmaddwd, or
  vpdpbusd with AVX-512 VNNI; prompt chunks on AMX-INT8 tiles where the class is amx), then the same float32
  scaling as ``cpu-w8a8``;
- ``cpu-w8a8``: dynamic per-token int8 activations and ``torch._int_mm`` (int32 accumulation);
- ``cpu-fp8-blocks`` (bfloat16 models): the same source's FP8 kernel: e4m3 per-channel weights decoded in
  registers (to bfloat16 by table where the class has AVX-512 BF16 and VBMI, else to float32), dynamic
  per-token e4m3 activations quantized inside the call, float32 sums of exact products;
- ``cpu-fp8``: per-token fp8 activations; fp8 codes multiplied widened to the compute dtype (exact
  widening; float32 sums in a float32 model), since this torch's CPU ``_scaled_mm`` is a slow
  reference path;
- ``dequant``: everything else, dequantizing one layer's weight per call (never the whole model).

On CUDA, int4 grouped weights of bfloat16 models run ``cuda-int4pack`` (torch's int4 kernel for decode
rows, the triton GEMM for prompts: ``CudaInt4Linear``), other models' ``triton-w4a16``
(infer.kernels.triton_ops.w4a16_gemm, straight from compressed-tensors' packed layout), when triton is
installed.
Activation quantization follows compressed-tensors exactly (scale = absmax / (range/2), round,
clamp), so the runtime computes what transformers' decompressing forward computes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from infer.kernels import int4pack

from .compressed_tensors import Args, QuantWeight

INT4_COMPUTE_DTYPE = torch.bfloat16  # see Int4PackLinear


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
    streamed: tuple[str, ...] = ()  # buffers a decode step reads whole: kept on huge pages by place_streamed

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

    @property
    def kernel_name(self) -> str:  # the plan's name for it (runtime/engine/plan.py)
        return f"{self.scheme} {self.backend}"


def place_streamed(model: nn.Module) -> int:
    """Moves the quantized linears' streamed buffers (``QuantLinear.streamed``, CPU only) into one huge-page
    arena (kernels/hugepages.py), in the order a step reads them, as pack_linears places the bfloat16 ones;
    returns the bytes moved. On small pages a batch-1 step's int4 weights streamed at 0.44 of a `sum`'s read
    bandwidth, from the arena at 0.61 (Zen 5, 2 threads, the embedded model's shapes, rounds alternated)."""
    from infer.kernels import hugepages

    align = 64  # every slot starts on a cache line, so each dtype's view of it is aligned
    moved = [(module, name, tensor) for module in model.modules() if isinstance(module, QuantLinear)
             for name in module.streamed
             if (tensor := getattr(module, name, None)) is not None and tensor.device.type == "cpu"]
    sizes = [-(-t.nbytes // align) * align for _, _, t in moved]
    if not moved:
        return 0
    memory, offset = hugepages.arena(sum(sizes)), 0
    for (module, name, tensor), size in zip(moved, sizes):
        slot = memory[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        slot.copy_(tensor)
        setattr(module, name, slot)  # a registered buffer: replaced, and the old copy let go here
        offset += size
    return offset


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
        q = w.q
        perm = None
        if w.g_idx is not None:  # activation order: sort columns by group so groups are contiguous
            perm = torch.argsort(w.g_idx.long(), stable=True)
            q = q[:, perm]
        self.register_buffer("perm", perm, persistent=False)
        self.group_size = w.group_size
        packed, scales_zeros = int4pack.pack(q, w.scale, w.zero, self.compute_dtype, tiles=1)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    def matmul(self, x):
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return int4pack.matmul(x, self.packed, self.scales_zeros, self.group_size).to(x.dtype)


class Int4BlocksLinear(QuantLinear):
    """int4 grouped weights packed once for kernels/csrc/int4_linear.cpp (any class from AVX2): a decode step
    reads 4 bits a weight plus one float32 scale (and offset, if asymmetric) a group. Computes in
    bfloat16 like ``Int4PackLinear``; the sums are float32 and the output is rounded once."""
    backend = "cpu-int4-blocks"
    streamed = ("packed", "scales", "offsets")

    def __init__(self, w: QuantWeight, bias, dtype):
        from infer.kernels import int4_linear

        super().__init__(w, bias, dtype)
        self.module = int4_linear.load()
        perm = None
        if w.g_idx is not None:  # activation order: sort columns by group so groups are contiguous
            perm = torch.argsort(w.g_idx.long(), stable=True)
            packed, scales, offsets = int4_linear.pack(w.q[:, perm], w.scale, w.zero)
        elif w.values is None:  # the checkpoint's words, repacked word by word (no int8 values in between)
            packed, scales, offsets = int4_linear.pack_words(w.words, w.in_features, w.scale, w.zero)
        else:
            packed, scales, offsets = int4_linear.pack(w.q, w.scale, w.zero)
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        # the bias goes into the kernel, added in float32 before the one rounding (the fused decode step too)
        self.register_buffer("bias_f32", None if self.bias is None else self.bias.detach().float().contiguous(),
                             persistent=False)

    @property
    def kernel_name(self) -> str:
        tiles = self.module.prompt_tiles(self.in_features, self.in_features // self.scales.shape[1])
        return super().kernel_name + (" (prompt chunks on amx-bf16)" if tiles else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(-1, self.perm)
        y = self.module.int4_linear(x2.to(INT4_COMPUTE_DTYPE).contiguous(), self.packed, self.scales, self.offsets,
                                    self.out_features, self.bias_f32)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


def _int4_blocks(w: QuantWeight, device: torch.device) -> bool:
    from infer.kernels import int4_linear

    return (_cpu(device) and w.inputs is None and w.weights.type == "int" and w.weights.num_bits == 4 and
            int4_linear.fits(w.out_features, w.in_features, w.scale.shape[1]) and int4_linear.load() is not None)


class Int8BlocksLinear(QuantLinear):
    """int8 per-channel weights packed once for kernels/csrc/int8_linear.cpp (any class from AVX2): W8A16 with
    bfloat16 activations (``int8_linear``) or, where the scheme declares dynamic per-token int8 activations,
    W8A8 (``w8a8_linear``, which quantizes each row itself). A decode step reads 8 bits a weight and one
    float32 scale a column. The bias goes into the kernel, added in float32 before the one rounding (the
    fused decode step too)."""
    backend = "cpu-int8-blocks"
    streamed = ("packed", "scales", "colsums")
    tile_scheme, tiles = "w8a16", "amx-bf16"  # the scheme as int8_linear.cpp's prompt_tiles names it; its tiles

    def __init__(self, w: QuantWeight, bias, dtype):
        from infer.kernels import int8_linear

        super().__init__(w, bias, dtype)
        self.module = int8_linear.load()
        packed, scales, colsums = self.pack(int8_linear, w)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("colsums", colsums, persistent=False)  # W8A8's (the fused step's third slot)
        self.register_buffer("bias_f32", None if self.bias is None else self.bias.detach().float().contiguous(),
                             persistent=False)

    @staticmethod
    def pack(int8_linear, w: QuantWeight):
        """(packed, scales, column sums or None) as the kernel reads them."""
        if w.inputs is not None:
            return int8_linear.pack_w8a8(w.q, w.scale)
        return (*int8_linear.pack_w8a16(w.q, w.scale), None)

    @property
    def kernel_name(self) -> str:
        tiles = self.module.prompt_tiles(self.tile_scheme, self.in_features)
        return super().kernel_name + (f" (prompt chunks on {self.tiles})" if tiles else "")

    def run(self, x2: torch.Tensor) -> torch.Tensor:
        if self.colsums is not None:
            return self.module.w8a8_linear(x2, self.packed, self.scales, self.colsums, self.out_features, self.bias_f32)
        return self.module.int8_linear(x2, self.packed, self.scales, self.out_features, self.bias_f32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.run(x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous())
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


class W8A8BlocksLinear(Int8BlocksLinear):
    """Int8BlocksLinear for a W8A8 weight (dynamic per-token int8 activations): its own backend name. Where the
    kernel's build targets AMX, prompt chunks (16 rows or more, K a multiple of 64) run on AMX-INT8 tiles."""
    backend = "cpu-w8a8-blocks"
    tile_scheme, tiles = "w8a8", "amx-int8"


class FP8BlocksLinear(Int8BlocksLinear):
    """fp8 e4m3 per-channel weights with dynamic per-token e4m3 activations (FP8_DYNAMIC), packed once for
    kernels/csrc/int8_linear.cpp's ``fp8_linear`` (any class from AVX2): each weight byte decoded in registers,
    each row quantized inside the call as compressed-tensors does, float32 sums of exact products,
    then both scales. A decode step reads 8 bits a weight, where ``cpu-fp8`` reads the codes widened to 16."""
    backend = "cpu-fp8-blocks"
    tile_scheme = "fp8"

    @staticmethod
    def pack(int8_linear, w: QuantWeight):
        return (*int8_linear.pack_fp8(w.q, w.scale), None)

    def run(self, x2: torch.Tensor) -> torch.Tensor:
        return self.module.fp8_linear(x2, self.packed, self.scales, self.out_features, self.bias_f32)


def _fp8_blocks(w: QuantWeight, device: torch.device) -> bool:
    """What fp8_linear computes exactly: e4m3 per-channel weights, dynamic per-token e4m3 activations."""
    from infer.kernels import int8_linear

    a = w.inputs
    return (_cpu(device) and w.weights.type == "float" and w.weights.num_bits == 8 and w.q.dtype == torch.float8_e4m3fn
            and w.scale.shape[1] == 1 and a is not None and a.type == "float" and a.num_bits == 8 and a.dynamic
            and a.strategy == "token" and w.input_scale is None and int8_linear.load() is not None)


def _int8_blocks(w: QuantWeight, device: torch.device, w8a8: bool) -> bool:
    from infer.kernels import int8_linear

    if not (_cpu(device) and w.weights.type == "int" and w.weights.num_bits == 8 and w.scale.shape[1] == 1 and
            w.zero is None and w.g_idx is None):
        return False
    if w8a8:  # exactly what the kernel quantizes: dynamic, per token, symmetric int8 activations
        a = w.inputs
        if a is None or not (a.type == "int" and a.num_bits == 8 and a.dynamic and a.strategy == "token" and
                             a.symmetric and w.input_scale is None and int8_linear.fits_w8a8(w.in_features)):
            return False
    elif w.inputs is not None:
        return False
    return int8_linear.load() is not None


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
    """int8 weights and int8 per-token activations: ``torch._int_mm`` with int32 accumulation.

    On a CPU without VNNI oneDNN's int8 GEMM saturates int16 pair sums (kernels/isa.onednn_int8_is_exact),
    so there the weight is split, w = 2 hi + lo with hi in [-64, 63] and lo in {0, 1}: every pair sum of
    either half fits int16 (255 x 64 x 2 < 32768), and 2 (x . hi) + x . lo is the exact sum, at twice the
    multiplies."""
    backend = "cpu-w8a8"

    def __init__(self, w: QuantWeight, bias, dtype):
        from infer.kernels import isa

        super().__init__(w, bias, dtype)
        self.args, self.out_dtype = w.inputs, dtype
        self.split = w.q.device.type == "cpu" and not isa.onednn_int8_is_exact()
        q = w.q.t().contiguous()  # [K, N]
        if self.split:
            hi = torch.div(q, 2, rounding_mode="floor")
            self.register_buffer("weight_t", hi, persistent=False)
            self.register_buffer("weight_lo_t", q - 2 * hi, persistent=False)
        else:
            self.register_buffer("weight_t", q, persistent=False)
        self.register_buffer("wscale", w.scale.reshape(1, -1).float(), persistent=False)
        self.register_buffer("input_scale", w.input_scale, persistent=False)

    def matmul(self, x):
        xq, xs = quantize_activations(x, self.args, self.input_scale)
        acc = torch._int_mm(xq, self.weight_t)
        if self.split:
            acc = 2 * acc + torch._int_mm(xq, self.weight_lo_t)
        return (acc.float() * (xs * self.wscale)).to(x.dtype)


class FP8Linear(QuantLinear):
    """fp8 e4m3 weights and per-token (or static) fp8 activations, multiplied as widened codes.

    This torch's CPU ``_scaled_mm`` is a slow reference path (measured ~15x slower than the dense
    float32 matmul), and converting fp8 to float per call is slower still. Every e4m3 value is exactly
    a bfloat16 (and float32) value, so the weight's codes are widened once at load, activations are
    quantized to fp8 per token exactly as compressed-tensors does and widened the same way, and the
    product of codes (exact: 4 significant bits each) is summed by a dense matmul before the two
    scales are applied.

    The codes are widened to the model's compute dtype: in a float32 model to float32, so the sums
    are float32 as the declared scheme computes them (a bfloat16 matmul returns its float32 sums
    rounded to bfloat16, a 2^-9 relative error per output, which test_quant_runtime's float64
    emulation caught); in a bfloat16 model to bfloat16 (half the bytes, the model's own rounding)."""
    backend = "cpu-fp8"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.args = w.inputs
        self.codes_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        self.register_buffer("weight_codes", w.q.to(self.codes_dtype).contiguous(), persistent=False)  # [N, K]
        self.register_buffer("wscale", w.scale.reshape(1, -1).float().contiguous(), persistent=False)
        self.register_buffer("input_scale", w.input_scale, persistent=False)

    def matmul(self, x):
        xq, xs = quantize_activations(x, self.args, self.input_scale)
        acc = torch.nn.functional.linear(xq.to(self.codes_dtype), self.weight_codes)
        return (acc.float() * (xs * self.wscale)).to(x.dtype)


class TritonW4A16Linear(QuantLinear):
    """int4 grouped weights (symmetric or not, activation order or not) for the Triton W4A16 GEMM, packed
    once at load into compressed-tensors' own ``pack-quantized`` words, which the kernel reads as stored.
    Built for CUDA; on the CPU it runs only under ``TRITON_INTERPRET=1`` (how the tests check it)."""
    backend = "triton-w4a16"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        from infer.kernels.triton_ops import pack_int4

        self.register_buffer("weight_packed", pack_int4(w.q, dim=1), persistent=False)
        self.register_buffer("weight_scale", w.scale.contiguous(), persistent=False)  # as stored
        self.register_buffer("weight_zero_point", None if w.zero is None else pack_int4(w.zero, dim=0),
                             persistent=False)
        self.register_buffer("weight_g_idx", None if w.g_idx is None else w.g_idx.to(torch.int32), persistent=False)

    def matmul(self, x):
        from infer.kernels.triton_ops import w4a16_gemm

        return w4a16_gemm(x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.weight_g_idx)


INT4PACK_MAX_ROWS = 8  # rows up to which CudaInt4Linear runs torch's int4 kernel instead of the triton GEMM


class CudaInt4Linear(TritonW4A16Linear):
    """int4 grouped weights of a bfloat16 model on CUDA: up to ``INT4PACK_MAX_ROWS`` rows (decode) through
    torch's int4 kernel (kernels/int4pack.py, tinygemm), more (prompts) through the triton GEMM. On an
    H200 at Qwen2.5-7B's shapes tinygemm took 1 row 2.3-2.5x faster than the triton GEMM, 4 rows
    1.5-2.0x, 16 rows 0.66-0.89x (the 8-row cut interpolates between 4 and 16); the 28-layer decode step
    at batch 1 went from 6.30 to 2.96 ms (bench/device_check.py). Costs a second copy of the int4 weight.

    torch packs for tinygemm on the device, so the packing happens when the module is moved to CUDA
    (``pack_for_int4pack``, which tests also call on the CPU, where torch's CPU variant runs)."""
    backend = "cuda-int4pack"

    def __init__(self, w: QuantWeight, bias, dtype):
        super().__init__(w, bias, dtype)
        self.group_size = w.group_size
        self.register_buffer("int4pack_weight", None, persistent=False)
        self.register_buffer("int4pack_scales_zeros", None, persistent=False)
        self.register_buffer("int4pack_perm", None, persistent=False)

    def pack_for_int4pack(self) -> None:
        """Unpacks the triton words where they are and packs them for tinygemm there."""
        from infer.kernels.triton_ops import w4a16

        q = w4a16.unpack_int4(self.weight_packed, self.in_features)
        zero = None if self.weight_zero_point is None else w4a16.unpack_int4(self.weight_zero_point,
                                                                             self.out_features, dim=0)
        if self.weight_g_idx is not None:
            self.int4pack_perm = int4pack.group_order(self.weight_g_idx, self.group_size)
            q = q[:, self.int4pack_perm]
        self.int4pack_weight, self.int4pack_scales_zeros = int4pack.pack(q, self.weight_scale, zero)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        if self.weight_packed.is_cuda and self.int4pack_weight is None:
            self.pack_for_int4pack()
        return self

    def matmul(self, x):
        if self.int4pack_weight is None or x.shape[0] > INT4PACK_MAX_ROWS:
            return super().matmul(x)
        if self.int4pack_perm is not None:
            x = x.index_select(-1, self.int4pack_perm)
        return int4pack.matmul(x, self.int4pack_weight, self.int4pack_scales_zeros, self.group_size).to(x.dtype)


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
        w = replace(self.w, values=self.q, words=None, shape=None, scale=self.scale, zero=getattr(self, "zero", None),
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
    dtypes: tuple | None = None  # the model dtypes it serves (None: any)

    def supports(self, w, device):
        return self.test(w, device)

    def build(self, w, bias, dtype):
        return self.cls(w, bias, dtype)


def _cpu(device):
    return torch.device(device).type == "cpu"


def _triton_w4a16(w: QuantWeight, device: torch.device) -> bool:
    import importlib.util

    return (torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None and
            w.inputs is None and w.weights.type == "int" and w.weights.num_bits == 4 and w.scale.shape[1] > 1 and
            w.in_features % 8 == 0 and (w.zero is None or w.out_features % 8 == 0))


def _cuda_int4pack(w: QuantWeight, device: torch.device) -> bool:
    return (_triton_w4a16(w, device) and int4pack.supported(w.out_features, w.in_features, w.group_size) and
            (w.g_idx is None or int4pack.group_order(w.g_idx, w.group_size) is not None))


def _has(op: str) -> bool:
    try:
        getattr(torch.ops.aten, op)
        return True
    except (AttributeError, RuntimeError):
        return False


_INT4 = _has("_weight_int4pack_mm_for_cpu") and _has("_convert_weight_to_int4pack_for_cpu")
_INT8 = _has("_weight_int8pack_mm")

BACKENDS: list = [
    _Backend("cuda-int4pack", CudaInt4Linear, _cuda_int4pack, (torch.bfloat16,)),
    _Backend("triton-w4a16", TritonW4A16Linear, _triton_w4a16),
    _Backend("cpu-int4-blocks", Int4BlocksLinear, _int4_blocks),
    _Backend("cpu-int4", Int4PackLinear, lambda w, d: _cpu(d) and _INT4 and w.inputs is None and
             w.weights.type == "int" and w.weights.num_bits == 4 and w.scale.shape[1] > 1 and
             w.group_size in int4pack.GROUP_SIZES and w.in_features % w.group_size == 0 and
             w.out_features % 16 == 0),  # the packing kernel's tile
    # the int8 kernels take bfloat16 activations: a float32 model keeps torch's float32 paths below
    _Backend("cpu-int8-blocks", Int8BlocksLinear, lambda w, d: _int8_blocks(w, d, False), (torch.bfloat16,)),
    _Backend("cpu-w8a8-blocks", W8A8BlocksLinear, lambda w, d: _int8_blocks(w, d, True), (torch.bfloat16,)),
    _Backend("cpu-int8-weight", Int8WeightLinear, lambda w, d: _cpu(d) and _INT8 and w.inputs is None and
             w.weights.type == "int" and w.weights.num_bits == 8 and w.scale.shape[1] == 1 and w.zero is None),
    _Backend("cpu-w8a8", W8A8Linear, lambda w, d: _cpu(d) and w.inputs is not None and w.inputs.type == "int" and
             w.inputs.num_bits == 8 and w.weights.type == "int" and w.weights.num_bits == 8 and
             w.scale.shape[1] == 1 and w.zero is None and w.inputs.strategy in ("token", "tensor")),
    _Backend("cpu-fp8-blocks", FP8BlocksLinear, _fp8_blocks, (torch.bfloat16,)),
    _Backend("cpu-fp8", FP8Linear, lambda w, d: _cpu(d) and w.inputs is not None and
             w.inputs.type == "float" and w.weights.type == "float" and w.scale.shape[1] == 1 and
             w.inputs.strategy in ("token", "tensor")),
    _Backend("dequant", DequantLinear, lambda w, d: True),
]


INT4_CPU_BACKENDS = ("cpu-int4-blocks", "cpu-int4")


def int4_cpu_backend() -> str:
    """The backend an int4 grouped layer gets on this CPU: ``cpu-int4-blocks`` where that kernel loads
    (AVX-512 BF16), else ``cpu-int4`` (torch's int4 pack); tests and benchmarks ask here."""
    from infer.kernels import int4_linear

    return "cpu-int4-blocks" if int4_linear.load() is not None else "cpu-int4"


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
    """The first registered backend that supports ``w`` on ``device`` (and serves a model of ``dtype``, where
    it names the dtypes it serves: ``dtypes``) builds its module."""
    off = set(disable) | _DISABLED | {n for n in os.environ.get("INFER_LINEAR_BACKENDS_DISABLE", "").split(",") if n}
    off.discard("dequant")  # the fallback that always works
    for b in BACKENDS:
        if (b.name not in off and dtype in (getattr(b, "dtypes", None) or (dtype,))
                and b.supports(w, torch.device(device))):
            return b.build(w, bias, dtype)
    raise ValueError(f"no linear backend supports {_describe(w)} on {device}")  # pragma: no cover


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module name: backend} of the quantized linears in a model."""
    return {n: m.backend for n, m in model.named_modules() if isinstance(m, QuantLinear)}
