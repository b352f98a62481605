"""The shard stage: one HF checkpoint of a family in ``SHARDABLE`` in, ``parallel.tp`` per-rank checkpoints out.

Runs after quantize (``parallel.tp > 1``; tp=1 is no stage), so quantized layers are split on
their group boundaries instead of being re-quantized per rank.

The layout (the artifact contract for tensor-parallel artifacts, format version 1)
-----------------------------------------------------------------------------------
A sharded checkpoint directory holds:

- ``config.json``: the full model's HF config, byte for byte as the unsharded checkpoint had it
  (sizes are the whole model's; quantization_config unchanged);
- ``tensor_parallel.json`` (canonical JSON: sorted keys, indent 2)::

      {"format": "infer-tensor-parallel", "format_version": 1, "tp_size": N,
       "ranks": ["rank0.safetensors", ..., "rank{N-1}.safetensors"],
       "tensors": {HF name: {"split": "column" | "row" | "vocab" | "replicated" | "shape",
                             "dim": int | null, "dtype": safetensors dtype ("BF16", "I32", ...),
                             "shape": [the whole tensor's shape],
                             "local_shapes": [[rank 0's shape], ..., [rank N-1's shape]]}}}

- ``rank{r}.safetensors`` for r in 0..N-1: every tensor named in ``tensors``, under its HF name,
  holding rank r's part; metadata ``{"format": "pt", "tp_rank": "r", "tp_size": "N"}``; tensors in
  name order; no other tensors. Each rank file alone is all one worker needs;
- the tokenizer files of the source (tokenizer.json, tokenizer_config.json, ...).

``split`` says what rank r holds:
- ``column``, ``row``, ``vocab``: the contiguous chunk r along ``dim`` (chunks in rank order; their
  sizes are ``local_shapes[r][dim]``). ``column`` and ``row`` chunks are equal; ``vocab`` chunks
  may differ by one row (the first ``V % N`` ranks get one more);
- ``column_parts``: a linear the checkpoint stores fused (Phi-3's ``qkv_proj`` = [q; k; v] and
  ``gate_up_proj`` = [gate; up]): ``parts`` are its parts' sizes along ``dim`` (0), and rank r holds
  chunk r of each part, concatenated in part order ([q_r; k_r; v_r]): the fused linear of its own
  heads, which is what the runtime loads for a rank. Merging puts each part back together first;
- ``replicated``: the whole tensor, identical in every rank;
- ``shape``: a compressed-tensors ``weight_shape`` ([2] integers): rank r holds the [out, in] of
  its own slice of that linear; ``dim`` is the linear's split dim (0 column, 1 row), and the whole
  value is rank 0's with entry ``dim`` replaced by the sum over ranks.

What is split how, and why (Megatron's scheme, the one vLLM and TensorRT-LLM use):
- q/k/v (weights and biases) and gate/up, fused or not, are **column**-parallel (dim 0, the output features):
  HF stores heads contiguously, so equal chunks give each rank num_attention_heads/N query heads
  and num_key_value_heads/N KV heads (whole GQA groups: rank r's queries use only rank r's KV
  heads), and intermediate_size/N MLP channels. A rank runs attention and SiLU(gate)*up on its
  own heads/channels with no communication.
- o_proj and down_proj are **row**-parallel (dim 1, the input features): each rank multiplies its
  own slice of the activations, and the sum over ranks (one all-reduce per block) is the output.
  A row-parallel bias (Llama's attention_bias / mlp_bias, Qwen3's attention_bias) is replicated and
  must be added once (runtime/parallel/layers.py).
- RMSNorm weights are replicated, Gemma 2's and 3's sandwich norms (pre/post_feedforward_layernorm) too,
  and Qwen3's and Gemma 3's per-head q/k norms (they are [head_dim], the same for every head). A partial rotary
  (Phi-4-mini) needs nothing here: the runtime reorders each head's q/k dims at load, per head, so
  a rank's whole heads reorder alike.
- Embedding and LM head are **replicated** (``vocab_parallel=True`` gives ``vocab`` splits, kept for
  GPU-sized vocabularies). Why: the token embedding is a row lookup, which vocab-parallel would
  turn into a masked lookup plus an all-reduce of [tokens, hidden] every step; and the sampler
  (top-p, penalties, logprobs) needs the full distribution on one rank, so a vocab-parallel LM head
  costs an all-gather of [batch, vocab] logits every step: for SmolLM2's tied 49152x576 table on a
  2-rank CPU that is 196 KB per sequence per step (12.6 MB at batch 64) through the process group,
  about what rank 0 reading the 56 MB bfloat16 table itself costs, while replicating costs 56 MB
  of RAM per rank and no communication. Tied weights stay one tensor. (For Qwen2.5-7B the
  replicated embedding + head are 2.2 GB bfloat16 per rank: still cheap in CPU RAM; on GPUs use
  vocab_parallel.)

Quantized (compressed-tensors) linears are split on their packing and group boundaries:
``weight_packed`` [N, K*bits/32] and int8/fp8 ``weight`` split like the float weight; column-parallel
splits the rows of ``weight_scale`` [N, G] and of the packed zero points [N*bits/32, G] (so
N/tp, and each fused part's size / tp, must fill whole int32 words: a multiple of 8 for 4-bit);
row-parallel splits K, which must stay a multiple of the group size and fill whole words, and
splits the scales' groups (dim 1).
Per-channel ([N, 1]) and per-tensor scales are replicated under row parallelism, and
``input_scale`` always is. Activation order (``weight_g_idx``): column-parallel replicates g_idx;
row-parallel slices g_idx (its global group numbers kept) and replicates that layer's scales and
zero points, since a rank's columns then draw on any group (vLLM does the same for act-order GPTQ).

Streaming: every tensor's name, dtype and shape come from the safetensors headers (read by the
safetensors library, which refuses a file its header does not account for exactly), so each rank
file's header is written first and then each tensor's slices in name order, read one at a time
through ``safe_open``/``get_slice`` (a file is opened per read, so no memory map outlives one
tensor): peak memory is about one tensor, not N model copies. Same input, same bytes.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from infer.runtime.artifact import CONFIG, INDEX, LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, dump_json

from .stage import copy_carried_files

SPLITS = ("column", "column_parts", "row", "vocab", "replicated", "shape")
# the families (runtime/model/families.py) whose tensors plan() has a rule for
# (checked at tp=2 against transformers, tests/test_families_quant.py); any other family the runtime serves is
# refused by name before any stage
SHARDABLE = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text")

# safetensors dtype codes and their torch dtypes (bytes per element: the dtype's itemsize)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
DTYPE_CODES = {t: code for code, t in DTYPES.items()}


class ShardError(ValueError):
    """A checkpoint that cannot be sharded this way; the message names the value and the fix."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


