"""Offline throughput: this engine against transformers ``generate`` on the same requests, same run.

N requests with random prompt lengths in [64, 512] and output lengths in [32, 256] tokens
(ignore_eos, so every request generates exactly its length), as nano-vllm's benchmark does.
transformers runs them in static batches of 8 in arrival order: each batch is left-padded and
decodes until its longest request is done; only the tokens requests asked for are counted.

    python -m infer.bench.throughput [--artifact DIR] [--requests 64] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

# where a benchmark's JSON goes unless --json says: outside the tree ($INFER_BENCH_RESULTS, else the temp dir);
# the figures worth keeping go to the README's table and docs/benchmarks/ with the command that made them
RESULTS = Path(os.environ.get("INFER_BENCH_RESULTS") or Path(tempfile.gettempdir()) / "infer-bench")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"  # what the benchmarks build for themselves


def host_info() -> dict:
    """Which host a figure comes from, in one shape for every benchmark: what a tuning table is valid for
    (runtime/tuning.py's hardware(): CPU model, instruction-set digest, AMX, AVX-512 BF16, the class the
    kernels ran as, cores, torch), and beside it the host's name, the instruction-set flags that decide
    the kernels, the CPU's own class (INFER_ISA may force a lower one), the linears' prefetch distance
    (kernels/isa.py), torch threads, memory and load."""
    from infer.kernels import isa
    from infer.kernels.extension import cpu_flags
    from infer.runtime.tuning import hardware

    flags = cpu_flags().split()
    shown = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    gb = {key: round(int(meminfo[key].split()[0]) / 2**20, 1) for key in ("MemTotal", "MemAvailable")}
    return {**hardware(), "host": platform.node(), "flags": [f for f in shown if f in flags],
            "native_class": isa.native_class(), "prefetch_bytes": isa.prefetch_bytes(),
            "torch_threads": torch.get_num_threads(),
            "mem_total_gb": gb["MemTotal"], "mem_available_gb": gb["MemAvailable"],
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def save_json(result: dict, path: Path) -> None:
    """Every benchmark leaves its figures as JSON (under RESULTS by default), saying on which host
    and, for engine benchmarks, which kernels ran (INFER_AMX=0 forces the non-AMX path)."""
    from infer.kernels.resolver import resolve

    result = {"host": host_info(), **result}
    if "plan" not in result and "kernels" not in result and result.get("dtype") in ("float32", "bfloat16"):
        dtype = getattr(torch, result["dtype"])
        result["kernels"] = resolve("auto", dtype=dtype).describe(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"host: {result['host']}")
    for key in ("plan", "kernels"):  # an engine's plan, else the kernels a bare-model benchmark resolved
        if key in result:
            print(f"{key}: {result[key]}")
            break
    print(f"saved {path}")


def make_requests(n: int, vocab: int, seed: int, prompt_range=(64, 512), output_range=(32, 256)):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(*prompt_range), rng.randint(*output_range)
        reqs.append(([rng.randrange(100, vocab) for _ in range(plen)], olen))
    return reqs


def default_artifact(dtype: str) -> Path:
    """Builds (or finds in the cache) the embedded model at the benchmark's dtype."""
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    out = ARTIFACTS / f"bench-smollm2-{dtype}"
    return build(compose_recipe([f"model.dtype={dtype}", f"output_dir={out}", "artifact.name=bench-smollm2"])).artifact


def add_common_args(p: argparse.ArgumentParser, json_name: str) -> None:
    """The options every engine benchmark takes: --artifact, --dtype, --threads, --json."""
    p.add_argument("--artifact", type=Path, help="artifact directory (default: build the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument("--json", type=Path, default=RESULTS / json_name)


def prepare(args: argparse.Namespace) -> Path:
    """Applies --threads and returns the artifact to measure (building the embedded one if none is given)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return args.artifact or default_artifact(args.dtype)


def run_engine(artifact: Path, reqs, temperature: float, **engine_args) -> dict:
    from infer.runtime import LLM, SamplingParams

    llm = LLM(artifact, **engine_args)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([reqs[0][0][:32]], warm)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=temperature, seed=i)
              for i, (_, o) in enumerate(reqs)]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "steps": llm.engine.stats["steps"], "preemptions": llm.engine.scheduler.num_preemptions,
            "plan": llm.engine.plan.describe()}


def run_transformers(artifact: Path, reqs, temperature: float, dtype: torch.dtype, batch: int = 8) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=dtype).eval()
    pad = model.config.pad_token_id or 0
    gen_kwargs = dict(do_sample=temperature > 0, pad_token_id=pad)
    if temperature > 0:
        gen_kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:32]]), max_new_tokens=4, **gen_kwargs)
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(reqs), batch):
            chunk = reqs[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            longest = max(o for _, o in chunk)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 **gen_kwargs)
            assert out.shape[1] == width + longest
            tokens += sum(o for _, o in chunk)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "batch_size": batch}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "throughput.json")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args(argv)
    artifact = prepare(args)
    from infer.runtime.model import ModelConfig

    reqs = make_requests(args.requests, ModelConfig.from_dir(artifact).vocab_size, args.seed)
    engine = run_engine(artifact, reqs, args.temperature, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"infer engine : {engine['output_tokens']} tokens in {engine['seconds']:.1f}s = "
          f"{engine['tokens_per_s']:.1f} tok/s ({engine['steps']} steps)")
    result = {"benchmark": "offline_throughput", "requests": args.requests, "dtype": args.dtype,
              "temperature": args.temperature, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "engine": engine, "plan": engine.pop("plan")}
    if not args.skip_transformers:
        hf = run_transformers(artifact, reqs, args.temperature, getattr(torch, args.dtype))
        print(f"transformers : {hf['output_tokens']} tokens in {hf['seconds']:.1f}s = {hf['tokens_per_s']:.1f} tok/s "
              f"(static batches of {hf['batch_size']})")
        result["transformers"] = hf
        result["speedup"] = engine["tokens_per_s"] / hf["tokens_per_s"]
        print(f"speedup      : {result['speedup']:.2f}x")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
