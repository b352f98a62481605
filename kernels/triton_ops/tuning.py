"""What the kernels share: interpreter detection, autotune timing that also works on the CPU, sizes.

Under ``TRITON_INTERPRET=1`` there is no GPU driver, so triton's own benchmarker cannot time a
config; ``do_bench`` times it with the wall clock instead (a handful of runs), which is enough to
exercise the autotuning path in tests. On a GPU it is triton's ``do_bench`` (CUDA events).
"""

from __future__ import annotations

import os
import statistics
import time

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Read from the environment, as triton itself does when ``@triton.jit`` decorates: it must be set
    before these modules are imported."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def capturing() -> bool:
    """True while a CUDA graph is being captured: a host-side check that reads a tensor back would
    sync, which capture forbids, so the wrappers skip their checks then (the masks keep memory safe)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def do_bench(kernel_call, quantiles=None, reps: int = 3):
    """Autotune's timing function: median (and quantiles) in milliseconds of ``kernel_call``."""
    if not interpreting():
        return triton.testing.do_bench(kernel_call, quantiles=quantiles)
    kernel_call()  # the first run also builds the interpreted function
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        kernel_call()
        times.append((time.perf_counter() - start) * 1e3)
    if quantiles is None:
        return statistics.median(times)
    times.sort()
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


def configs(gpu: list, interpreter: list) -> list:
    """The autotune configs for where the kernel runs: the interpreter takes seconds per config, so
    tests tune over a short list that still has more than one entry (the tuning path runs)."""
    return interpreter if interpreting() else gpu


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def check_device(*tensors) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter: say which is wrong."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and not interpreting():
            raise RuntimeError("triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


# triton 3.9's interpreter multiplies bfloat16 dot operands as their raw 16-bit patterns (it keeps
# bfloat16 as uint16 in numpy), so under the interpreter the kernels widen dot operands to float32
# first. Values are the same (bfloat16 -> float32 is exact); on a GPU the 16-bit dot runs as is.
# (The interpreter also rounds float32 -> bfloat16 by truncation, a GPU to nearest even: bfloat16
# results under the interpreter can be one ulp lower than on a GPU.)
FP32_DOT = interpreting()


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b with float32 accumulation (IEEE float32 products when the operands are float32)."""
    if FP32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out