# ---------------------------------------------------------------------------- reading and writing safetensors

@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]


def read_header(file: Path, metadata: bool = False):
    """{name: (dtype, shape)} of a safetensors file, from its header alone (and, with ``metadata``,
    its ``__metadata__`` too). The safetensors library refuses a file its header does not account
    for exactly (truncated, extended, a damaged header, a tensor's bytes not its dtype x shape)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise ShardError(f"{file}: corrupt or unreadable safetensors file ({e}); re-download or re-export it") from None
    return (tensors, meta) if metadata else tensors


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor's data in a safetensors file."""
    return DTYPES[dtype].itemsize * math.prod(shape)


def checkpoint_tensors(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of an HF safetensors checkpoint (model.safetensors or the index's shards)."""
    index = directory / INDEX
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ShardError(f"{directory}: no safetensors weights to shard")
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, (dtype, shape) in read_header(file).items():
            if name in out:
                raise ShardError(f"{directory}: tensor {name} is in both {out[name].file.name} and {file.name}")
            out[name] = TensorInfo(file, dtype, shape)
    return out


def read_tensor(file: Path, name: str, dim: int | None = None, begin: int = 0, end: int | None = None) -> torch.Tensor:
    """One tensor, or its [begin, end) chunk along ``dim``; the file is opened for this read only, so
    its memory map is released with the returned tensor."""
    try:
        with safe_open(str(file), framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            return f.get_slice(name)[(slice(None),) * dim + (slice(begin, end),)]
    except (SafetensorError, OSError) as e:
        raise ShardError(f"{file}: cannot read tensor {name} ({e}); re-export the checkpoint") from None


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor: the header (every name, dtype and shape, known
    up front) first, then each tensor's bytes in name order, so one tensor at a time is in memory.
    Canonical: sorted names, compact sorted-key JSON header padded to 8 bytes, fixed metadata."""

    def __init__(self, path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]):
        self.path, self.order, self.specs, self.next = path, sorted(tensors), dict(tensors), 0
        header: dict = {"__metadata__": dict(metadata)}
        offset = 0
        for name in self.order:
            dtype, shape = tensors[name]
            if dtype not in DTYPES:
                raise ShardError(f"{name}: safetensors dtype {dtype} is not one this writer knows ({', '.join(DTYPES)})")
            size = tensor_bytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - written across write() calls, closed by close()
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.next] if self.next < len(self.order) else None
        dtype, shape = self.specs.get(name, (None, None))
        if name != expected or DTYPE_CODES.get(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path.name}: got {name} {tensor.dtype} {list(tensor.shape)}, "
                             f"expected {expected} {self.specs.get(expected)}")
        self.file.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.order):
            raise ValueError(f"{self.path.name}: {len(self.order) - self.next} tensors were never written")


# ---------------------------------------------------------------------------- the plan: which tensor splits how

@dataclass(frozen=True)
class Split:
    kind: str  # one of SPLITS
    dim: int | None
    sizes: tuple[int, ...] | None = None  # chunk sizes along dim (column/row/vocab)
    parts: tuple[int, ...] | None = None  # column_parts: the fused parts' sizes along dim, each split equally

    def bounds(self, rank: int) -> list[tuple[int, int]]:
        """The [begin, end) ranges along dim that rank ``rank`` holds, in order."""
        if self.kind == "column_parts":
            tp, starts = len(self.sizes), [sum(self.parts[:i]) for i in range(len(self.parts))]
            return [(s + rank * p // tp, s + (rank + 1) * p // tp) for s, p in zip(starts, self.parts)]
        begin = sum(self.sizes[:rank])
        return [(begin, begin + self.sizes[rank])]

    def local_shape(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        if self.kind in ("replicated", "shape"):
            return shape
        return shape[:self.dim] + (self.sizes[rank],) + shape[self.dim + 1:]


def _equal(size: int, tp: int) -> tuple[int, ...]:
    return (size // tp,) * tp


def _uneven(size: int, tp: int) -> tuple[int, ...]:
    q, r = divmod(size, tp)
    return (q + 1,) * r + (q,) * (tp - r)


def valid_tp(config: dict) -> list[int]:
    """The tensor-parallel sizes this model's heads and MLP divide into (up to its KV heads)."""
    sizes = [config["num_attention_heads"], _kv_heads(config), config["intermediate_size"]]
    return [t for t in range(1, _kv_heads(config) + 1) if all(s % t == 0 for s in sizes)]


def _kv_heads(config: dict) -> int:
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def check_tp(config: dict, tp: int, group_size: int | None = None) -> None:
    """Fails before any work when the model cannot be split into ``tp`` ranks of whole heads (and,
    given the quantization group size it is about to be quantized with, of whole groups)."""
    arch = (config.get("architectures") or ["?"])[0]
    # tp=1 splits nothing: every family the runtime serves builds at tp=1
    if tp > 1 and config.get("model_type") not in SHARDABLE:
        raise ShardError(f"parallel.tp={tp}: sharding knows model_type {', '.join(SHARDABLE)}, not {arch} "
                         f"(model_type {config.get('model_type')!r}); build it with parallel.tp=1")
    for key, value, why in (("num_attention_heads", config["num_attention_heads"], "each rank needs whole query heads"),
                            ("num_key_value_heads", _kv_heads(config), "each rank needs whole KV heads"),
                            ("intermediate_size", config["intermediate_size"], "each rank needs an equal MLP slice")):
        if value % tp:
            raise ShardError(f"parallel.tp={tp}: {key}={value} is not divisible by {tp} ({why}); use a "
                             f"parallel.tp that divides num_attention_heads, num_key_value_heads and "
                             f"intermediate_size: {valid_tp(config)}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for layer, k in (("self_attn.o_proj", config["num_attention_heads"] * head_dim),
                     ("mlp.down_proj", config["intermediate_size"])):
        if group_size and (k // tp) % group_size:
            raise ShardError(_group_error(f"model.layers.*.{layer}", k, tp, group_size))


_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.(\w+)$")
_NORM = re.compile(r"^model\.(layers\.\d+\.((input|post_attention|pre_feedforward|post_feedforward)_layernorm|"
                   r"self_attn\.[qk]_norm)|norm)\.weight$")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.(\w+)$")
_ROW_MODULES = ("o", "down")


def plan(config: dict, tensors: dict[str, TensorInfo], tp: int, vocab_parallel: bool = False) -> dict[str, Split]:
    """How each tensor is split across ``tp`` ranks; raises ShardError naming the layer and the fix."""
    check_tp(config, tp)
    out: dict[str, Split] = {}
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        if _NORM.match(name) or name.endswith("rotary_emb.inv_freq"):
            out[name] = Split("replicated", None)
        elif m := _VOCAB.match(name):
            if not vocab_parallel:
                out[name] = Split("replicated", None)
            elif m.group(2) == "weight" and info.dtype in ("F32", "BF16", "F16"):
                out[name] = Split("vocab", 0, _uneven(info.shape[0], tp))
            else:
                raise ShardError(f"{name}: a vocab-parallel {m.group(1)} must be a float weight; shard with the "
                                 f"embedding and LM head replicated (vocab_parallel=False)")
        elif m := _LAYER.match(name):
            modules.setdefault(name.rsplit(".", 1)[0], {})[m.group(4)] = info
        else:
            raise ShardError(f"{name}: no tensor-parallel rule for this tensor (sharding knows the attention, MLP, "
                             f"norm and embedding tensors of {', '.join(SHARDABLE)}); build with parallel.tp=1")
    fused = _fused_parts(config)
    for module, parts in modules.items():
        kind = module.rsplit(".", 1)[1]
        row = kind.split("_")[0] in _ROW_MODULES
        for suffix, split in _linear_plan(module, parts, tp, row, fused.get(kind)).items():
            out[f"{module}.{suffix}"] = split
    return out


def _fused_parts(config: dict) -> dict[str, tuple[int, ...]]:
    """The output sizes of the parts of the linears a checkpoint stores fused (Phi-3's)."""
    heads, kv = config["num_attention_heads"], _kv_heads(config)
    d = config.get("head_dim") or config["hidden_size"] // heads
    inter = config["intermediate_size"]
    return {"qkv_proj": (heads * d, kv * d, kv * d), "gate_up_proj": (inter, inter)}


def _linear_plan(module: str, parts: dict[str, TensorInfo], tp: int, row: bool,
                 fused: tuple[int, ...] | None = None) -> dict[str, Split]:
    """One linear's tensors (float, or compressed-tensors pack/int/float-quantized) split on whole
    int32 words and whole quantization groups. ``fused``: the output sizes of the parts of a linear
    the checkpoint stores fused (each part is split on its own: column_parts)."""
    kind = "row" if row else "column"
    if "weight_packed" in parts:
        if "weight_shape" not in parts:
            raise ShardError(f"{module}: weight_packed without weight_shape; re-export the quantized checkpoint")
        n, k = (int(v) for v in read_tensor(parts["weight_shape"].file, f"{module}.weight_shape").tolist())
        words = parts["weight_packed"].shape[1]
        bits = words * 32 // k if (words * 32) % k == 0 else None
        if bits is None or not 1 <= bits <= 8:
            raise ShardError(f"{module}: cannot tell the bit width of weight_packed {list(parts['weight_packed'].shape)} "
                             f"for in_features {k}")
    elif "weight" in parts and len(parts["weight"].shape) == 2:
        (n, k), bits = parts["weight"].shape, None
    else:
        raise ShardError(f"{module}: no 2-D weight or weight_packed; cannot shard it")
    split_size = k if row else n
    if fused is not None and sum(fused) != n:
        raise ShardError(f"{module}: {n} output features, but config.json's heads and intermediate_size make its "
                         f"parts {list(fused)} (sum {sum(fused)}); the checkpoint does not match its config.json")
    fused = fused if fused is not None and not row else None
    bad = [p for p in fused or () if p % tp]
    if bad:
        raise ShardError(f"{module}: a fused part of {bad[0]} output features is not divisible by tp={tp}; use a "
                         f"parallel.tp that divides num_attention_heads, num_key_value_heads and intermediate_size")
    if split_size % tp:
        raise ShardError(f"{module}: {'in' if row else 'out'}_features={split_size} is not divisible by tp={tp}; "
                         f"use a parallel.tp that divides it")
    local = split_size // tp
    per_word = 32 // math.gcd(32, bits) if bits else 1  # values that fill whole int32 words
    act_order = "weight_g_idx" in parts
    dim = 1 if row else 0
    plan: dict[str, Split] = {}
    for suffix, info in parts.items():
        shape = info.shape
        if suffix in ("weight", "weight_packed"):
            if suffix == "weight_packed" and row and local % per_word:
                raise ShardError(_words_error(module, "in", k, tp, local, per_word, bits))
            plan[suffix] = _column(shape[0], tp, fused) if not row else Split(kind, dim, _equal(shape[dim], tp))
        elif suffix == "bias":
            plan[suffix] = Split("replicated", None) if row else _column(shape[0], tp, fused)
        elif suffix in ("weight_scale", "weight_zero_point"):
            plan[suffix] = _scale_plan(module, suffix, info, n, k, tp, row, bits, per_word, act_order, fused)
        elif suffix == "weight_g_idx":
            plan[suffix] = Split("row", 0, _equal(k, tp)) if row else Split("replicated", None)
        elif suffix == "weight_shape":
            plan[suffix] = Split("shape", dim)
        elif suffix in ("input_scale", "input_zero_point", "weight_global_scale", "input_global_scale"):
            plan[suffix] = Split("replicated", None)
        else:
            raise ShardError(f"{module}.{suffix}: unknown quantization tensor; build with parallel.tp=1")
    return plan


def _column(rows: int, tp: int, fused: tuple[int, ...] | None, per_row: int = 1) -> Split:
    """A column split of ``rows`` rows; of each fused part on its own where the linear is fused
    (``per_row``: output features per stored row, 8 for 4-bit zero points packed along the output)."""
    if fused is None:
        return Split("column", 0, _equal(rows, tp))
    return Split("column_parts", 0, _equal(rows, tp), tuple(p // per_row for p in fused))


def _scale_plan(module, suffix, info, n, k, tp, row, bits, per_word, act_order, fused=None) -> Split:
    shape = info.shape
    if math.prod(shape) <= 1:  # per-tensor
        return Split("replicated", None)
    packed = suffix == "weight_zero_point" and info.dtype == "I32" and bits is not None
    if not row:
        for size in fused or (n,):
            if packed and (size // tp) % per_word:
                raise ShardError(_words_error(module, "out", size, tp, size // tp, per_word, bits,
                                              "zero points are packed along the output dim"))
        return _column(shape[0], tp, fused, per_word if packed else 1)
    if len(shape) == 1 or shape[1] == 1 or act_order:  # per channel, or act-order groups any rank may use
        return Split("replicated", None)
    groups = shape[1]
    if (k // tp) % (k // groups):
        raise ShardError(_group_error(module, k, tp, k // groups))
    return Split("row", 1, _equal(groups, tp))


def _group_error(module: str, k: int, tp: int, group_size: int) -> str:
    choices = [t for t in range(1, k // group_size + 1) if k % (t * group_size) == 0]
    return (f"{module}: in_features {k} / tp {tp} = {k // tp} is not a multiple of the quantization group size "
            f"{group_size}, so a rank would hold part of a group; use a parallel.tp in {choices}, or quantize "
            f"with a quant.group_size that divides {k // tp}")


def _words_error(module, side, size, tp, local, per_word, bits, why="int32 packing") -> str:
    return (f"{module}: {side}_features {size} / tp {tp} = {local} is not a multiple of {per_word} ({bits}-bit values "
            f"fill whole int32 words: {why}); use a parallel.tp that keeps {size}/tp a multiple of {per_word}")


def layout(tensors: dict[str, TensorInfo], splits: dict[str, Split], tp: int) -> dict:
    """The content of tensor_parallel.json."""
    def entry(name: str, s: Split) -> dict:
        out = {"split": s.kind, "dim": s.dim, "dtype": tensors[name].dtype, "shape": list(tensors[name].shape),
               "local_shapes": [list(s.local_shape(tensors[name].shape, r)) for r in range(tp)]}
        return out if s.parts is None else {**out, "parts": list(s.parts)}

    return {"format": LAYOUT_FORMAT, "format_version": LAYOUT_VERSION, "tp_size": tp,
            "ranks": [rank_file(r) for r in range(tp)],
            "tensors": {name: entry(name, s) for name, s in sorted(splits.items())}}


# ---------------------------------------------------------------------------- the stage

def shard(checkpoint: Path, out: Path, tp: int, vocab_parallel: bool = False) -> dict:
    """The shard stage: writes ``checkpoint`` (an HF directory) as ``tp`` rank files in ``out``."""
    config = json.loads((checkpoint / CONFIG).read_text())
    tensors = checkpoint_tensors(checkpoint)
    splits = plan(config, tensors, tp, vocab_parallel)
    writers = [SafetensorsWriter(out / rank_file(r),
                                 {n: (tensors[n].dtype, s.local_shape(tensors[n].shape, r)) for n, s in splits.items()},
                                 {"format": "pt", "tp_rank": str(r), "tp_size": str(tp)}) for r in range(tp)]
    try:
        for name in sorted(splits):
            s, info = splits[name], tensors[name]
            if s.kind == "replicated":
                whole = read_tensor(info.file, name)
                for w in writers:
                    w.write(name, whole)
                del whole
            elif s.kind == "shape":
                whole = read_tensor(info.file, name)
                for r, w in enumerate(writers):
                    local = whole.clone()
                    local[s.dim] = int(whole[s.dim]) // tp
                    w.write(name, local)
            else:
                for r, w in enumerate(writers):
                    chunks = [read_tensor(info.file, name, s.dim, begin, end) for begin, end in s.bounds(r)]
                    w.write(name, chunks[0] if len(chunks) == 1 else torch.cat(chunks, s.dim))
    finally:
        for w in writers:
            w.file.close()
    for w in writers:
        w.close()
    shutil.copyfile(checkpoint / CONFIG, out / CONFIG)
    copy_carried_files(checkpoint, out)
    doc = layout(tensors, splits, tp)
    dump_json(doc, out / LAYOUT_FILE)
    kinds = sorted({s.kind for s in splits.values()})
    return {"tp": tp, "tensors": len(splits), "splits": {k: sum(s.kind == k for s in splits.values()) for k in kinds},
            "rank_bytes": [(out / rank_file(r)).stat().st_size for r in range(tp)]}
