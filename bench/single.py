"""Single-request decode speed: this engine against transformers ``generate`` at batch 1, same run.

One request (a 128-token prompt, greedy, ignore_eos) is what a chat user waiting on one answer
gets; llama.cpp's headline figure. Decode speed excludes the prompt: each side's time for N tokens
minus its time for 1 token (the prefill and first token), over N - 1 tokens. Rounds alternate
between the two sides, and medians are reported, since this host's speed drifts.

The memory-bandwidth floor, measured in the same run: a batch-1 decode step reads every weight
once (the LM head included; an untied embedding only one row), so it cannot beat
weight bytes / read bandwidth, with the bandwidth of a large ``sum`` at the benchmark's threads.
A shared host's bandwidth drifts by tens of percent within seconds, so it is probed just before and just
after each side's timed run (``bracketed``), and each round's speed is set against its own floor; a round whose
two probes disagree by more than ``STEADY`` has no floor and stays out of the shares.

On a CPU with AMX the engine runs twice a round: with AMX (``infer``) and with it switched off
(``infer-no-amx``, the path every host without AMX takes).

    python -m infer.bench.single [--artifact DIR] [--tokens 128] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from .throughput import add_common_args, make_requests, prepare, save_json


def _engine_timer(artifact: Path, dtype: str, amx: bool | None = None):
    from infer.runtime import LLM, SamplingParams

    llm = LLM(artifact, dtype=dtype, kv_cache_memory=256 << 20, amx=amx)
    _engine_timer.plans[amx] = llm.engine.plan.describe()

    def run(prompt: list[int], tokens: int) -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == tokens
        return time.perf_counter() - start
    return run


_engine_timer.plans = {}


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


def weight_bytes(artifact: Path, dtype: str) -> int:
    """Bytes one batch-1 decode step reads: every tensor of the checkpoint at its stored width (16- and
    32-bit float tensors at the compute dtype's), less an untied input embedding, of which a step reads one row."""
    import json

    from infer.pipeline.shard import DTYPES, read_header
    from infer.runtime.artifact import CONFIG

    config = json.loads((artifact / CONFIG).read_text())
    width = getattr(torch, dtype).itemsize
    total = 0
    for path in sorted(artifact.glob("*.safetensors")):
        for name, (code, shape) in read_header(path).items():
            if name.endswith("embed_tokens.weight") and not config.get("tie_word_embeddings", False):
                continue
            stored = DTYPES[code]
            total += math.prod(shape) * (width if stored.is_floating_point and stored.itemsize > 1 else stored.itemsize)
    return total


def read_bandwidth(rounds: int = 7) -> float:
    """Bytes/s of a 1 GiB ``sum`` at the current thread count (median of ``rounds``; past any cache), on huge
    pages where Linux allows them, as the engine's streamed weights are (kernels/hugepages.py): on small pages the
    same sum read 8% less on a Zen 5 host, a floor the weights' own stream then beat."""
    from infer.kernels import hugepages

    x = hugepages.arena(1 << 30).view(torch.float32)
    x.fill_(1.0)
    x.sum()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


STEADY = 1.15  # the most two probes around one timed run may differ for that run to have a floor


def bracketed(timed, probe_rounds: int = 3):
    """``timed()`` between two read-bandwidth probes: (its result, the probes' mean in bytes/s, whether they agree
    within STEADY). A shared host's bandwidth can double within seconds (a Zen 5 VM's 2-thread ``sum`` read 30-35
    GB/s one minute and 55-65 the next, its 1-thread ``sum`` ~30 in both), so a probe taken only before a run may
    belong to another phase than the run: a run whose probes disagree has no floor, and its round is left out
    of the shares (its speed still counts)."""
    before = read_bandwidth(probe_rounds)
    out = timed()
    after = read_bandwidth(probe_rounds)
    return out, (before + after) / 2, max(before, after) / min(before, after) <= STEADY


def steady_shares(rates: list[float], floors: list[float], steady: list[bool]) -> list[float]:
    """Each steady round's rate over its own floor (bracketed)."""
    return [rate / floor for rate, floor, ok in zip(rates, floors, steady) if ok]


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
    from infer.kernels.resolver import cpu_has_amx

    engines = {"infer": None, **({"infer-no-amx": False} if cpu_has_amx() else {})}
    sides = {name: _engine_timer(artifact, args.dtype, amx) for name, amx in engines.items()}
    sides["transformers"] = _transformers_timer(artifact, args.dtype)
    prompts = [prompt for prompt, _ in make_requests(args.rounds + 1, vocab, 0, (args.prompt_tokens,) * 2)]
    for run in sides.values():  # warm-up: first calls pay one-off costs
        run(prompts[-1], 4)
    nbytes = weight_bytes(artifact, args.dtype)
    rates = {name: [] for name in sides}
    bandwidths = {name: [] for name in sides}
    steady = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, run in sides.items():  # each side's floor probed just before and just after its own run
            (first, full), bandwidth, ok = bracketed(lambda: (run(prompts[r], 1), run(prompts[r], args.tokens)))
            rates[name].append((args.tokens - 1) / (full - first))
            bandwidths[name].append(bandwidth)
            steady[name].append(ok)
    floors = [bw / nbytes for bw in bandwidths["infer"]]
    result = {"benchmark": "single_request_decode", "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
              "tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(),
              "plan": {name: _engine_timer.plans[amx] for name, amx in engines.items()},
              **{name: {"tokens_per_s": statistics.median(v), "rounds": v} for name, v in rates.items()}}
    result["speedup"] = result["infer"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    shares = {name: steady_shares(rates[name], [bw / nbytes for bw in bandwidths[name]], steady[name])
              for name in sides}
    result["bandwidth_floor"] = {"weight_bytes": nbytes, "read_gb_s": statistics.median(bandwidths["infer"]) / 1e9,
                                 "read_gb_s_rounds": [bw / 1e9 for bw in bandwidths["infer"]],
                                 "steady_rounds": steady["infer"],
                                 "tokens_per_s": statistics.median(floors), "tokens_per_s_rounds": floors,
                                 **{f"{name}_share": statistics.median(shares[name]) if shares[name] else None
                                    for name in engines},
                                 **{f"{name}_share_rounds": shares[name] for name in engines}}
    for name in sides:
        share = (f"{statistics.median(shares[name]):.0%} of the floor in {len(shares[name])} steady rounds"
                 if shares[name] else "no round with a steady floor")
        print(f"{name:<13}: {result[name]['tokens_per_s']:.1f} tok/s decode at batch 1 "
              f"(rounds: {', '.join(f'{v:.1f}' for v in rates[name])}; {share})")
    print(f"speedup      : {result['speedup']:.2f}x")
    print(f"floor        : {statistics.median(floors):.1f} tok/s ({nbytes / 1e6:.0f} MB of weights a step at "
          f"{', '.join(f'{bw / 1e9:.1f}' for bw in bandwidths['infer'])} GB/s read around infer's runs)")
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
