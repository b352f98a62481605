"""KV memory of a long conversation under a sliding window, against the same model with full attention,
same run: the blocks a sequence holds as it grows, and its decode speed.

Both models are random-weight checkpoints of SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads,
head_dim 64) in bfloat16, Mistral's architecture (Llama's, no biases), one with ``sliding_window`` W and
one without, built by infer-build (no quality is claimed: this measures memory and speed). One request
of a 128-token prompt generates N tokens (ignore_eos); after every step the benchmark reads how many
blocks the sequence holds (those a window has given back excluded).

    flock -x /tmp/infer-cpu.lock python -m infer.bench.sliding_window [--window 512] [--tokens 3072]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from infer.runtime.artifact import TOKENIZER

from .throughput import RESULTS, host_info, save_json

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def _source(path: Path, window: int | None, context: int) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.MistralConfig(**SHAPE, max_position_embeddings=context, sliding_window=window)
    torch.manual_seed(0)  # the same weights in both
    transformers.MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SHAPE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / TOKENIZER))
    return path


def _build(src: Path, out: Path) -> Path:
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    return build(compose_recipe([f"model.source={src}", "model.dtype=bfloat16", "tune.enabled=false",
                                 "eval.enabled=false", "artifact.name=window", f"output_dir={out}",
                                 f"cache_dir={out.parent / 'cache'}"])).artifact


def _run(artifact: Path, prompt: list[int], tokens: int, every: int) -> dict:
    from infer.runtime import LLM, SamplingParams
    from infer.runtime.engine.block_manager import GIVEN_BACK

    llm = LLM(artifact, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=len(prompt) + tokens)
    engine = llm.engine
    seq = engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    held, marks, t_first, t0 = [], {}, None, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        n = len(seq.output_token_ids)
        if n == 1 and t_first is None:
            t_first = time.perf_counter()
        if seq.block_table:
            live = sum(b != GIVEN_BACK for b in seq.block_table)
            held.append(live)
            if n and n % every == 0:
                marks[len(seq)] = live
    t_end = time.perf_counter()
    return {"plan": engine.plan.describe(),
            "window": engine.window, "num_blocks": engine.num_blocks, "max_blocks_held": max(held),
            "blocks_held_at_length": marks, "ttft_s": round(t_first - t0, 3),
            "decode_tok_s": round((tokens - 1) / (t_end - t_first), 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=3072, help="tokens generated after a 128-token prompt")
    ap.add_argument("--json", type=Path, default=RESULTS / "sliding_window.json")
    args = ap.parse_args(argv)
    context = 128 + args.tokens
    prompt = [random.Random(0).randrange(SHAPE["vocab_size"]) for _ in range(128)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("sliding", args.window), ("full", None)):
            src = _source(Path(tmp) / f"src-{name}", window, context)
            artifact = _build(src, Path(tmp) / f"out-{name}" / "artifact")
            rows[name] = _run(artifact, prompt, args.tokens, every=args.tokens // 6)
            r = rows[name]
            print(f"{name:8s} window {window}: blocks held max {r['max_blocks_held']}, by length "
                  f"{r['blocks_held_at_length']}; decode {r['decode_tok_s']} tok/s; ttft {r['ttft_s']} s; "
                  f"step {r['plan']['step']} ({r['plan']['step_why']})", flush=True)
    result = {"bench": "sliding_window", "dtype": "bfloat16", "window": args.window, "prompt_tokens": 128,
              "generated_tokens": args.tokens, "rows": rows,
              "speed_x_full": round(rows["sliding"]["decode_tok_s"] / rows["full"]["decode_tok_s"], 3)}
    save_json(result, args.json)
    print(f"saved {args.json}")


if __name__ == "__main__":
    main()
