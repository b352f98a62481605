"""Measuring a kernel tuning table (runtime/tuning.py) on this machine: the build's ``tune`` stage
(pipeline/tune.py) writes it into the artifact, ``infer-run ART --retune`` next to it. It lives in the
runtime, not the pipeline, because ``--retune`` runs it and the runtime never imports the pipeline.

The runtime makes three choices by a fixed rule that the machine may disagree with; tuning times
the real alternatives with the model's real shapes and records every timing and the choice:

- ``linear``: per bfloat16 linear shape, AMX tiles / column blocks (kernels/bf16_linear.py) / oneDNN's
  packed layout / plain ``F.linear`` (the weight layout is fixed at load, so one kernel per shape: the
  one with the least time summed over the buckets);
- ``decode_attention``: per bucket (decode sequences in a step), the C++ paged kernel, on a bfloat16 cache
  where it is built with AVX-512 BF16 also its float path (``cpp-float``: rows widened, FMAs; faster than
  ``vdpbf16ps`` on some cores: 0.83-0.95x the dots' time a layer on an AMX Xeon, where Zen 4/5 favour the dots;
  docs/benchmarks/2026-12-07f-xeon-amx.md), or gather +
  SDPA (all read the same cache, so this switches step by step);
- ``threads``: per bucket (rows in a step), how many of the cores a step uses (not chosen on a busy
  machine, where fewer threads win only because other work holds the cores).

Decided, not raced: each candidate is run ``WARMUP`` times, then timed ``REPEATS`` times, and
keeps its fastest and its median run (other work on the machine only ever adds time, so the
fastest run is the steadiest estimate, and the median guards against one lucky run). An
alternative replaces the default only when both its fastest and its median are at least
``MARGIN`` below the default's; ties are broken by the fixed order of the candidates. The load
average when measuring is recorded: a table measured on a busy machine says so. Quantized linears are
not tuned: each scheme has one fast backend, and the fallback (dequantize per call) is several times
slower.

On a machine with a CUDA GPU the table also gets a ``gpu`` section: the model loaded on the GPU with
the triton kernels, every decode bucket's CUDA graph captured and replayed against the eager step
(``gpu_check``); a capture that fails fails the measurement (without triton, or under its
interpreter, the section says so and claims nothing). Without a GPU there is no such section:
the table claims nothing about graphs.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from .artifact import CONFIG
from .engine.block_manager import BLOCK_SIZE
from .tuning import FORMAT, VERSION, TuningError, hardware, shape_key

log = logging.getLogger("infer.tuning")
REPEATS, WARMUP, MARGIN = 7, 2, 0.10
LINEAR_ORDER = ("amx", "blocks", "onednn", "torch")
ATTENTION_ORDER = ("cpp", "cpp-float", "torch-sdpa")
CONTEXT = 256  # tokens of context per sequence when timing decode attention and steps
RULE = (f"fastest and median of {REPEATS} timed runs after {WARMUP} warm-up runs; an alternative replaces the "
        f"default only when both are at least {MARGIN:.0%} below the default's; ties broken by candidate order")


def decide(timings: dict[str, dict], default: str, order) -> str:
    """The rule: the candidate with the fastest run, if both its fastest and its median beat the
    default's by MARGIN; else the default. ``timings``: {candidate: {"min": s, "median": s}}."""
    rank = {c: i for i, c in enumerate(order)}
    best = min(timings, key=lambda c: (timings[c]["min"], rank.get(c, len(rank))))
    wins = all(timings[best][k] <= (1 - MARGIN) * timings[default][k] for k in ("min", "median"))
    return best if wins else default


def _time(fn, repeats: int = REPEATS, warmup: int = WARMUP) -> dict:
    """{"min": fastest, "median": median} seconds of ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"min": min(times), "median": statistics.median(times)}


def _summed(per_bucket: dict[str, dict]) -> dict:
    return {k: sum(t[k] for t in per_bucket.values()) for k in ("min", "median")}


def _linear_candidates(weight: torch.Tensor, kernels) -> dict:
    """The modules one bfloat16 linear can run as, by kernel name (those this machine can run)."""
    from torch import nn

    from infer.kernels import amx_linear, bf16_linear

    from .model.packed_linear import PackedLinear

    plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype).requires_grad_(False)
    plain.weight.copy_(weight)
    out = {}
    if kernels.amx_linear is not None and amx_linear.fits(weight):
        out["amx"] = PackedLinear(plain, "amx", kernels.amx_linear)
    if kernels.bf16_linear is not None and bf16_linear.fits(weight):
        out["blocks"] = PackedLinear(plain, "blocks", kernels.bf16_linear)
    if kernels.onednn_linear:
        out["onednn"] = PackedLinear(plain)
    out["torch"] = plain
    return out


def measure_linears(shapes: set[tuple[int, int]], dtype: torch.dtype, buckets: list[int], kernels,
                    default_of) -> dict:
    """Per shape: every candidate's median time per bucket, the default and the choice."""
    gen = torch.Generator().manual_seed(0)
    result = {}
    for n_in, n_out in sorted(shapes):
        weight = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dtype)
        candidates = _linear_candidates(weight, kernels)
        default = default_of(n_in, n_out)
        if len(candidates) < 2 or default not in candidates:
            continue
        timings = {name: {} for name in candidates}
        with torch.inference_mode():
            for b in buckets:
                x = torch.randn(b, n_in, generator=gen).to(dtype)
                for name, module in candidates.items():
                    timings[name][str(b)] = _time(lambda: module(x))
        totals = {name: _summed(t) for name, t in timings.items()}
        result[shape_key(n_in, n_out, dtype)] = {"seconds": timings, "total_seconds": totals, "default": default,
                                                  "choice": decide(totals, default, LINEAR_ORDER)}
    return result


