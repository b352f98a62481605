"""Memory for weights that stream every decode step, backed by 2 MiB pages where Linux allows it.

A batch-1 decode step reads every weight once. On 4 KiB pages that is one TLB miss and page walk
every 4 KiB, tens of thousands a step; on 2 MiB transparent huge pages, a few hundred. Measured on
a Zen 4 host without AMX (2 threads), the embedded model's packed linears read 28-34 GB/s from one
huge-page arena against 20-23 GB/s as separate tensors on small pages; int4 weights on a Zen 5 host
0.61 of a `sum`'s bandwidth against 0.44 (docs/kernels.md says which weights live here).

``arena(nbytes)`` returns a uint8 tensor aligned to 2 MiB and marked ``MADV_HUGEPAGE`` before it is
first touched (the kernel hands out huge pages on first fault). The memory is a fresh anonymous mapping
of its own, not the allocator's: malloc hands back freed heap memory already faulted in on small pages
(loading frees the checkpoint's tensors just before), where the advice comes too late; that left a
quantized model's 57 MB LM head on small pages, read at ~0.7x the speed of the same head on huge pages
(Zen 5). Where the system says never (or is not Linux) it is ordinary memory: the same numbers, only slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys
from functools import lru_cache

import torch

log = logging.getLogger("infer.kernels")
HUGE = 2 << 20
MADV_HUGEPAGE = 14


@lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


def arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8), 2 MiB aligned, asked to be backed by huge pages; the tensor keeps its
    mapping alive, and the mapping is unmapped when the last view of it goes."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no page faulted yet
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-base.data_ptr()) % HUGE
    out = base[offset:offset + nbytes]
    madvise = _madvise()
    if madvise is not None:
        length = -(-nbytes // HUGE) * HUGE  # whole pages, inside the mapping's 2 MiB of slack
        if madvise(out.data_ptr(), length, MADV_HUGEPAGE) != 0:
            log.info("madvise(MADV_HUGEPAGE) refused (errno %d): weights on small pages", ctypes.get_errno())
    return out
