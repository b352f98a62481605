"""Every decoder layer of a step in one C++ call (kernels/csrc/step_layers.cpp), for bfloat16 models
whose linears run on AMX tiles, on the column-block kernel (any class from AVX2 up), or on the int4 one.

It calls the same kernels the model calls layer by layer (layer ops, the paged decode attention,
the chunk attention (AMX tiles' or AVX-512 BF16's) and the KV store, the linears), so outputs are the same; what it
removes is Python between them: on a Zen 4 host, batch-1 decode spent about 3 ms a step outside
the kernels, a 256-token prompt step about 2 ms. ``load()`` gives the module
where it can run, else None (the model keeps its Python loop).
"""

from __future__ import annotations

from functools import lru_cache

from . import isa
from .extension import AMX_ISA, build, cpu_has_amx
from .int8_linear import vnni_flags  # W8A8 on vpdpbusd where the avx512 class's CPU has VNNI


@lru_cache(maxsize=1)
def load() -> object | None:
    if not isa.at_least("avx2"):
        return None
    # layer ops' flags: they round exactly where torch rounds (the attention parts set their own, as built alone);
    # AMX's where the CPU has it, for the AMX linears (used only where the resolver put the model's linears on them)
    amx = AMX_ISA if cpu_has_amx() else []
    module = build("infer_step_layers", "step_layers.cpp", ["-fopenmp", "-ffp-contract=off", *amx, *vnni_flags()])
    return module if module is not None and module.available() else None
