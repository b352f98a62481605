"""How much memory this machine has to give: what the engine sizes its KV cache from, and the share of RAM the
build's quantize stage and the evaluation let weights take before they keep the rest on disk."""

from __future__ import annotations

import os

WEIGHT_SHARE = 0.4  # of RAM: room for weights, their working copies and the rest of the process beside them


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take now (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def weight_budget() -> int:
    """Bytes of weights a build or an evaluation holds in memory by default: WEIGHT_SHARE of physical RAM."""
    return int(WEIGHT_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
