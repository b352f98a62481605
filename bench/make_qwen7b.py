"""A Qwen2.5-7B-Instruct-shaped checkpoint with random weights, to measure a real-size build and serve.

No hub here, and none needed: what a 7B build costs (memory, time, disk, the code paths) depends on
the shapes, not on what the weights learned. This writes Qwen2.5-7B-Instruct's config.json (28 layers,
hidden 3584, 28 heads, 4 KV heads, intermediate 18944, vocab 152064, untied LM head, q/k/v biases),
bfloat16 weights (std 0.02, norms 1) in four safetensors shards with an index, as the hub's are, and a
working tokenizer: the embedded SmolLM2 model's byte-level BPE (49,152 ids, all inside the 152,064-row
embedding) with its ChatML template. The one change to the config: bos/eos name that tokenizer's ids.
No quality is claimed on it.

    python -m infer.bench.make_qwen7b /data/qwen7b-random          # ~15.2 GB, a few minutes
    infer-build recipe=qwen7b_awq model.source=/data/qwen7b-random eval.enabled=false

``--layers N`` writes the same shapes with fewer layers (a quick check of the whole path).
Memory: one tensor of at most 545 M values at a time plus one shard's worth being written (~4 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from infer.runtime.artifact import CONFIG, INDEX, TOKENIZER_FILES

QWEN2_5_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
SHARDS = 4


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in the hub's order (embedding, layers, final norm, LM head)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        for name, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            out += [(p + f"self_attn.{name}.weight", (rows, h)), (p + f"self_attn.{name}.bias", (rows,))]
        out += [(p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def write_tokenizer(out: Path, cfg: dict) -> None:
    """The embedded model's tokenizer files (converted from its GGUF), and its ids in the config."""
    from infer.pipeline.gguf_convert import convert_gguf, embedded_gguf_path

    with tempfile.TemporaryDirectory() as tmp:
        convert_gguf(embedded_gguf_path(), tmp)
        for name in TOKENIZER_FILES:  # tokenizer, its config (the chat template), generation config
            if (Path(tmp) / name).is_file():
                shutil.copy(Path(tmp) / name, out / name)
        embedded = json.loads((Path(tmp) / CONFIG).read_text())
    cfg["bos_token_id"], cfg["eos_token_id"] = embedded["bos_token_id"], embedded["eos_token_id"]


def make(out: Path, layers: int | None = None, seed: int = 0) -> dict:
    """Writes the checkpoint into ``out``; returns what was written (bytes, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN2_5_7B_INSTRUCT)
    if layers is not None:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    write_tokenizer(out, cfg)
    (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    shapes = tensor_shapes(cfg)
    total = sum(2 * torch.Size(s).numel() for _, s in shapes)
    per_shard, g, t0 = -(-total // SHARDS), torch.Generator().manual_seed(seed), time.perf_counter()
    weight_map, shard, shard_bytes, written, index = {}, {}, 0, 0, 1

    def flush():
        nonlocal shard, shard_bytes, index
        name = f"model-{index:05d}.partial"  # named model-i-of-n.safetensors once n is known
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        print(f"  shard {index}: {shard_bytes / 1e9:.2f} GB ({written / 1e9:.1f} of {total / 1e9:.1f} GB, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        shard, shard_bytes, index = {}, 0, index + 1

    for name, shape in shapes:
        tensor = random_tensor(name, shape, g)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        written += tensor.numel() * 2
        if shard_bytes >= per_shard and index < SHARDS:
            flush()
    if shard:
        flush()
    files = sorted(set(weight_map.values()))  # SHARDS of them, fewer with --layers
    renamed = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    weight_map = {k: renamed[v] for k, v in weight_map.items()}
    (out / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return {"path": str(out), "bytes": total, "tensors": len(shapes), "layers": cfg["num_hidden_layers"],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the checkpoint directory to write")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than 28, same shapes (a quick check)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(make(args.out, args.layers, args.seed)))


if __name__ == "__main__":
    main()
