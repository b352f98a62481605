"""The merge stage: a checkpoint split over files or ranks in, one canonical HF checkpoint out.

Recognised inputs (``per_rank_layout`` names them):
- ``hf``: an HF directory whose weights are spread over shards (model.safetensors.index.json);
  already loadable as it is, merged here into one ``model.safetensors``;
- ``infer-tp``: this project's per-rank layout (``tensor_parallel.json`` + ``rank{r}.safetensors``,
  defined in pipeline/shard.py): each tensor put back together as its ``split`` says;
- ``trtllm``: TensorRT-LLM's per-rank checkpoint (``config.json`` with ``mapping: {world_size,
  tp_size, pp_size}`` and ``rank{r}.safetensors``, rank = pp_rank * tp_size + tp_rank) for
  ``LlamaForCausalLM`` and Qwen2 (``Qwen2ForCausalLM``, or ``QWenForCausalLM`` with
  ``qwen_type: qwen2``), written as an HF Llama/Qwen2 checkpoint;
- ``megatron``: Megatron torch-distributed checkpoints (``.metadata`` + ``*.distcp``, or
  ``common.pt``) keep their metadata in pickles, and unpickling runs arbitrary code: recognised and
  refused, without unpickling anything (reading them would also need torch.distributed.checkpoint
  plus Megatron's own name and QKV-interleaving conventions, which this project does not
  implement); convert such a checkpoint to HF safetensors with Megatron's tools.

TensorRT-LLM's tensor names and splits (tensorrt_llm/models/llama/convert.py):
``transformer.vocab_embedding.weight`` (replicated, or split along ``embedding_sharding_dim`` when
``use_parallel_embedding``), per layer ``attention.qkv.weight``/``.bias`` (column-parallel: rank r's
q rows, then its k rows, then its v rows; with fewer KV heads than ranks each KV head is duplicated
onto tp/num_kv_heads consecutive ranks), ``attention.dense.weight`` (row-parallel, HF o_proj),
``input_layernorm``/``post_layernorm`` (HF post_attention_layernorm), ``mlp.fc.weight`` and
``mlp.gate.weight`` (column-parallel), ``mlp.proj.weight`` (row-parallel, HF down_proj),
``transformer.ln_f.weight`` and ``lm_head.weight`` (vocab-parallel, padded to a multiple of tp).
Beware the MLP names: TensorRT-LLM's GatedMLP computes ``proj(SiLU(fc(x)) * gate(x))``, so the
SiLU-gated ``mlp.fc`` is HF's ``gate_proj`` and ``mlp.gate`` is HF's ``up_proj``. With pipeline
parallelism each pp stage's files hold its layers (numbered from 0 in older TensorRT-LLM, globally
in newer: both are read), the embedding sits with the first stage and ln_f/lm_head with the last.
Quantized TensorRT-LLM checkpoints (``quantization.quant_algo`` set) are refused: their packing is
TensorRT-LLM's own.

Streaming: every output tensor's name, dtype and shape come from the input headers, so the output
header is written first and each tensor is then assembled from its ranks' slices (read with
``safe_open``/``get_slice``, one file opening per read) and written: peak memory is about one
tensor's ranks, not the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from infer.runtime.artifact import CONFIG, LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, dump_json

from .shard import DTYPES, SafetensorsWriter, ShardError, checkpoint_tensors, read_header, read_tensor
from .stage import copy_carried_files

PER_RANK_KINDS = ("infer-tp", "trtllm")  # the source kinds the build merges before loading
MERGED = "model.safetensors"


class MergeError(ValueError):
    """A checkpoint that cannot be merged; the message names the problem and the fix (sources and
    build re-raise it as their own errors: this module imports neither)."""


def per_rank_layout(path: Path) -> str | None:
    """infer-tp | trtllm | megatron for a directory in one of those layouts, else None."""
    if not path.is_dir():
        return None
    if (path / LAYOUT_FILE).is_file():
        return "infer-tp"
    if any((path / n).exists() for n in (".metadata", "common.pt", "latest_checkpointed_iteration.txt")) or \
            any(path.glob("*.distcp")):
        return "megatron"
    config = path / CONFIG
    if config.is_file() and (path / "rank0.safetensors").is_file():
        try:
            if "mapping" in json.loads(config.read_text()):
                return "trtllm"
        except json.JSONDecodeError:
            return None
    return None


def refuse_pickled(path: Path) -> None:
    """Megatron torch-distributed checkpoints: refused, nothing unpickled (their metadata is pickles)."""
    raise MergeError(f"{path}: a Megatron torch-distributed checkpoint (.metadata/*.distcp/common.pt): its "
                     f"metadata is pickled, and unpickling can execute arbitrary code, so it is refused (and "
                     f"reading one is not supported: it needs torch.distributed.checkpoint and Megatron's QKV "
                     f"layout). Convert it to HF safetensors with Megatron's checkpoint converter on a machine "
                     f"you trust, and build from that directory.")


# An output tensor: its dtype, shape, and how to assemble it (called once, when it is written).
Producer = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


def merge(src: Path, out: Path) -> dict:
    """The merge stage: writes ``src`` (any layout above) as one HF checkpoint in ``out``."""
    src = Path(src)
    kind = per_rank_layout(src)
    if kind == "megatron":
        refuse_pickled(src)
    try:
        if kind == "infer-tp":
            config_bytes, tensors = (src / CONFIG).read_bytes(), _own_tensors(src)
        elif kind == "trtllm":
            config, tensors = _trtllm(src)
            config_bytes = None
        else:
            if not (src / CONFIG).is_file():
                raise MergeError(f"{src}: no config.json; merge reads an HF, infer-tp or TensorRT-LLM checkpoint dir")
            config_bytes, tensors = (src / CONFIG).read_bytes(), _hf_tensors(src)
        writer = SafetensorsWriter(out / MERGED, {n: (d, s) for n, (d, s, _) in tensors.items()}, {"format": "pt"})
        try:
            for name in sorted(tensors):
                writer.write(name, tensors[name][2]())
        finally:
            writer.file.close()
        writer.close()
    except ShardError as e:
        raise MergeError(str(e)) from None
    if config_bytes is not None:
        (out / CONFIG).write_bytes(config_bytes)
    else:
        dump_json(config, out / CONFIG)
    copy_carried_files(src, out)
    return {"layout": kind or "hf", "tensors": len(tensors), "bytes": (out / MERGED).stat().st_size}


# ---------------------------------------------------------------------------- HF shards

def _hf_tensors(src: Path) -> dict[str, Producer]:
    return {name: (info.dtype, info.shape, lambda f=info.file, n=name: read_tensor(f, n))
            for name, info in checkpoint_tensors(src).items()}


# ---------------------------------------------------------------------------- this project's rank files

def _own_tensors(src: Path) -> dict[str, Producer]:
    doc = json.loads((src / LAYOUT_FILE).read_text())
    if doc.get("format") != LAYOUT_FORMAT or doc.get("format_version") != LAYOUT_VERSION:
        raise MergeError(f"{src / LAYOUT_FILE}: format {doc.get('format')!r} version {doc.get('format_version')!r} "
                         f"is not {LAYOUT_FORMAT!r} version {LAYOUT_VERSION}; rebuild it with this infer-build")
    files = [src / f for f in doc["ranks"]]
    if len(files) != doc["tp_size"] or any(not f.is_file() for f in files):
        missing = [f.name for f in files if not f.is_file()]
        raise MergeError(f"{src}: {LAYOUT_FILE} lists {doc['tp_size']} ranks {doc['ranks']}; missing: {missing}")
    headers = []
    for r, f in enumerate(files):
        tensors, meta = read_header(f, metadata=True)
        if (meta.get("tp_rank"), meta.get("tp_size")) != (str(r), str(doc["tp_size"])):
            raise MergeError(f"{f}: its metadata says tp_rank {meta.get('tp_rank')} of {meta.get('tp_size')}, but "
                             f"{LAYOUT_FILE} lists it as rank {r} of {doc['tp_size']}; the rank files are "
                             f"mixed up or from another build")
        headers.append(tensors)
    out: dict[str, Producer] = {}
    for name, t in doc["tensors"].items():
        for r, h in enumerate(headers):
            if h.get(name) != (t["dtype"], tuple(t["local_shapes"][r])):
                raise MergeError(f"{files[r]}: tensor {name} is {h.get(name)}, but {LAYOUT_FILE} says "
                                 f"{t['dtype']} {t['local_shapes'][r]}; the rank files do not belong together")
        out[name] = (t["dtype"], tuple(t["shape"]), lambda n=name, t=t: _assemble(files, n, t))
    extra = sorted(set().union(*headers) - set(doc["tensors"]))
    if extra:
        raise MergeError(f"{src}: rank files hold tensors {LAYOUT_FILE} does not list: {extra[:5]}")
    return out


def _assemble(files: list[Path], name: str, t: dict) -> torch.Tensor:
    split, dim = t["split"], t["dim"]
    if split in ("column", "row", "vocab"):
        return torch.cat([read_tensor(f, name) for f in files], dim)
    if split == "column_parts":  # rank r holds its share of each part ([q_r; k_r; v_r]): each part put back first
        ranks = [read_tensor(f, name).split([p // len(files) for p in t["parts"]], dim) for f in files]
        return torch.cat([r[i] for i in range(len(t["parts"])) for r in ranks], dim)
    first = read_tensor(files[0], name)
    if split == "replicated":
        for f in files[1:]:
            if not torch.equal(read_tensor(f, name), first):
                raise MergeError(f"{f}: replicated tensor {name} differs from rank 0's; the rank files are inconsistent")
        return first
    if split == "shape":
        whole = first.clone()
        whole[dim] = sum(int(read_tensor(f, name)[dim]) for f in files)
        return whole
    raise MergeError(f"{name}: unknown split {split!r} in {LAYOUT_FILE}")


# ---------------------------------------------------------------------------- TensorRT-LLM

_TRT_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_TRT_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.")


def _trtllm(src: Path) -> tuple[dict, dict[str, Producer]]:
    c = json.loads((src / CONFIG).read_text())
    arch = c.get("architecture")
    model_type = _TRT_ARCHS.get(arch) or ("qwen2" if arch == "QWenForCausalLM" and c.get("qwen_type") == "qwen2" else None)
    if model_type is None:
        raise MergeError(f"{src}: TensorRT-LLM architecture {arch!r} is not one this merge knows "
                         f"({', '.join(_TRT_ARCHS)}, QWenForCausalLM with qwen_type qwen2)")
    algo = (c.get("quantization") or {}).get("quant_algo")
    if algo:
        raise MergeError(f"{src}: a quantized TensorRT-LLM checkpoint (quant_algo={algo}) uses TensorRT-LLM's own "
                         f"packing; merge its unquantized checkpoint and quantize with quant.method instead")
    if c.get("position_embedding_type", "rope_gpt_neox") != "rope_gpt_neox":
        raise MergeError(f"{src}: position_embedding_type {c['position_embedding_type']!r}: only rope_gpt_neox "
                         f"(Llama/Qwen2 rotary embeddings) is supported")
    mapping = c["mapping"]
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    world = int(mapping.get("world_size", tp * pp))
    if world != tp * pp:
        raise MergeError(f"{src}: mapping world_size={world} is not tp_size*pp_size={tp * pp}")
    files = [src / f"rank{r}.safetensors" for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise MergeError(f"{src}: mapping says world_size={world}, but rank files are missing: {missing}")
    headers = [read_header(f) for f in files]
    n_layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_size") or hidden // heads
    vocab = c["vocab_size"]
    if heads % tp or (kv % tp and tp % kv):
        raise MergeError(f"{src}: {heads} query / {kv} KV heads do not split over tp_size={tp}")
    q_local, kv_local = heads // tp * head_dim, max(kv // tp, 1) * head_dim
    kv_ranks = list(range(tp)) if kv >= tp else [h * (tp // kv) for h in range(kv)]  # one copy of each KV head

    def stage_file(stage: int, t: int) -> int:
        return stage * tp + t

    layer_of = _pp_layers(src, headers, tp, pp, n_layers)  # global layer -> (pp stage, its local name index)
    out: dict[str, Producer] = {}

    def info(r: int, name: str) -> tuple[str, tuple[int, ...]]:
        if name not in headers[r]:
            raise MergeError(f"{files[r]}: tensor {name} is missing; is this a complete TensorRT-LLM checkpoint?")
        return headers[r][name]

    def cat(name: str, ranks: list[int], dim: int, rows: tuple[int, int] | None = None, trim: int | None = None):
        """An HF tensor from the ranks' tensors ``name``: each rank's ``rows`` (a row range), concatenated
        along ``dim``, cut to ``trim`` rows (vocab padding)."""
        dtype, shape = info(ranks[0], name)
        part = list(shape)
        if rows is not None:
            part[0] = rows[1] - rows[0]
        full = list(part)
        full[dim] = part[dim] * len(ranks)
        if trim is not None:
            full[0] = trim

        def produce():
            pieces = [read_tensor(files[r], name, 0, *rows) if rows else read_tensor(files[r], name) for r in ranks]
            whole = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
            return whole[:trim] if trim is not None else whole

        return dtype, tuple(full), produce

    def whole(name: str, r: int):
        dtype, shape = info(r, name)
        return dtype, shape, lambda: read_tensor(files[r], name)

    first = [stage_file(0, t) for t in range(tp)]
    last = [stage_file(pp - 1, t) for t in range(tp)]
    emb = "transformer.vocab_embedding.weight"
    if c.get("use_parallel_embedding"):
        sharding_dim = int(c.get("embedding_sharding_dim", 0))
        out["model.embed_tokens.weight"] = cat(emb, first, sharding_dim, trim=vocab if sharding_dim == 0 else None)
    else:
        out["model.embed_tokens.weight"] = whole(emb, first[0])
    out["model.norm.weight"] = whole("transformer.ln_f.weight", last[0])
    tied = bool(c.get("tie_word_embeddings", False))
    if not tied:
        out["lm_head.weight"] = cat("lm_head.weight", last, 0, trim=vocab)
    for layer in range(n_layers):
        stage, local = layer_of[layer]
        ranks = [stage_file(stage, t) for t in range(tp)]
        t_, h = f"transformer.layers.{local}.", f"model.layers.{layer}."
        qkv_rows = {"q": (0, q_local), "k": (q_local, q_local + kv_local), "v": (q_local + kv_local, q_local + 2 * kv_local)}
        for p in ("weight", "bias"):
            name = t_ + f"attention.qkv.{p}"
            if name not in headers[ranks[0]]:
                continue
            rows = info(ranks[0], name)[1][0]
            if rows != q_local + 2 * kv_local:
                raise MergeError(f"{files[ranks[0]]}: {name} has {rows} rows, expected {q_local + 2 * kv_local} "
                                 f"({heads}/{tp} query + 2 x {max(kv // tp, 1)} KV heads of {head_dim}): "
                                 f"config.json and the rank files disagree")
            for proj, span in qkv_rows.items():
                src_ranks = ranks if proj == "q" else [ranks[t] for t in kv_ranks]
                out[h + f"self_attn.{proj}_proj.{p}"] = cat(name, src_ranks, 0, rows=span)
        out[h + "self_attn.o_proj.weight"] = cat(t_ + "attention.dense.weight", ranks, 1)
        out[h + "mlp.gate_proj.weight"] = cat(t_ + "mlp.fc.weight", ranks, 0)  # SiLU(fc(x)): HF gate_proj
        out[h + "mlp.up_proj.weight"] = cat(t_ + "mlp.gate.weight", ranks, 0)  # gate(x): HF up_proj
        out[h + "mlp.down_proj.weight"] = cat(t_ + "mlp.proj.weight", ranks, 1)
        for trt, hf, how in (("attention.dense.bias", "self_attn.o_proj.bias", None),
                             ("mlp.fc.bias", "mlp.gate_proj.bias", 0), ("mlp.gate.bias", "mlp.up_proj.bias", 0),
                             ("mlp.proj.bias", "mlp.down_proj.bias", None)):
            if t_ + trt in headers[ranks[0]]:
                out[h + hf] = cat(t_ + trt, ranks, 0) if how == 0 else whole(t_ + trt, ranks[0])
        out[h + "input_layernorm.weight"] = whole(t_ + "input_layernorm.weight", ranks[0])
        out[h + "post_attention_layernorm.weight"] = whole(t_ + "post_layernorm.weight", ranks[0])
    dtype = out["model.embed_tokens.weight"][0]
    return _hf_config(c, model_type, head_dim, tied, dtype, out), out


def _pp_layers(src: Path, headers: list[dict], tp: int, pp: int, n_layers: int) -> dict[int, tuple[int, int]]:
    """global layer -> (pp stage, the index its tensor names use), for local or global numbering."""
    per_stage = [sorted({int(m.group(1)) for n in headers[s * tp] if (m := _TRT_LAYER.match(n))}) for s in range(pp)]
    flat = [i for ids in per_stage for i in ids]
    if sorted(flat) == list(range(n_layers)) and len(flat) == n_layers:  # global numbering (or pp=1)
        return {i: (s, i) for s, ids in enumerate(per_stage) for i in ids}
    if all(ids == list(range(len(ids))) for ids in per_stage) and len(flat) == n_layers:  # numbered per stage
        out, base = {}, 0
        for s, ids in enumerate(per_stage):
            out.update({base + i: (s, i) for i in ids})
            base += len(ids)
        return out
    raise MergeError(f"{src}: the pp stages' rank files hold layers {per_stage}, which do not make up "
                     f"num_hidden_layers={n_layers}")


def _hf_config(c: dict, model_type: str, head_dim: int, tied: bool, dtype: str, tensors: dict) -> dict:
    """An HF config for the merged checkpoint; rope_theta at top level (and in rope_parameters), since
    readers that miss it fall back to 10000 and silently compute nonsense."""
    theta = float(c.get("rotary_base", 10000.0))
    torch_dtype = str(DTYPES[dtype]).removeprefix("torch.")
    config = {
        "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
        "model_type": model_type,
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "head_dim": head_dim, "vocab_size": c["vocab_size"],
        "max_position_embeddings": c.get("max_position_embeddings", 2048),
        "rms_norm_eps": c.get("norm_epsilon", 1e-6), "hidden_act": c.get("hidden_act", "silu"),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied, "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }
    scaling = c.get("rotary_scaling")
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        config["rope_scaling"] = {**scaling, "rope_type": kind}
        config["rope_parameters"] = {**scaling, "rope_type": kind, "rope_theta": theta}
    if model_type == "llama":
        config["attention_bias"] = any(n.endswith("self_attn.q_proj.bias") for n in tensors)
        config["mlp_bias"] = any(n.endswith("mlp.gate_proj.bias") for n in tensors)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in c:
            config[key] = c[key]
    return config


