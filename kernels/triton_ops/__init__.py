"""The GPU path's kernels, in triton: one file per kernel, each with a plain-torch ``*_reference``.

- ``paged_decode_attention``: decode attention over block tables (GQA, online softmax, split-K);
- ``w4a16_gemm``: y = x @ dequant(W)^T from compressed-tensors' ``pack-quantized`` tensors as stored;
- ``rms_norm`` / ``fused_add_rms_norm_``, ``rotary_``, ``silu_and_mul``, ``store_kv_``: the per-layer
  elementwise work, fused so each reads and writes the activations once.

They run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before importing this
package: ``@triton.jit`` decides at decoration), which is how the tests check them without a GPU.
Named ``triton_ops`` so that it can never shadow the real ``triton`` package.
"""

from .decode_attention import default_splits, paged_decode_attention, paged_decode_attention_reference
from .kv_store import store_kv_, store_kv_reference
from .rmsnorm import fused_add_rms_norm_, rms_norm, rms_norm_reference
from .rotary import rotary_, rotary_reference
from .silu_mul import silu_and_mul, silu_and_mul_reference
from .tuning import do_bench, interpreting
from .w4a16 import pack_int4, w4a16_gemm, w4a16_gemm_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "default_splits", "w4a16_gemm",
           "w4a16_gemm_reference", "pack_int4", "rms_norm", "fused_add_rms_norm_", "rms_norm_reference", "rotary_",
           "rotary_reference", "silu_and_mul", "silu_and_mul_reference", "store_kv_", "store_kv_reference",
           "do_bench", "interpreting"]
