"""Peak memory and wall time of the shard stage (and of merging it back) on a multi-GB checkpoint.

Writes a synthetic Llama-shaped checkpoint (default: Llama-3.2-3B's shape, 3.2B parameters,
random bfloat16, tied embeddings, 6.4 GB in ~2 GB safetensors shards) tensor by tensor into a
temporary directory, then in a fresh process for each step runs ``shard`` with tp=4 and ``merge``
of the result, and reports each step's peak RSS (VmHWM, reset after the imports) against the
largest tensor and the checkpoint size. The temporary directory is deleted afterwards.

The source is read back right after being written, so it comes from the page cache: the times
are the stages' own work plus writing, not a cold disk.

    python -m infer.bench.shard_memory [--tp 4] [--layers 28] [--dir /tmp] [--no-merge] [--json out.json]
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

from infer.runtime.artifact import CONFIG, INDEX

from .throughput import RESULTS, host_info

# Llama-3.2-3B's shape (tied embeddings)
SHAPE = {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_key_value_heads": 8,
         "vocab_size": 128256, "head_dim": 128}

_STEP = """
import json, sys, time
from pathlib import Path
from infer.pipeline.merge import merge
from infer.pipeline.shard import shard

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # peak RSS from here on, imports excluded
base = status("VmRSS")
start = time.perf_counter()
if sys.argv[1] == "shard":
    shard(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
else:
    merge(Path(sys.argv[2]), Path(sys.argv[3]))
print(json.dumps({"base_rss": base, "peak_rss": status("VmHWM"), "seconds": time.perf_counter() - start}))
"""


def llama_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return shapes


def write_checkpoint(path: Path, layers: int, shard_bytes: int = 2 << 30) -> dict[str, tuple[int, ...]]:
    """Random bfloat16 weights written tensor by tensor (pipeline.shard's streaming writer) into
    ~2 GB shards with an index: never more than one tensor in memory."""
    from infer.pipeline.shard import SafetensorsWriter

    shapes = llama_shapes(layers)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "dtype": "bfloat16", **SHAPE}
    (path / CONFIG).write_text(json.dumps(config, indent=2))
    groups, size = [[]], 0
    for name in sorted(shapes):
        nbytes = 2 * math.prod(shapes[name])
        if size and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for j, names in enumerate(groups):
        file = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        writer = SafetensorsWriter(path / file, {n: ("BF16", shapes[n]) for n in names}, {"format": "pt"})
        for n in sorted(names):
            t = torch.empty(shapes[n], dtype=torch.bfloat16)
            if len(shapes[n]) > 1:
                t.normal_(0, 0.02, generator=g)
            else:
                t.fill_(1.0)  # norms
            writer.write(n, t)
            weight_map[n] = file
        writer.close()
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shapes


def run_step(*args: str) -> dict:
    """One stage in a fresh process: its peak RSS is the stage's, not this script's."""
    r = subprocess.run([sys.executable, "-c", _STEP, *args], capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"{args[0]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--layers", type=int, default=28, help="decoder layers (28: Llama-3.2-3B, 3.2B parameters)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the temporary files go")
    p.add_argument("--no-merge", action="store_true", help="skip merging the rank files back")
    p.add_argument("--json", type=Path, default=RESULTS / "shard_memory.json")
    args = p.parse_args(argv)

    shapes = llama_shapes(args.layers)
    params = sum(math.prod(s) for s in shapes.values())
    source_bytes = 2 * params
    largest = max(2 * math.prod(s) for s in shapes.values())
    embed = 2 * math.prod(shapes["model.embed_tokens.weight"])
    rank_bytes = source_bytes + (args.tp - 1) * (embed + 2 * args.layers * 2 * SHAPE["hidden_size"])  # replicated
    need = source_bytes + rank_bytes + (0 if args.no_merge else source_bytes) + (1 << 30)
    free = shutil.disk_usage(args.dir).free
    if free < need:
        raise SystemExit(f"{args.dir}: {free / 2**30:.1f} GiB free, this run needs {need / 2**30:.1f} GiB; "
                         f"pass --dir on a bigger disk, or fewer --layers")
    root = Path(tempfile.mkdtemp(prefix="infer-shard-bench-", dir=args.dir))
    try:
        src, ranks, merged = root / "src", root / "tp", root / "merged"
        for d in (src, ranks, merged):
            d.mkdir()
        start = time.perf_counter()
        write_checkpoint(src, args.layers)
        write_s = time.perf_counter() - start
        steps = {"shard": run_step("shard", str(src), str(ranks), str(args.tp))}
        written = {"shard": sum(f.stat().st_size for f in ranks.glob("rank*.safetensors"))}
        if not args.no_merge:
            steps["merge"] = run_step("merge", str(ranks), str(merged))
            written["merge"] = (merged / "model.safetensors").stat().st_size
    finally:
        shutil.rmtree(root, ignore_errors=True)

    result = {"benchmark": "shard_memory", "host": host_info(), "tp": args.tp, "layers": args.layers,
              "params": params, "checkpoint_bytes": source_bytes, "largest_tensor_bytes": largest,
              "largest_tensor": max(shapes, key=lambda n: math.prod(shapes[n])), "write_checkpoint_s": round(write_s, 1),
              "steps": {name: {**m, "growth_bytes": m["peak_rss"] - m["base_rss"], "written_bytes": written[name],
                               "growth_over_largest_tensor": round((m["peak_rss"] - m["base_rss"]) / largest, 2),
                               "write_gb_per_s": round(written[name] / m["seconds"] / 1e9, 2)}
                        for name, m in steps.items()}}
    gib = 2**30
    print(f"{params / 1e9:.2f}B parameters, bfloat16, {source_bytes / gib:.1f} GiB; largest tensor "
          f"{result['largest_tensor']} {largest / gib:.2f} GiB; tp={args.tp}; host {result['host']['cpu']} "
          f"(AMX {'yes' if result['host']['amx'] else 'no'})")
    print(f"{'step':<7}{'wall s':>8}{'written GiB':>13}{'base RSS GiB':>14}{'peak RSS GiB':>14}{'growth GiB':>12}"
          f"{'growth/largest':>16}")
    for name, m in result["steps"].items():
        print(f"{name:<7}{m['seconds']:>8.1f}{m['written_bytes'] / gib:>13.2f}{m['base_rss'] / gib:>14.2f}"
              f"{m['peak_rss'] / gib:>14.2f}{m['growth_bytes'] / gib:>12.2f}{m['growth_over_largest_tensor']:>16.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.json}")
    return result


if __name__ == "__main__":
    main()
