"""Shared-prefix benchmark: time to first token with prefix caching on and off, same requests.

32 requests share a 400-token system prompt and differ in a short user question. They arrive
one after another (each measured from arrival to its first token) after one warm-up request
that puts the system prompt in the cache. With caching on, each prefill computes only the
question; off, it recomputes the whole prompt.

    python -m infer.bench.prefix [--artifact DIR] [--requests 32] [--prefix-tokens 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from .throughput import RESULTS, default_artifact, save_json


def make_prompts(n: int, prefix_tokens: int, vocab: int, seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(prefix_tokens)]
    return [system + [rng.randrange(100, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n + 1)]


def time_to_first_token(artifact: Path, prompts, caching: bool, dtype: str) -> dict:
    from infer.runtime import LLMEngine, SamplingParams

    engine = LLMEngine(artifact, dtype=dtype, enable_prefix_caching=caching, kv_cache_memory=1 << 30)
    params = SamplingParams(max_tokens=1, temperature=0)
    ttfts = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first request only warms up (and, with caching on, fills the cache)
            ttfts.append(time.perf_counter() - start)
    bm = engine.block_manager
    return {"mean_s": statistics.mean(ttfts), "median_s": statistics.median(ttfts), "p90_s": sorted(ttfts)[int(0.9 * len(ttfts))],
            "prefix_queries": bm.prefix_queries, "prefix_hits": bm.prefix_hits}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument("--json", type=Path, default=RESULTS / "prefix.json")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    artifact = args.artifact or default_artifact(args.dtype)
    from infer.runtime.model import ModelConfig

    prompts = make_prompts(args.requests, args.prefix_tokens, ModelConfig.from_dir(artifact).vocab_size, args.seed)
    on = time_to_first_token(artifact, prompts, True, args.dtype)
    off = time_to_first_token(artifact, prompts, False, args.dtype)
    result = {"benchmark": "shared_prefix_ttft", "requests": args.requests, "prefix_tokens": args.prefix_tokens,
              "dtype": args.dtype, "caching_on": on, "caching_off": off, "speedup": off["mean_s"] / on["mean_s"]}
    print(f"TTFT, prefix caching on : mean {on['mean_s'] * 1e3:.1f} ms, median {on['median_s'] * 1e3:.1f} ms "
          f"(hit {on['prefix_hits']}/{on['prefix_queries']} prompt tokens)")
    print(f"TTFT, prefix caching off: mean {off['mean_s'] * 1e3:.1f} ms, median {off['median_s'] * 1e3:.1f} ms")
    print(f"speedup                 : {result['speedup']:.1f}x")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
