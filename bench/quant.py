"""Quantization benchmark: every scheme on the embedded model against float32 and bfloat16, same run.

For each of float32, bfloat16 and the quantized schemes (SCHEMES: the smollm2_135m_* recipes, plus
``gptq_llmc``, llm-compressor's own GPTQ driven directly on the same calibration windows):
- the quantize stage's wall time and peak RSS (each build runs as its own ``infer-build`` process;
  RSS is that process's peak, from ``wait4``); a build whose stages an earlier row already made
  (``gptq_auto``'s first candidate is ``gptq``) reuses them from the one shared cache, and its
  quantize seconds are those of the stage that made them,
- the artifact's size,
- perplexity on the evaluation split of pydoc_data.topics (disjoint from calibration),
- on the chat prompts (eval/tasks/chat_prompts.jsonl through the chat template), against the
  bfloat16 artifact: greedy agreement, and KL divergence and top-1 agreement over bfloat16's answers
  (the bfloat16 row against float32: the floor),
- decode tokens/s at batch 1 and batch 16 with the engine (greedy, ignore_eos): the time of
  ``N + 1`` generated tokens minus the time of 1, so prefill is not counted; batch 1's share of the
  scheme's own bandwidth floor (the bytes its step reads, bench/single.py's ``weight_bytes``, over the
  read bandwidth probed just before and just after that decode: none where the two disagree, ``bracketed``);
- prefill tokens/s of a fresh ``--prompt-tokens`` prompt (one output token, prefix caching off).
Speeds only, interleaved rounds and llama.cpp beside them: ``infer-bench quant-speed``.

    python -m infer.bench.quant [--schemes fp8,gptq,...] [--calib-samples 128] [--calib-seq-len 512]
                                [--eval-windows 16] [--chat-prompts 48] [--decode-tokens 32]
                                [--json PATH] [--keep DIR [--reuse]] [--build-only] [--note TEXT]
    python -m infer.bench.quant --fp8-sensitivity FLOAT_ARTIFACT [--limit N] --json out.json

``--keep DIR --build-only`` builds (and records the build figures of) some schemes; a later
``--keep DIR --reuse`` run measures every row in one process, so the speeds and perplexities compare
within one run (``--wait-builds``: rows still being built by a ``--build-only`` process are waited for).
Each reused row keeps the calibration it was built with (``calibration`` in the row). A row whose gates
stopped its build (``fp8_auto`` and ``w8a8_auto`` when no candidate reaches the greedy-agreement gate)
is not measured: its figures are its candidates' gate metrics, under ``not_published``. The baseline's
chat answers are computed once for all rows (``BaselineMemo``).

Calibration defaults are smaller than the recipes' (128 x 512): on a 2-core machine GPTQ takes
minutes per model. Pass --calib-samples 128 --calib-seq-len 512 for the release settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from infer.runtime.artifact import CONFIG, MANIFEST, TOKENIZER

from .single import weight_bytes
from .throughput import RESULTS, host_info

# name: (label, infer-build overrides; None: built by llmcompressor_direct, then packaged)
SCHEMES = {
    "fp8": ("FP8 dynamic (layer 29's MLP in float)", ["recipe=smollm2_135m_fp8"]),
    "w8a8": ("W8A8, SmoothQuant strength chosen by the gates", ["recipe=smollm2_135m_w8a8"]),
    "fp8_auto": ("FP8 dynamic, accuracy-gated float layers", ["recipe=smollm2_135m_fp8_auto"]),
    "w8a8_auto": ("W8A8 SmoothQuant 0.8, accuracy-gated float layers", ["recipe=smollm2_135m_w8a8_auto"]),
    "gptq": ("W4A16 GPTQ g64 sym", ["recipe=smollm2_135m_gptq"]),
    "gptq_raw": ("W4A16 GPTQ g64 sym, raw-text calibration only", ["recipe=smollm2_135m_gptq", "calib.chat_fraction=0"]),
    "gptq_llmc": ("W4A16 GPTQ g64 sym, llm-compressor driven directly", None),
    "gptq_auto": ("W4A16 GPTQ g64, accuracy-gated mixed precision", ["recipe=smollm2_135m_gptq_auto"]),
    "gptq_g32_asym": ("W4A16 GPTQ g32 asym", ["recipe=smollm2_135m_gptq_g32_asym"]),
    "awq": ("W4A16 AWQ g64 sym", ["recipe=smollm2_135m_awq"]),
}
DEFAULT_SCHEMES = "fp8,fp8_auto,gptq,gptq_llmc,gptq_auto,gptq_g32_asym,w8a8,w8a8_auto"


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
    code = os.waitstatus_to_exitcode(status)
    failed = out.with_name(out.name + ".gate-failed") / "eval.json"
    if code == 3 and failed.is_file():  # its gates stopped it: the row says which, and why
        doc = json.loads(failed.read_text())
        return {"gate_failed": [g["message"] for g in doc["gates"] if g["passed"] is False],
                "selection": doc.get("selection"), "build_wall_s": round(wall, 1),
                "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2)}
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {cache / (out.name + '.log')}")
    manifest = json.loads((out / MANIFEST).read_text())
    quant_s = None
    if "quantize" in manifest["stages"]:
        record = cache / "stages" / "quantize" / manifest["stages"]["quantize"][:32] / "_stage.json"
        quant_s = json.loads(record.read_text())["seconds"]
    # the model and tokenizer files: not the evaluation report a gated build carries
    size = sum(f["size"] for k, f in manifest["files"].items()
               if not (k.startswith(("plots/", "report.")) or k == "eval.json"))
    calib = None
    if manifest.get("quantize") and manifest["quantize"].get("calibration"):
        c = manifest["quantize"]["calibration"]
        calib = f"{c['samples']}x{c['seq_len']}" + (f" ({c['chat']['samples']} chat)" if c.get("chat") else "")
    selection = (manifest.get("evaluation") or {}).get("selection")
    return {"build_wall_s": round(wall, 1), "quantize_s": quant_s, "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
            "artifact_mb": round(size / 1e6, 1), "calibration": calib,
            "ignored": (manifest.get("quantize") or {}).get("ignore"),
            "wide_layers": len((manifest.get("quantize") or {}).get("wide_layers") or []),
            "smoothing_strength": (manifest.get("quantize") or {}).get("smoothing_strength"),
            "selection": None if not selection else {
                "chosen": selection["chosen"],
                "candidates": [{k: r.get(k) for k in ("candidate", "passed", "size_bytes", "ppl_increase_pct",
                                                       "chat_mean_kld", "chat_top1_agreement", "greedy_agreement")}
                               for r in selection["candidates"]]}}


def llmcompressor_direct(src: Path, out: Path, samples: int, seq_len: int) -> None:
    """llm-compressor's GPTQ as its own documentation drives it: ``oneshot`` with a ``GPTQModifier`` at its
    defaults (only group size 64, which SmolLM2's 576 needs, and lm_head left out), on exactly the token
    windows infer-build's smollm2_135m_gptq recipe calibrates on (calibration_windows), in their order.
    The comparison row for this project's quantize stage."""
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    from infer.pipeline.config import compose_recipe
    from infer.pipeline.quantize import calibration_windows
    from infer.pipeline.stage import copy_carried_files

    cfg = compose_recipe(["recipe=smollm2_135m_gptq", f"calib.samples={samples}", f"calib.seq_len={seq_len}"])
    windows, _ = calibration_windows(cfg, src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    recipe = GPTQModifier(targets="Linear", ignore=["lm_head"], config_groups={"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 64}}})
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    # no shuffling (llm-compressor's default shuffles): the same order of Hessian sums as the stage, so that
    # equal settings give a bit-identical checkpoint (shuffled: measured +-1.6% perplexity at 4 x 64)
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(windows), max_seq_length=seq_len,
            shuffle_calibration_samples=False)
    model.save_pretrained(out, save_compressed=True)
    copy_carried_files(src, out)
    config = json.loads((out / CONFIG).read_text())
    config.setdefault("rope_theta", json.loads((src / CONFIG).read_text()).get("rope_theta"))
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def build_direct(src: Path, out: Path, cache: Path, samples: int, seq_len: int, threads: int | None) -> dict:
    """llmcompressor_direct in its own process (timed, its peak RSS), then packaged as a compressed-tensors
    source by infer-build (copied as it is)."""
    hf = cache / f"{out.name}-hf"
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [sys.executable, "-m", "infer.bench.quant", "--llmcompressor-direct", str(src), str(hf),
           "--calib-samples", str(samples), "--calib-seq-len", str(seq_len)]
    start = time.perf_counter()
    if not (hf / CONFIG).is_file():
        with open(cache / f"{out.name}-direct.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed; see {cache / (out.name + '-direct.log')}")
        rss = round(usage.ru_maxrss / 2**20, 2)
    else:
        rss = None
    seconds = round(time.perf_counter() - start, 1)
    built = build(["recipe=smollm2_135m", f"model.source={hf}", "artifact.name=smollm2-135m-instruct-gptq-llmc"],
                  out, cache, threads)
    return {**built, "quantize_s": seconds, "peak_rss_gb": rss, "calibration": f"{samples}x{seq_len} (the gptq row's windows)"}


def perplexity(path: Path, windows: int, seq_len: int) -> float:
    from tokenizers import Tokenizer

    from infer.eval.datasets import evaluation_texts
    from infer.runtime.model import load_model

    tok = Tokenizer.from_file(str(path / TOKENIZER))
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


def decode_speed(path: Path, batch: int, tokens: int, floor: bool = False) -> tuple[float, float | None, bool | None]:
    """Decode tok/s at this batch; with ``floor``, the read bandwidth probed around it and whether those probes agree
    (bench/single.py's ``bracketed``), else None for both."""
    from infer.runtime import LLM, SamplingParams

    from .single import bracketed

    llm = LLM(path, kv_cache_memory=256 << 20)
    prompts = [[1] + [100 + (7 * i + j) % 5000 for j in range(15)] for i in range(batch)]

    def timed(n):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    timed(2)  # warm-up

    def run():  # prefill and the first token, then N + 1 tokens
        return sorted(timed(1) for _ in range(3))[1], timed(tokens + 1)

    (t1, tn), bandwidth, steady = bracketed(run) if floor else (run(), None, None)
    decode = tn - t1 if tn > 1.5 * t1 else tn  # on a noisy machine a bad t1 must not blow the figure up
    return batch * tokens / decode, bandwidth, steady


def prefill(path: Path, prompt_tokens: int) -> dict:
    """Prefill tok/s of fresh prompts (median of 3), the dtype the engine runs the artifact in, its plan."""
    from infer.runtime import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    dtype = str(llm.engine.model.dtype).removeprefix("torch.")
    rates = []
    for i in range(4):  # the first a warm-up
        prompt = [1] + [100 + (13 * i + 7 * j) % 20000 for j in range(prompt_tokens - 1)]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        rates.append(prompt_tokens / (time.perf_counter() - start))
    return {"prefill_tok_s": round(sorted(rates[1:])[1], 1), "dtype": dtype, "plan": llm.engine.plan.describe()}


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

    tok = Tokenizer.from_file(str(path / TOKENIZER))
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


def chat_metrics(path: Path, baseline: Path, prompts: int, tokens: int) -> dict:
    """Against ``baseline`` on the chat prompts (eval/tasks/chat_prompts.jsonl, chat template applied):
    greedy agreement, and KL divergence and top-1 agreement over the baseline's answers."""
    from infer.eval.metrics import compare_on_chat, load_prompts, model_identity
    from infer.eval.runner import open_llm

    ps = load_prompts("default", prompts)
    # the baseline's answers and their distributions are computed once for all rows (BaselineMemo)
    identity = model_identity(json.loads((baseline / MANIFEST).read_text()))
    c = compare_on_chat(open_llm(path, 512 + tokens), open_llm(baseline, 512 + tokens), ps, tokens, memo_key=identity)
    return {k: round(c[k], 4) if isinstance(c[k], float) else c[k] for k in
            ("prompts", "chat_tokens", "greedy_agreement", "greedy_exact_match", "chat_mean_kld", "chat_top1_agreement")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"of {', '.join(SCHEMES)}")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--chat-prompts", type=int, default=48, help="chat prompts for the agreement with bfloat16")
    ap.add_argument("--chat-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="the prefill figure's prompt length")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the builds and the speed runs")
    ap.add_argument("--json", type=Path, default=RESULTS / "quant.json")
    ap.add_argument("--keep", type=Path, default=None, help="keep the artifacts, the cache and build figures here")
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse artifacts built by an earlier run")
    ap.add_argument("--build-only", action="store_true", help="with --keep: build (or reuse), measure nothing")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="an infer-build override added to every scheme built by this run (recorded in its figures), "
                         "e.g. quant.auto_steps=[1.0]")
    ap.add_argument("--wait-builds", action="store_true",
                    help="with --reuse: a row not built yet is being built by another --build-only process; wait for "
                         "its figures instead of building it")
    ap.add_argument("--note", default=None, help="a note saved with the results (where rows come from, load)")
    ap.add_argument("--fp8-sensitivity", type=Path, default=None, metavar="FLOAT_ARTIFACT",
                    help="rank the linear layers of a float artifact by their FP8 error alone (one window of "
                         "--eval-seq-len tokens; see fp8_sensitivity), print them, write --json, build nothing")
    ap.add_argument("--limit", type=int, default=None, help="with --fp8-sensitivity: the first N layers only")
    ap.add_argument("--llmcompressor-direct", nargs=2, type=Path, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llmcompressor_direct:
        llmcompressor_direct(*args.llmcompressor_direct, args.calib_samples, args.calib_seq_len)
        return {}
    if args.fp8_sensitivity:
        ranked = fp8_sensitivity(args.fp8_sensitivity, 1, args.eval_seq_len, args.limit)
        total = sum(r["kl"] for r in ranked.values())
        for name, r in list(ranked.items())[:12]:
            print(f"{name:40s} KL {r['kl']:.5f} ({100 * r['kl'] / total:4.1f}% of the sum)  ppl {r['ppl_pct']:+.2f}%")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "fp8_sensitivity", "layers": ranked}, indent=1) + "\n")
        return ranked
    names = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in names if s not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: unknown {', '.join(unknown)}; valid choices: {', '.join(SCHEMES)}")
    work = Path(tempfile.mkdtemp(prefix="infer-bench-quant-"))
    keep = args.keep or work / "artifacts"
    keep.mkdir(parents=True, exist_ok=True)
    cache = keep / "cache"  # one cache: a row that needs another's stages (gptq_auto: gptq's) reuses them
    cache.mkdir(exist_ok=True)
    calib = [f"calib.samples={args.calib_samples}", f"calib.seq_len={args.calib_seq_len}"]
    runs = [("float32", "float32", ["recipe=smollm2_135m"]),
            ("bfloat16", "bfloat16", ["recipe=smollm2_135m", "model.dtype=bfloat16"])]
    runs += [(n, SCHEMES[n][0], None if SCHEMES[n][1] is None else [*SCHEMES[n][1], *calib, *args.override])
             for n in names]
    rows = []
    try:
        for name, label, overrides in runs:
            out = keep / name
            figures = keep / f"{name}.build.json"
            if args.reuse and args.wait_builds and not args.build_only:
                while not figures.is_file():  # another process is building this row: its figures end it
                    print(f"[{name}] waiting for {figures} ...", file=sys.stderr, flush=True)
                    time.sleep(30)
            reusable = figures.is_file() and ((out / MANIFEST).is_file()
                                              or json.loads(figures.read_text()).get("gate_failed"))
            if args.reuse and reusable:  # a published artifact, or a build its gates stopped (its figures)
                built = json.loads(figures.read_text())
            else:
                print(f"[{name}] building ...", file=sys.stderr, flush=True)
                shutil.rmtree(out, ignore_errors=True)
                built = (build(overrides, out, cache, args.threads) if overrides is not None else
                         build_direct(keep / "float32", out, cache, args.calib_samples, args.calib_seq_len,
                                      args.threads))
                if args.override and overrides is not None:
                    built["overrides"] = list(args.override)
                figures.write_text(json.dumps(built))
            if args.build_only:
                print(f"[{name}] built: {json.dumps(built)}", file=sys.stderr, flush=True)
                continue
            row = {"scheme": name, "label": label, **built}
            if built.get("gate_failed"):
                print(f"[{name}] not published, its gates failed: {built['gate_failed']}", file=sys.stderr, flush=True)
                rows.append(row)
                continue
            print(f"[{name}] perplexity ...", file=sys.stderr, flush=True)
            row["perplexity"] = round(perplexity(out, args.eval_windows, args.eval_seq_len), 3)
            print(f"[{name}] chat prompts against {'float32' if name == 'bfloat16' else 'bfloat16'} ...",
                  file=sys.stderr, flush=True)
            row["chat_vs"] = "float32" if name == "bfloat16" else "bfloat16"
            if name != "float32":
                row.update(chat_metrics(out, keep / row["chat_vs"], args.chat_prompts, args.chat_tokens))
            print(f"[{name}] prefill ...", file=sys.stderr, flush=True)
            row.update(prefill(out, args.prompt_tokens))
            for b in (1, 16):
                print(f"[{name}] decode batch {b} ...", file=sys.stderr, flush=True)
                rate, bandwidth, steady = decode_speed(out, b, args.decode_tokens, floor=b == 1)  # batch 1's floor
                row[f"decode_tok_s_b{b}"] = round(rate, 1)
                if b == 1:
                    row["floor_tok_s"] = round(bandwidth / weight_bytes(out, row["dtype"]), 1)
                    row["floor_steady"] = steady
            row["share_of_floor"] = round(row["decode_tok_s_b1"] / row["floor_tok_s"], 3) if row["floor_steady"] else None
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.build_only:
        return {"built": [name for name, _, _ in runs]}
    base = next(r for r in rows if r["scheme"] == "float32")
    failed_rows = [r for r in rows if r.get("gate_failed")]
    rows = [r for r in rows if not r.get("gate_failed")]
    for r in rows:
        r["ppl_vs_fp32_pct"] = round(100 * (r["perplexity"] / base["perplexity"] - 1), 2)
        r["decode_b1_vs_fp32"] = round(r["decode_tok_s_b1"] / base["decode_tok_s_b1"], 2)
        r["decode_b16_vs_fp32"] = round(r["decode_tok_s_b16"] / base["decode_tok_s_b16"], 2)
    bf16 = next((r for r in rows if r["scheme"] == "bfloat16"), None)
    for r in rows:
        if bf16 is not None:
            r["decode_b1_vs_bf16"] = round(r["decode_tok_s_b1"] / bf16["decode_tok_s_b1"], 2)
            r["prefill_vs_bf16"] = round(r["prefill_tok_s"] / bf16["prefill_tok_s"], 2)
    result = {"benchmark": "quant", "model": "embedded:smollm2-135m-instruct", "host": host_info(),
              **({"note": args.note} if args.note else {}),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "note"},
              "rows": rows, "not_published": failed_rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return result


def table(rows: list[dict]) -> str:
    """One row per scheme: build, size, quality, and speed (decode against float32 and bfloat16 and its own
    floor, prefill against bfloat16)."""
    head = ("| scheme | calibration | quantize s | size MB | perplexity (vs fp32) | chat greedy agreement | chat KLD "
            "| chat top-1 | decode tok/s b1 (vs fp32, vs bf16) | share of floor | decode tok/s b16 (vs fp32) "
            "| prefill tok/s (vs bf16) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        q = "-" if r.get("quantize_s") is None else f"{r['quantize_s']:.0f}"
        chat = [f"{r[k]:.3f}" if r.get(k) is not None else "-" for k in ("greedy_agreement", "chat_mean_kld",
                                                                          "chat_top1_agreement")]
        vs_bf16 = f", {r['decode_b1_vs_bf16']:.2f}x" if "decode_b1_vs_bf16" in r else ""
        prefill_vs = f" ({r['prefill_vs_bf16']:.2f}x)" if "prefill_vs_bf16" in r else ""
        share = "- (bandwidth moved)" if r["share_of_floor"] is None else f"{r['share_of_floor']:.0%}"
        lines.append(f"| {r['label']} | {r.get('calibration') or '-'} | {q} | {r['artifact_mb']} | {r['perplexity']:.2f} "
                     f"({r['ppl_vs_fp32_pct']:+.1f}%) | {' | '.join(chat)} | {r['decode_tok_s_b1']:.1f} "
                     f"({r['decode_b1_vs_fp32']:.2f}x{vs_bf16}) | {share} | "
                     f"{r['decode_tok_s_b16']:.1f} ({r['decode_b16_vs_fp32']:.2f}x) | {r['prefill_tok_s']:.0f}{prefill_vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
