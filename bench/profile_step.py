"""Where one decode step's time goes: matmuls, attention, other model ops, sampler, Python.

Puts N requests with ~300-token prompts into the engine, prefills them, then profiles a few
pure-decode steps with torch.profiler and splits the wall time into buckets. It profiles the
model's Python loop over the layers: where a decode step's layers run as one C++ call
(runtime/model/fused_step.py), that call would hide the breakdown, so it is switched off here.

    python -m infer.bench.profile_step [--artifact DIR] [--batch 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

from infer.runtime.engine.plan import LAYER_LOOP

from .throughput import RESULTS, default_artifact, make_requests, save_json

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
          "aten::_int_mm", "mkldnn::_linear_pointwise", "kernel::amx_linear",
          "kernel::bf16_linear"}  # the last three: runtime/packed_linear.py


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", type=Path, default=RESULTS / "profile_step.json")
    args = p.parse_args(argv)

    from infer.runtime import LLMEngine, SamplingParams
    from infer.runtime.engine import engine as engine_mod

    artifact = args.artifact or default_artifact(args.dtype)
    engine = LLMEngine(artifact, dtype=args.dtype, max_num_seqs=args.batch, kv_cache_memory=2 << 30)
    for i, (prompt, _) in enumerate(make_requests(args.batch, engine.model.config.vocab_size, 0, (250, 350))):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.7))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    # label the phases so the profile can split them
    execute, sample = engine.runner.execute, engine_mod.sample

    def labelled_execute(batch):
        with record_function("phase::model"):
            return execute(batch)

    def labelled_sample(logits, seqs):
        with record_function("phase::sampler"):
            return sample(logits, seqs)

    kernel = engine.runner.decode_kernel

    def labelled_kernel(*a):
        with record_function("paged_attention"):
            return kernel(*a)

    engine.runner.execute, engine_mod.sample = labelled_execute, labelled_sample
    plan = engine.runner.plan  # the layer loop, so that the profiler sees each kernel (the plan printed says so)
    profiled = engine.runner.plan = replace(plan, step=LAYER_LOOP,
                                            step_why="profiled: the one-call step would hide the breakdown")
    if kernel is not None:
        engine.runner.decode_kernel = labelled_kernel
    # the fused norm/rotary/SiLU kernels and the AMX and AVX-512 BF16 matmuls are pybind calls the
    # profiler does not see: label them too
    fused = [m for m in engine.model.modules() if getattr(m, "ops", None) is not None]
    for m in fused:
        m.ops = _Labelled(m.ops)
    packed = [m for m in engine.model.modules() if getattr(m, "module", None) is not None]
    for m in packed:
        m.module = _Labelled(m.module)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = (time.perf_counter() - start) / args.steps
    engine.runner.execute, engine_mod.sample, engine.runner.decode_kernel = execute, sample, kernel
    engine.runner.plan = plan
    for m in fused:
        m.ops = m.ops.module
    for m in packed:
        m.module = m.module.module
    events = prof.key_averages()
    total = {e.key: e.cpu_time_total / 1e6 / args.steps for e in events}
    self_ = {e.key: e.self_cpu_time_total / 1e6 / args.steps for e in events}
    model = total.get("phase::model", 0.0)
    sampler = total.get("phase::sampler", 0.0)
    matmul = sum(v for k, v in self_.items() if k in MATMUL)
    attention = sum(v for k, v in self_.items() if "attention" in k or "paged" in k)
    buckets = {
        "matmul": matmul,
        "attention": attention,
        "other model ops": max(0.0, model - matmul - attention - _python_share(prof, args.steps)),
        "sampler": sampler,
        "python and scheduling": max(0.0, wall - model - sampler) + _python_share(prof, args.steps),
    }
    print(f"decode step at batch {args.batch} ({args.dtype}): {wall * 1e3:.1f} ms = {args.batch / wall:.0f} tok/s")
    for name, seconds in buckets.items():
        print(f"  {name:<22} {seconds * 1e3:7.1f} ms  {100 * seconds / wall:5.1f}%")
    result = {"benchmark": "decode_step_profile", "batch": args.batch, "dtype": args.dtype,
              "plan": profiled.describe(),
              "step_s": wall,
              "tokens_per_s": args.batch / wall, "buckets_s": buckets}
    save_json(result, args.json)
    return result


class _Labelled:
    """A compiled kernel module (layer_ops, amx_linear, bf16_linear) whose calls show in the profile as ``kernel::<name>``."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def call(*args):
            with record_function(f"kernel::{name}"):
                return fn(*args)
        return call


def _python_share(prof, steps: int) -> float:
    """Time inside the model phase not spent in any aten op: Python between the ops."""
    events = prof.key_averages()
    model = next((e for e in events if e.key == "phase::model"), None)
    if model is None:
        return 0.0
    ops = sum(e.self_cpu_time_total for e in events
              if e.key.startswith(("aten::", "mkldnn::", "kernel::")) or e.key == "paged_attention")
    return max(0.0, (model.cpu_time_total - ops) / 1e6 / steps)


if __name__ == "__main__":
    main()
