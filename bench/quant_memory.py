"""Peak memory of the quantize stage on a large synthetic model: does it hold the model twice?

A Llama of a few billion parameters with random bfloat16 weights (7B-shaped layers, fewer of them by
default) is written to safetensors shard by shard, then the build's quantize stage
(``infer.pipeline.quantize.quantize``, the function the stage runs) quantizes it with a data-free
scheme (FP8_DYNAMIC) in a child process. The child's peak RSS (``wait4``) is compared to the model's
bytes, and a sampler thread in the child records RSS at each phase (load, oneshot, save), which says
what bounds the peak. Free disk is checked first; the files are deleted afterwards.

    python -m infer.bench.quant_memory [--layers 12] [--hidden 4096] [--intermediate 11008] [--dir /tmp]
                                       [--json PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from infer.runtime.artifact import CONFIG, INDEX


def _rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def param_count(c: dict) -> int:
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + 2 * c["vocab_size"] * h + h


def write_checkpoint(out: Path, c: dict) -> int:
    """Random bfloat16 weights in HF Llama layout, one safetensors shard per decoder layer (never the
    whole model in memory); returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0

    def layer(k):
        p = f"model.layers.{k}."
        return {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}

    shards = [("model-embed.safetensors", lambda: {"model.embed_tokens.weight": rand(c["vocab_size"], h),
                                                   "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                                                   "lm_head.weight": rand(c["vocab_size"], h)})]
    shards += [(f"model-layer{k:03d}.safetensors", lambda k=k: layer(k)) for k in range(n)]
    for name, make in shards:
        tensors = make()
        save_file(tensors, out / name, metadata={"format": "pt"})
        for t in tensors:
            weight_map[t] = name
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / CONFIG).write_text(json.dumps(c, indent=1))
    return total


def child(src: Path, out: Path, record: Path) -> None:
    """The quantize stage's body on ``src``, with RSS sampled by phase."""
    import torch

    from infer.pipeline.config import compose_recipe
    from infer.pipeline.quantize import plan, quantize

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    samples: list[tuple[float, float, str]] = []
    phase = ["start"]
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample():
        while not stop.is_set():
            samples.append((round(time.perf_counter() - t0, 2), round(_rss_gb(), 3), phase[0]))
            stop.wait(0.25)

    threading.Thread(target=sample, daemon=True).start()
    import llmcompressor
    import transformers

    real_load, real_oneshot = transformers.AutoModelForCausalLM.from_pretrained, llmcompressor.oneshot

    def load(*a, **k):  # phase markers around the stage's own calls
        phase[0] = "load"
        return real_load(*a, **k)

    def oneshot(*a, **k):
        phase[0] = "oneshot"
        r = real_oneshot(*a, **k)
        phase[0] = "save"  # the stage saves the compressed checkpoint right after
        return r

    transformers.AutoModelForCausalLM.from_pretrained = load
    llmcompressor.oneshot = oneshot
    cfg = compose_recipe(["recipe=smollm2_135m_fp8", "quant.ignore=[lm_head]", f"model.source={src}",
                          "model.dtype=bfloat16"])
    config = json.loads((src / CONFIG).read_text())
    info = quantize(src, out, cfg, plan(cfg, config), [])
    stop.set()
    peaks = {}
    for _, rss, ph in samples:
        peaks[ph] = max(peaks.get(ph, 0.0), rss)
    record.write_text(json.dumps({"info": info, "phase_peak_rss_gb": peaks, "seconds": round(time.perf_counter() - t0, 1),
                                  "samples": samples[:: max(1, len(samples) // 400)]}))


def main(argv=None) -> dict:
    from .throughput import RESULTS, host_info  # here: the quantize child imports this module and needs neither

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (Llama-2-7B has 32)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152, help="the embedded model's tokenizer's size")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=RESULTS / "quant_memory.json")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic and quantized checkpoints")
    ap.add_argument("--child", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return {}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
              "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    params = param_count(config)
    need = params * 2 * 2.2  # the bfloat16 source, the fp8 output (half) and margin
    free = shutil.disk_usage(args.dir).free
    if free < need:
        raise SystemExit(f"--dir {args.dir}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed for a "
                         f"{params / 1e9:.2f} B-parameter model; use fewer --layers or another --dir")
    work = Path(tempfile.mkdtemp(prefix="infer-quant-memory-", dir=args.dir))
    src, out, record = work / "src", work / "out", work / "record.json"
    try:
        print(f"writing a {params / 1e9:.2f} B-parameter bfloat16 checkpoint to {src} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        written = write_checkpoint(src, config)
        write_s = time.perf_counter() - t
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        before = host_info()
        print("quantizing (fp8, data-free) in a child process ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "infer.bench.quant_memory", "--child", str(src), str(out),
                                 str(record)], env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"the quantize child failed (exit {os.waitstatus_to_exitcode(status)})")
        rec = json.loads(record.read_text())
        peak = usage.ru_maxrss / 2**20
        out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        result = {"benchmark": "quant_memory", "host": before, "threads": args.threads, "config": config,
                  "parameters": params, "source_bytes": written, "source_gb": round(written / 2**30, 2),
                  "write_s": round(write_s, 1), "quantize_wall_s": round(time.perf_counter() - t, 1),
                  "peak_rss_gb": round(peak, 2), "peak_over_model": round(peak / (written / 2**30), 2),
                  "phase_peak_rss_gb": rec["phase_peak_rss_gb"], "output_gb": round(out_bytes / 2**30, 2),
                  "stage_info": rec["info"], "rss_samples": rec["samples"]}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{params / 1e9:.2f} B parameters, {result['source_gb']} GB in bfloat16: quantize stage peak RSS "
          f"{result['peak_rss_gb']} GB ({result['peak_over_model']}x the model); by phase "
          f"{result['phase_peak_rss_gb']}; output {result['output_gb']} GB")
    return result


if __name__ == "__main__":
    main()