def _context_tokens(model) -> int:
    """CONTEXT, or less for a model with fewer positions (the new token needs one of its own)."""
    return min(CONTEXT, model.config.max_position_embeddings - 1)


def _decode_context(model, kernels, decodes: int, block_size: int, use_kernel: bool, layers: int | None = None,
                    bf16_dots: bool = True):
    """A decodes-only attention context over a synthetic cache with CONTEXT tokens a sequence
    (for ``layers`` layers: all of the model's by default). On the kernels, a whole step takes the path the
    plan routes a decode step to (the one-call C++ step where the model has one), as served."""
    from .engine.attention import PagedAttention
    from .engine.plan import ONE_CALL, make_plan

    cfg = model.config
    context = _context_tokens(model)
    per_seq = -(-(context + 1) // block_size)
    blocks = decodes * per_seq + 1
    # zeros: attention's cost does not depend on the values, and a memset is much cheaper than randn
    cache = torch.zeros(layers or cfg.num_layers, 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    tables = torch.arange(1, blocks).view(decodes, per_seq)
    lens = torch.full((decodes,), context + 1)
    slots = tables[:, context // block_size] * block_size + context % block_size
    one_call = use_kernel and make_plan(model, kernels, model.dtype).route(0, decodes) == (ONE_CALL,)
    return PagedAttention(cache, block_size, slots, [], torch.arange(decodes), tables, lens,
                          kernels.decode_attention if use_kernel else None,
                          kernels.store_kv if use_kernel else None, None, one_call=one_call, bf16_dots=bf16_dots)


def measure_attention(model, kernels, buckets: list[int], block_size: int) -> dict:
    """Per bucket: one layer's decode attention through the C++ kernel (where it has both, with bfloat16 dot
    products and on its float path) and through gather + SDPA."""
    if kernels.decode_attention is None:
        return {}
    candidates = [("cpp", True, True), ("torch-sdpa", False, True)]
    if kernels.backend == "cpp" and model.dtype == torch.bfloat16:
        from infer.kernels import cpu_attention

        if cpu_attention.load().has_bf16_dots():
            candidates.insert(1, ("cpp-float", True, False))
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    result = {}
    for b in buckets:
        q = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=gen).to(model.dtype)
        k = torch.randn(b, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(model.dtype)
        timings = {}
        for name, use, dots in candidates:
            ctx = _decode_context(model, kernels, b, block_size, use, layers=1, bf16_dots=dots)
            timings[name] = _time(lambda: ctx.attend(0, q, k, k))
        result[str(b)] = {"seconds": timings, "default": "cpp", "choice": decide(timings, "cpp", ATTENTION_ORDER)}
    return result


def measure_threads(model, kernels, buckets: list[int], block_size: int) -> dict:
    """Per bucket: a whole decode step of the model (b rows) at each thread count up to the cores."""
    cores = len(os.sched_getaffinity(0))
    default = torch.get_num_threads()
    counts = sorted({default, *range(1, cores + 1)}, reverse=True)
    if len(counts) < 2:
        return {}
    order = [str(c) for c in counts]
    result = {}
    try:
        for b in buckets:
            ids = torch.randint(0, model.config.vocab_size, (b,), generator=torch.Generator().manual_seed(2))
            positions = torch.full((b,), _context_tokens(model))
            ctx = _decode_context(model, kernels, b, block_size, True)
            timings = {}
            for c in counts:
                torch.set_num_threads(c)
                with torch.inference_mode():
                    timings[str(c)] = _time(lambda: model.compute_logits(model(ids, positions, ctx)),
                                            repeats=3, warmup=1)
            result[str(b)] = {"seconds": timings, "default": str(default),
                              "choice": decide(timings, str(default), order)}
    finally:
        torch.set_num_threads(default)
    return result


def measure(model_dir: Path, buckets: list[int], block_size: int = BLOCK_SIZE, dtype: torch.dtype | None = None,
            sections: tuple[str, ...] = ("linear", "decode_attention", "threads")) -> dict:
    """Times the alternatives on this machine for the model in ``model_dir``; returns the table."""
    from infer.kernels.resolver import resolve

    from .model import load_model
    from .model.llama import ModelConfig

    buckets = sorted(set(buckets))
    if os.getloadavg()[0] > len(os.sched_getaffinity(0)):
        log.warning("tuning on a busy machine (load average %.1f on %d cores): timings carry other work's noise, "
                    "which the rule's margin guards against; tune on a quiet machine for the best table",
                    os.getloadavg()[0], len(os.sched_getaffinity(0)))
    config = json.loads((Path(model_dir) / CONFIG).read_text())
    cfg = ModelConfig.from_hf(config)
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype, lambda d: resolve("auto", dtype=d, head_dim=cfg.head_dim,
                                                             block_size=block_size), hf_config=config)
    kernels = model.kernels
    table = {"format": FORMAT, "version": VERSION, "hardware": hardware(), "rule": RULE, "buckets": buckets,
             "dtype": str(model.dtype).removeprefix("torch."), "kernels": kernels.describe(model.dtype),
             "context_tokens": _context_tokens(model), "load_average": os.getloadavg()[0]}
    if "linear" in sections:
        shapes, defaults = set(), {}
        for module in model.modules():
            w = getattr(module, "weight", None)
            if type(module).__name__ in ("Linear", "PackedLinear") and module.in_features and \
                    (w is None or w.dtype == torch.bfloat16) and model.dtype == torch.bfloat16:
                shapes.add((module.in_features, module.out_features))
                defaults[(module.in_features, module.out_features)] = _kernel_of(module)
        table["linear"] = measure_linears(shapes, model.dtype, buckets, kernels, lambda i, o: defaults[(i, o)])
    if "decode_attention" in sections:
        table["decode_attention"] = measure_attention(model, kernels, buckets, block_size)
    if "threads" in sections:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
        if load > 0.75 * cores:  # other work holds cores: fewer threads would "win" for the wrong reason
            table["skipped"] = {"threads": f"load average {load:.1f} on {cores} cores: kept the default"}
            log.warning("tuning: not choosing thread counts on a busy machine (load %.1f on %d cores)", load, cores)
        else:
            table["threads"] = measure_threads(model, kernels, buckets, block_size)
    if torch.cuda.is_available():
        table["gpu"] = gpu_check(model_dir, block_size, dtype)
    table["seconds"] = round(time.perf_counter() - t0, 1)
    return table


def gpu_check(model_dir: Path, block_size: int = BLOCK_SIZE, dtype: torch.dtype | None = None) -> dict:
    """Loads the model on the GPU with the triton kernels, captures every decode bucket's CUDA graph as
    the engine does at load, and replays each against the same step run eagerly (on distinct tokens
    and positions in padding rows, which write nowhere). Raises when capture or replay fails."""
    from infer.kernels.resolver import resolve, resolve_device

    from .engine.model_runner import ModelRunner, graph_buckets_for
    from .model import load_model
    from .model.llama import ModelConfig

    device = resolve_device("cuda")
    name = torch.cuda.get_device_name(device)
    try:
        from infer.kernels.triton_ops import interpreting
    except ImportError as e:  # the runtime's GPU path cannot run here either: said, not claimed
        return {"device": name, "cuda_graphs": {"validated": False, "why": f"triton is not installed ({e})"}}
    if interpreting():  # (a test run on a GPU machine) the kernels run on the host: nothing to capture
        return {"device": name, "cuda_graphs": {"validated": False, "why": "TRITON_INTERPRET=1"}}
    config = json.loads((Path(model_dir) / CONFIG).read_text())
    cfg = ModelConfig.from_hf(config)
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype, lambda d: resolve("triton", dtype=d, head_dim=cfg.head_dim,
                                                             block_size=block_size, device=device),
                       hf_config=config, device=device)
    buckets = graph_buckets_for(device, "triton", True, 1 << 30)  # every bucket
    num_blocks = -(-cfg.max_position_embeddings // block_size) + 1  # room for the widest block table
    try:
        runner = ModelRunner(model, num_blocks, block_size, model.kernels, device=device, graph_buckets=buckets)
        graphs = runner.graphs
        worst = 0.0
        with torch.inference_mode():
            for b in graphs.buckets:
                view = graphs.buffers.view(b)
                view.input_ids.copy_(torch.arange(b, device=device) % cfg.vocab_size)
                view.positions.copy_(torch.arange(b, device=device))
                eager = runner._decode_step(view).float()
                graphs.graphs[b].replay()
                replayed = graphs.outputs[b].float()
                if not torch.isfinite(replayed).all():
                    raise RuntimeError(f"bucket {b}: the replayed graph gave non-finite hidden states")
                worst = max(worst, ((replayed - eager).abs().max() / eager.abs().max().clamp_min(1e-30)).item())
        if worst > 1e-2:
            raise RuntimeError(f"a replayed decode graph differs from the eager step by {worst:.2g} (relative)")
        return {"device": name, "kernels": "triton",
                "cuda_graphs": {"validated": True, "buckets": sorted(graphs.graphs),
                                "replay_vs_eager_max_rel": worst, "seconds": round(time.perf_counter() - t0, 1)}}
    except Exception as e:
        raise TuningError(f"CUDA graph check on {name} failed ({type(e).__name__}: "
                          f"{e}); infer-run --no-cuda-graphs runs eagerly meanwhile") from e


def _kernel_of(module) -> str:
    """What kernel a loaded linear runs today (the default the table compares against)."""
    if type(module).__name__ == "PackedLinear":
        return module.kernel
    return "torch"
