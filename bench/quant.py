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
                                [--keep DIR [--reuse]] [--build-only] [--note TEXT]
    python -m infer.bench.quant --fp8-sensitivity FLOAT_ARTIFACT [--limit N] --json out.json

``--keep DIR --build-only`` builds (and records the build figures of) some schemes, e.g. each with its
own calibration; a later ``--keep DIR --reuse`` run measures every row in one process, so the speeds
and perplexities compare within one run. Each reused row keeps the calibration it was built with
(``calibration`` in the row).

Calibration defaults are smaller than the recipes' (128 x 512): on a 2-core machine GPTQ takes
minutes per model and AWQ's grid search is slower per sample (measured at one thread: GPTQ
128 x 512 in 665 s, AWQ 32 x 256 in 619 s). Pass --calib-samples 128 --calib-seq-len 512 for the
release settings.
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


def build(overrides: list[str], out: Path, cache: Path, threads: int | None = None) -> dict:
    """One ``infer-build`` process; returns its wall time, peak RSS and the quantize stage's seconds.
    ``threads``: its torch/OpenMP threads (``OMP_NUM_THREADS``), else inherited."""
    exe = Path(sys.executable).parent / "infer-build"
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [str(exe), *overrides, f"output_dir={out}", f"cache_dir={cache}"]
    start = time.perf_counter()
    with open(cache / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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
    calib = None
    if manifest.get("quantize") and manifest["quantize"].get("calibration"):
        c = manifest["quantize"]["calibration"]
        calib = f"{c['samples']}x{c['seq_len']}"
    return {"build_wall_s": round(wall, 1), "quantize_s": quant_s, "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
            "artifact_mb": round(size / 1e6, 1), "calibration": calib,
            "ignored": (manifest.get("quantize") or {}).get("ignore")}


def perplexity(path: Path, windows: int, seq_len: int) -> float:
    from tokenizers import Tokenizer

    from infer.eval.datasets import evaluation_texts
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


def fp8_sensitivity(path: Path, windows: int, seq_len: int, limit: int | None = None) -> dict:
    """How much each linear layer of a float checkpoint suffers from FP8_DYNAMIC alone (how the
    smollm2_135m_fp8 recipe's quant.ignore was chosen): each layer in turn fake-quantized in transformers
    (e4m3 per-channel weights, per-token dynamic e4m3 activations, scale = absmax / 448, the rest float32),
    mean KL(float32 || that) per token and the perplexity change on the evaluation split. Data-free and
    ~3 s a layer at one thread with one window of 512 tokens; KL ranks better than perplexity, which
    moves by +-0.3% on one window from noise alone."""
    import transformers
    from tokenizers import Tokenizer

    from infer.eval.datasets import evaluation_texts

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids: list[int] = []
    for t in evaluation_texts():
        ids += tok.encode(t + "\n\n", add_special_tokens=False).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lin = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}

    def fq(x, dim):
        s = x.abs().amax(dim, keepdim=True).clamp(min=1e-12) / 448.0
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s

    def run():
        nll, logits = 0.0, []
        with torch.no_grad():
            for i in range(windows):
                x = torch.tensor([ids[i * seq_len:(i + 1) * seq_len]])
                lg = model(x).logits[0, :-1].float()
                logits.append(lg)
                nll += torch.nn.functional.cross_entropy(lg, x[0, 1:], reduction="sum").item()
        return nll / (windows * (seq_len - 1)), torch.log_softmax(torch.cat(logits).double(), -1)

    base, ref = run()
    out = {}
    for name in list(lin)[:limit]:
        m = lin[name]
        w = m.weight.data
        m.weight.data = fq(w, 1)
        hook = m.register_forward_pre_hook(lambda mod, args: (fq(args[0], -1),))
        v, lq = run()
        hook.remove()
        m.weight.data = w
        out[name] = {"kl": (ref.exp() * (ref - lq)).sum(-1).mean().item(), "ppl_pct": 100 * (math.exp(v - base) - 1)}
        print(f"{name} kl {out[name]['kl']:.5f} ppl {out[name]['ppl_pct']:+.3f}%", file=sys.stderr, flush=True)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["kl"]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="gptq,awq,w8a8,fp8")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the builds and the speed runs")
    ap.add_argument("--json", type=Path, default=RESULTS / "quant.json")
    ap.add_argument("--keep", type=Path, default=None, help="keep the artifacts (and build figures) here")
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse artifacts built by an earlier run")
    ap.add_argument("--build-only", action="store_true", help="with --keep: build (or reuse), measure nothing")
    ap.add_argument("--note", default=None, help="a note saved with the results (where rows come from, load)")
    ap.add_argument("--fp8-sensitivity", type=Path, default=None, metavar="FLOAT_ARTIFACT",
                    help="rank the linear layers of a float artifact by their FP8 error alone (one window of "
                         "--eval-seq-len tokens; see fp8_sensitivity), print them, write --json, build nothing")
    ap.add_argument("--limit", type=int, default=None, help="with --fp8-sensitivity: the first N layers only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fp8_sensitivity:
        ranked = fp8_sensitivity(args.fp8_sensitivity, 1, args.eval_seq_len, args.limit)
        total = sum(r["kl"] for r in ranked.values())
        for name, r in list(ranked.items())[:12]:
            print(f"{name:40s} KL {r['kl']:.5f} ({100 * r['kl'] / total:4.1f}% of the sum)  ppl {r['ppl_pct']:+.2f}%")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "fp8_sensitivity", "layers": ranked}, indent=1) + "\n")
        return ranked
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
                built = build(overrides, out, cache, args.threads)
                figures.write_text(json.dumps(built))
            if args.build_only:
                print(f"[{name}] built: {json.dumps(built)}", file=sys.stderr, flush=True)
                continue
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
    if args.build_only:
        return {"built": [name for name, _ in runs]}
    base = next(r for r in rows if r["scheme"] == "float32")
    for r in rows:
        r["ppl_vs_fp32_pct"] = round(100 * (r["perplexity"] / base["perplexity"] - 1), 2)
        r["decode_b1_vs_fp32"] = round(r["decode_tok_s_b1"] / base["decode_tok_s_b1"], 2)
        r["decode_b16_vs_fp32"] = round(r["decode_tok_s_b16"] / base["decode_tok_s_b16"], 2)
    result = {"benchmark": "quant", "model": "embedded:smollm2-135m-instruct", "host": platform.node(),
              "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
              **({"note": args.note} if args.note else {}),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "note"},
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
        label = r["label"] + (f" ({r['calibration']} calib)" if r.get("calibration") else "")
        lines.append(f"| {label} | {q} | {rss} | {r['artifact_mb']} | {r['perplexity']:.2f} "
                     f"({r['ppl_vs_fp32_pct']:+.1f}%) | {r['decode_tok_s_b1']:.1f} ({r['decode_b1_vs_fp32']:.2f}x) "
                     f"| {r['decode_tok_s_b16']:.1f} ({r['decode_b16_vs_fp32']:.2f}x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
