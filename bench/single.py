"""Single-request decode speed: this engine against transformers ``generate`` at batch 1, same run.

One request (a 128-token prompt, greedy, ignore_eos) is what a chat user waiting on one answer
gets; llama.cpp's headline figure. Decode speed excludes the prompt: each side's time for N tokens
minus its time for 1 token (the prefill and first token), over N - 1 tokens. Rounds alternate
between the two sides, and medians are reported, since this host's speed drifts.

    python -m infer.bench.single [--artifact DIR] [--tokens 128] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from .throughput import add_common_args, make_requests, prepare, save_json


def _engine_timer(artifact: Path, dtype: str):
    from infer.runtime import LLM, SamplingParams

    llm = LLM(artifact, dtype=dtype, kv_cache_memory=256 << 20)

    def run(prompt: list[int], tokens: int) -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == tokens
        return time.perf_counter() - start
    return run


def _transformers_timer(artifact: Path, dtype: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=getattr(torch, dtype)).eval()

    def run(prompt: list[int], tokens: int) -> float:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt) + tokens
        return time.perf_counter() - start
    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "single.json")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per timed request")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    artifact = prepare(args)
    from infer.runtime.model import ModelConfig

    vocab = ModelConfig.from_dir(artifact).vocab_size
    sides = {"infer": _engine_timer(artifact, args.dtype), "transformers": _transformers_timer(artifact, args.dtype)}
    prompts = [prompt for prompt, _ in make_requests(args.rounds + 1, vocab, 0, (args.prompt_tokens,) * 2)]
    for run in sides.values():  # warm-up: first calls pay one-off costs
        run(prompts[-1], 4)
    rates = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, run in sides.items():
            first, full = run(prompts[r], 1), run(prompts[r], args.tokens)
            rates[name].append((args.tokens - 1) / (full - first))
    result = {"benchmark": "single_request_decode", "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
              "tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(),
              **{name: {"tokens_per_s": statistics.median(v), "rounds": v} for name, v in rates.items()}}
    result["speedup"] = result["infer"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    for name in sides:
        print(f"{name:<13}: {result[name]['tokens_per_s']:.1f} tok/s decode at batch 1 "
              f"(rounds: {', '.join(f'{v:.1f}' for v in rates[name])})")
    print(f"speedup      : {result['speedup']:.2f}x")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
