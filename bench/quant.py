"""Quantization benchmark: every scheme on the embedded model against float32 and bfloat16, same run.

For each of float32, bfloat16 and the quantized recipes (smollm2_135m_{gptq,awq,w8a8,fp8}):
- the quantize stage's wall time and peak RSS (each build runs as its own ``infer-build`` process,
  with a private cache so nothing is reused; RSS is that process's peak, from ``wait4``),
- the artifact's size,
- perplexity on the evaluation split of pydoc_data.topics (disjoint from calibration),
- decode tokens/s at batch 1 and batch 16 with the engine (greedy, ignore_eos): the time of
  ``N + 1`` generated tokens minus the time of 1, so prefill is not counted.

    python -m infer.bench.quant [--schemes gptq,awq,w8a8,fp8] [--calib-samples 32] [--calib-seq-len 256]
                                [--eval-windows 8] [--decode-tokens 32] [--json bench/results/quant.json]

Calibration defaults are smaller than the recipes' (128 x 512): on a 2-core machine GPTQ takes
minutes per model regardless (its cost is per layer, not per sample) and AWQ's grid search is
slower still. Pass --calib-samples 128 --calib-seq-len 512 for the release settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES = {"gptq": "W4A16 GPTQ g64 sym", "awq": "W4A16 AWQ g64 sym", "w8a8": "W8A8 SmoothQuant+GPTQ",
           "fp8": "FP8 dynamic"}


def build(overrides: list[str], out: Path, cache: Path) -> dict:
    """One ``infer-build`` process; returns its wall time, peak RSS and the quantize stage's seconds."""
    exe = Path(sys.executable).parent / "infer-build"
    cmd = [str(exe), *overrides, f"output_dir={out}", f"cache_dir={cache}"]
    start = time.perf_counter()
    with open(cache / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {cache / (out.name + '.log')}")
    manifest = json.loads((out / "manifest.json").read_text())
    quant_s = None
    if "quantize" in manifest["stages"]:
        record = cache / "stages" / "quantize" / manifest["stages"]["quantize"][:32] / "_stage.json"
        quant_s = json.loads(record.read_text())["seconds"]
    size = sum(f["size"] for f in manifest["files"].values())
    return {"build_wall_s": round(wall, 1), "quantize_s": quant_s, "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
            "artifact_mb": round(size / 1e6, 1)}


def perplexity(path: Path, windows: int, seq_len: int) -> float:
    from tokenizers import Tokenizer

    from infer.pipeline.datasets import evaluation_texts
    from infer.runtime.model import load_model

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids: list[int] = []
    for t in evaluation_texts():
        ids += tok.encode(t + "\n\n", add_special_tokens=False).ids
    model = load_model(path)
    nll, count = 0.0, 0
    for i in range(min(windows, len(ids) // seq_len)):
        x = torch.tensor([ids[i * seq_len:(i + 1) * seq_len]])
        logits = model.logits(x)[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += seq_len - 1
    return math.exp(nll / count)


def decode_speed(path: Path, batch: int, tokens: int) -> float:
    from infer.runtime import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=256 << 20)
    prompts = [[1] + [100 + (7 * i + j) % 5000 for j in range(15)] for i in range(batch)]

    def timed(n):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    timed(2)  # warm-up
    t1 = sorted(timed(1) for _ in range(3))[1]  # prefill and the first token
    tn = timed(tokens + 1)
    decode = tn - t1 if tn > 1.5 * t1 else tn  # on a noisy machine a bad t1 must not blow the figure up
    return batch * tokens / decode


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="gptq,awq,w8a8,fp8")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the speed runs")
    ap.add_argument("--json", type=Path, default=RESULTS / "quant.json")
    ap.add_argument("--keep", type=Path, default=None, help="keep the artifacts (and build figures) here")
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse artifacts built by an earlier run")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="infer-bench-quant-"))
    keep = args.keep or work / "artifacts"
    keep.mkdir(parents=True, exist_ok=True)
    calib = [f"calib.samples={args.calib_samples}", f"calib.seq_len={args.calib_seq_len}"]
    runs = [("float32", ["recipe=smollm2_135m"]), ("bfloat16", ["recipe=smollm2_135m", "model.dtype=bfloat16"])]
    runs += [(s, [f"recipe=smollm2_135m_{s}", *calib]) for s in args.schemes.split(",") if s]
    rows = []
    try:
        for name, overrides in runs:
            cache = work / f"cache-{name}"
            cache.mkdir()
            out = keep / name
            figures = keep / f"{name}.build.json"
            if args.reuse and figures.is_file() and (out / "manifest.json").is_file():
                built = json.loads(figures.read_text())
            else:
                print(f"[{name}] building ...", file=sys.stderr, flush=True)
                built = build(overrides, out, cache)
                figures.write_text(json.dumps(built))
            built = dict(built)
            row = {"scheme": name, "label": built.pop("label", SCHEMES.get(name, name)), **built}
            print(f"[{name}] perplexity ...", file=sys.stderr, flush=True)
            row["perplexity"] = round(perplexity(out, args.eval_windows, args.eval_seq_len), 3)
            for b in (1, 16):
                print(f"[{name}] decode batch {b} ...", file=sys.stderr, flush=True)
                row[f"decode_tok_s_b{b}"] = round(decode_speed(out, b, args.decode_tokens), 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    base = next(r for r in rows if r["scheme"] == "float32")
    for r in rows:
        r["ppl_vs_fp32_pct"] = round(100 * (r["perplexity"] / base["perplexity"] - 1), 2)
        r["decode_b1_vs_fp32"] = round(r["decode_tok_s_b1"] / base["decode_tok_s_b1"], 2)
        r["decode_b16_vs_fp32"] = round(r["decode_tok_s_b16"] / base["decode_tok_s_b16"], 2)
    result = {"benchmark": "quant", "model": "embedded:smollm2-135m-instruct", "host": platform.node(),
              "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return result


def table(rows: list[dict]) -> str:
    head = ("| scheme | quantize s | peak RSS GB | size MB | perplexity (vs fp32) | decode tok/s b1 (vs fp32) "
            "| decode tok/s b16 (vs fp32) |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        q = "-" if r["quantize_s"] is None else f"{r['quantize_s']:.0f}"
        rss = "-" if r["peak_rss_gb"] is None else r["peak_rss_gb"]
        lines.append(f"| {r['label']} | {q} | {rss} | {r['artifact_mb']} | {r['perplexity']:.2f} "
                     f"({r['ppl_vs_fp32_pct']:+.1f}%) | {r['decode_tok_s_b1']:.1f} ({r['decode_b1_vs_fp32']:.2f}x) "
                     f"| {r['decode_tok_s_b16']:.1f} ({r['decode_b16_vs_fp32']:.2f}x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
