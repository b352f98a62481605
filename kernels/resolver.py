"""The one place that decides which kernels a model and its runner use.

``resolve("auto" | "cpp" | "torch", amx=None | True | False, ...)`` returns a ``KernelSet``: the
fused layer ops (RMSNorm, rotary, SiLU-and-multiply), the paged decode attention and KV store,
the attention of prompt chunks (after cached tokens, and fresh ones), and how bfloat16 linears are
laid out, for the active CPU class (kernels/isa.py: ``INFER_ISA`` forces a lower one). Everything that
runs a model reads its choices from here and nowhere else; ``describe()`` says what was chosen, for
the load log, ``/version`` and the benchmarks.

- ``auto``: the compiled C++ kernels where they build (a warning and plain torch ops where not);
- ``cpp``: the same, but a kernel that cannot be built is an error;
- ``torch``: plain torch ops everywhere (the reference the kernels are checked against);
- ``triton``: the GPU path's kernels (kernels/triton_ops: paged decode attention, KV store, fused
  RMSNorm / rotary / SiLU-and-multiply) for a model on a CUDA device; on CPU tensors they run only
  under ``TRITON_INTERPRET=1``, which is how the tests check the wiring without a GPU.

``device`` (``resolve_device("auto" | "cpu" | "cuda")``): on a CUDA device ``auto`` is ``triton``,
``torch`` runs plain torch ops there, and ``cpp`` is refused: the C++ kernels read CPU memory only.

``amx``: None uses Intel AMX tiles where the CPU has them; False never does (the path every
non-AMX host takes, forced on an AMX host to test it); True requires them. ``INFER_AMX=0`` sets
the default to False for a whole process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from . import isa
from .extension import cpu_has_amx

log = logging.getLogger("infer.kernels")
BACKENDS = ("auto", "cpp", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
_LAYER_OPS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelSet:
    backend: str  # cpp | torch | triton: what was asked for, after auto was resolved
    amx: bool  # AMX tiles in use (linears, chunk attention)
    layer_ops: object | None  # kernels.layer_ops' module, or None: torch ops
    decode_attention: Callable | None  # kernels.cpu_attention.paged_decode_attention, or None: gather + SDPA
    store_kv: Callable | None  # kernels.cpu_attention.store_kv_, or None: index_copy_
    chunk_attention: Callable | None  # chunks after cached tokens: kernels.amx_attention's or
    # kernels.bf16_attention's, or None: gather + padded SDPA
    amx_linear: object | None  # kernels.amx_linear's module, or None
    onednn_linear: bool  # bfloat16 linears prepacked into oneDNN's layout where neither of the others runs
    bf16_linear: object | None = None  # kernels.bf16_linear's module (column blocks, no AMX in use), or None
    step_layers: object | None = None  # kernels.step_layers' module (with bf16_linear or amx_linear), or None
    prefill_attention: Callable | None = None  # chunks that start a sequence: the AMX chunk kernel where AMX
    # is on, else kernels.bf16_attention's, or None: SDPA within each chunk
    amx_chunks: bool = False  # the chunk kernels are AMX tiles' (else the CPU class's, kernels/bf16_attention.py)
    draw_rows: Callable | None = None  # kernels.sample_rows' draw (the sampler's sampled rows), or None: torch

    def linear_kernel(self, dtype: torch.dtype) -> str:
        """How a plain linear of ``dtype`` runs: amx | blocks | onednn | torch (blocks: kernels/bf16_linear.py,
        with the instructions of the class ``describe()`` names)."""
        if dtype != torch.bfloat16:
            return "torch"
        if self.amx_linear is not None:
            return "amx"
        return "blocks" if self.bf16_linear is not None else "onednn" if self.onednn_linear else "torch"

    def describe(self, dtype: torch.dtype | None = None) -> dict:
        """Which kernel runs each piece: logged once at load, shown by /version and the benchmarks."""
        fast = "triton" if self.backend == "triton" else "cpp"
        d = {"backend": self.backend, "isa": isa.active() if self.backend == "cpp" else None, "amx": self.amx,
             "cpu_has_amx": cpu_has_amx(),
             "layer_ops": fast if self.layer_ops is not None else "torch",
             "decode_attention": fast if self.decode_attention is not None else "torch-sdpa",
             "kv_store": fast if self.store_kv is not None else "torch",
             "chunk_attention": self._chunk_kernel_name(self.chunk_attention),
             "prefill_attention": self._chunk_kernel_name(self.prefill_attention),
             "sampler": fast if self.draw_rows is not None else "torch"}
        if self.step_layers is not None:
            d["step_layers"] = "cpp"  # a step's layers in one call, where the model's layers fit it
        if dtype is not None:
            d["linear"] = self.linear_kernel(dtype)
        return d

    def _chunk_kernel_name(self, kernel: Callable | None) -> str:
        """amx | avx512bf16 | avx512 | avx2 | torch-sdpa: which prompt-chunk kernel ``kernel`` is."""
        if kernel is None:
            return "torch-sdpa"
        from . import bf16_attention

        return "amx" if self.amx_chunks else bf16_attention.name()


def _amx_wanted(amx: bool | None) -> bool:
    if amx is None:
        amx = cpu_has_amx()  # the active class (kernels/isa.py) is amx: the CPU has it and neither
        # INFER_ISA nor INFER_AMX=0 holds it lower
    if amx and not cpu_has_amx():
        raise RuntimeError(f"amx=True but AMX is not in use: the CPU class is {isa.active()} (this CPU has no AMX "
                           "tiles, or INFER_ISA / INFER_AMX=0 holds it lower); use amx=None")
    return amx


def resolve_device(setting: str = "auto") -> torch.device:
    """Where the model, KV cache and sampler live: ``auto`` is the current CUDA device when torch
    sees one, else the CPU; ``cuda`` without one is an error naming the fix."""
    if setting not in DEVICES:
        raise ValueError(f"device={setting!r}: choose one of {', '.join(DEVICES)}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None else
               f"this torch (CUDA {torch.version.cuda}) finds no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES")
        raise ValueError(f"device=cuda but torch sees no CUDA device ({why}); run with --device cpu (or auto), "
                         f"or on a machine with an NVIDIA GPU and a CUDA build of torch")
    return torch.device("cuda", torch.cuda.current_device())


def resolve(backend: str = "auto", *, amx: bool | None = None, dtype: torch.dtype = torch.float32,
            head_dim: int = 64, block_size: int = 16, device: torch.device | str = "cpu") -> KernelSet:
    """The kernels for a model of ``dtype`` with ``head_dim`` and a KV cache of ``block_size`` tokens a block,
    whose tensors live on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels={backend!r}: choose one of {', '.join(BACKENDS)}")
    if torch.device(device).type == "cuda":
        if backend == "cpp":
            raise ValueError("kernels=cpp are the compiled C++ CPU kernels, which cannot read CUDA tensors: use "
                             "--kernels auto or triton (or torch) with --device cuda, or --device cpu")
        backend = "triton" if backend == "auto" else backend
    if backend == "torch":
        return KernelSet("torch", False, None, None, None, None, None, False)
    if backend == "triton":
        return _triton(dtype)
    from . import (amx_attention, amx_linear, bf16_attention, bf16_linear, cpu_attention, layer_ops, sample_rows,
                   step_layers)

    use_amx = _amx_wanted(amx)

    def need(module, what):
        if module is None and backend == "cpp":
            raise RuntimeError(f"kernels=cpp but the {what} kernel could not be built (see the warning above)")
        return module

    ops = need(layer_ops.load(), "layer ops") if dtype in _LAYER_OPS_DTYPES else None
    attention = need(cpu_attention.load(), "paged attention")
    linear_amx = chunk = None
    if use_amx and dtype == torch.bfloat16:
        linear_amx = amx_linear.load()
        if amx is True and linear_amx is None:
            raise RuntimeError("amx=True but the AMX linear kernel could not be built (see the warning above)")
        if amx_attention.fits(dtype, head_dim, block_size):
            module = amx_attention.load()
            chunk = module.chunk_attention if module is not None else None
    prefill = chunk  # AMX tiles attend fresh prompts too: 1.3-2.7x the AVX-512 BF16 kernel's speed (40-1024 tokens)
    if prefill is None and bf16_attention.fits(dtype, head_dim) and isa.at_least("avx2"):
        module = need(bf16_attention.load(), "chunk attention")
        prefill = module.chunk_attention if module is not None else None
    linear_bf16 = fused = None
    if dtype == torch.bfloat16 and linear_amx is None and isa.at_least("avx2"):
        linear_bf16 = need(bf16_linear.load(), "column-block linear")
    if (linear_bf16 is not None or linear_amx is not None) and ops is not None and attention is not None:
        fused = need(step_layers.load(), "step layers")
        if fused is not None and (linear_amx is not None or chunk is not None) and not fused.has_amx():
            fused = None  # built without AMX (an older compiler): the Python loop runs the AMX kernels
    draw = need(sample_rows.load(), "sampler") if isa.at_least("avx2") else None
    from infer.kernels.onednn import can_pack  # local: the probe runs a tiny matmul

    return KernelSet("cpp", linear_amx is not None or chunk is not None, ops,
                     attention.paged_decode_attention if attention is not None else None,
                     attention.store_kv_ if attention is not None else None, chunk or prefill, linear_amx,
                     dtype == torch.bfloat16 and can_pack(torch.bfloat16), linear_bf16, fused, prefill,
                     chunk is not None, draw.draw_rows if draw is not None else None)


class _TritonLayerOps:
    """kernels/triton_ops under the C++ layer_ops module's names, so the model calls either alike."""

    def __init__(self, ops):
        self.rms_norm, self.rotary_ = ops.rms_norm, ops.rotary_
        self.add_rms_norm_, self.silu_mul = ops.fused_add_rms_norm_, ops.silu_and_mul


def _triton(dtype: torch.dtype) -> KernelSet:
    """The Triton kernels: on a CUDA device, or under the interpreter (TRITON_INTERPRET=1) on the CPU."""
    try:
        from . import triton_ops
    except ImportError as e:
        raise RuntimeError(f"kernels=triton needs the triton package ({e}); pip install triton==3.9.0") from None
    if not torch.cuda.is_available() and not triton_ops.interpreting():
        raise RuntimeError("kernels=triton needs a CUDA device (none here); set TRITON_INTERPRET=1 to run the "
                           "Triton kernels on the CPU through triton's interpreter (slow: for checking only)")
    ops = _TritonLayerOps(triton_ops) if dtype in _LAYER_OPS_DTYPES else None
    return KernelSet("triton", False, ops, triton_ops.paged_decode_attention, triton_ops.store_kv_, None, None, False)
