"""GGUF conversion of the families llama.cpp writes besides byte-level Llama/Qwen: SentencePiece Llama (Llama 2,
Mistral), Phi-3, Gemma, Gemma 2 and Gemma 3 (text), and the byte-level split rules of Llama 3, Mistral Nemo and
Phi-4-mini.

Each test takes a small random Hugging Face model, writes it into a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does for that architecture (its tensor names, metadata keys, q/k permutation for llama,
1 + weight norms for Gemma), converts the file back with infer.pipeline.gguf_convert and checks the weights
against the original model and against transformers' own GGUF loading, the logits of the runtime against
transformers on the converted checkpoint, and the token ids against transformers' GGUF tokenizer.
"""

import json
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file
from tokenizers import SentencePieceBPETokenizer, Tokenizer
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig,
                          Phi3Config)

from infer.pipeline.gguf_convert import convert_gguf

SPACE = "\u2581"
# transformers' SDPA attention leaves out Gemma 2's attention soft-cap; its eager attention applies it
EAGER = "eager"
TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces,   three and\ttab",
    "naïve café — 東京 🙂",
    "Version 3, 29 June 2007 costs $1234.56",
    "line one\nline two\n\nend ",
    "the Program </s> and <s> inside",
]


@pytest.fixture(scope="module")
def vocab():
    """A SentencePiece-style BPE vocabulary as llama.cpp stores one: <unk>, <s>, </s>, the 256 byte tokens, pieces
    scored by merge rank, then single characters (no newline or tab: those fall back to bytes)."""
    trainer = SentencePieceBPETokenizer()
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    trainer.train_from_iterator([text], vocab_size=600, min_frequency=2, show_progress=False)
    model = json.loads(trainer.to_str())["model"]
    merges = [" ".join(pair) for pair in model["merges"] if not set("\n\t") & set("".join(pair))]
    pieces = [m.replace(" ", "") for m in merges] + [SPACE * 2, SPACE * 4]
    chars = [c for c in model["vocab"] if len(c) == 1 and c not in "\n\t" and c != "<unk>"]
    tokens = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("<|user|>", -1000.0, 4)]
    tokens += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    seen = {t for t, _, _ in tokens}
    for piece in pieces + chars:
        if piece not in seen:
            seen.add(piece)
            tokens.append((piece, -float(len(tokens)), 1))
    tokens.append(("<end_of_turn>", 0.0, 3))  # the end-of-turn token, last (llama.cpp's eot_token_id)
    return tokens, merges + [f"{SPACE} {SPACE}", f"{SPACE * 2} {SPACE * 2}"]


def _hf_model(arch: str, vocab_size: int, longrope: bool = False) -> torch.nn.Module:
    """A small random model; norms away from their resting value, attention and final logits large enough that
    Gemma 2's soft-caps and the sliding window change the result."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if arch == "llama":
        config = LlamaConfig(**common, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                             tie_word_embeddings=False)
    elif arch == "phi3":
        # Phi-4-mini's partial rotary (12 of 16 dimensions) and Phi-3-mini's sliding window; with longrope
        # (Phi-3.5-mini, Phi-4-mini) a context 8 times the original one, rescaled per frequency
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        if longrope:
            rope |= {"rope_type": "longrope", "short_factor": (1 + torch.rand(6)).tolist(),
                     "long_factor": (1 + 4 * torch.rand(6)).tolist()}
        config = Phi3Config(**common, rope_parameters=rope, sliding_window=None if longrope else 10,
                            original_max_position_embeddings=16 if longrope else 128, tie_word_embeddings=False)
    elif arch == "gemma":
        config = GemmaConfig(**common, head_dim=32, hidden_activation="gelu_pytorch_tanh")
    elif arch == "gemma3":
        # six layers: llama.cpp's Gemma 3 lets every sixth attend in full; linear rope scaling on those (4B and up)
        rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        config = Gemma3TextConfig(**common | {"num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32,
                                  sliding_window=10, rope_parameters=rope)
    else:
        config = Gemma2Config(**common, head_dim=32, query_pre_attn_scalar=32, sliding_window=10,
                              attn_logit_softcapping=2.0, final_logit_softcapping=10.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=EAGER).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset = 1.0 if name.endswith("norm.weight") and not arch.startswith("gemma") else 0.0
            param.copy_(torch.randn_like(param) * (0.3 if "embed" in name else 0.15) + offset)
    return model


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _write_tokenizer(writer: GGUFWriter, vocab, arch: str, merges: bool) -> None:
    tokens, merge_list = vocab
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _, _ in tokens])
    writer.add_token_scores([s for _, s, _ in tokens])
    writer.add_token_types([k for _, _, k in tokens])
    if merges:
        writer.add_token_merges(merge_list)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_eot_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if arch.startswith("gemma"):
        writer.add_add_space_prefix(False)  # llama.cpp writes this for every Gemma


def _write_gguf(path, arch: str, model, vocab, merges: bool = False, name: str | None = None) -> None:
    """Write model into path as llama.cpp's convert_hf_to_gguf.py does for arch (float32 tensors)."""
    c = model.config
    writer = GGUFWriter(path, arch)
    if name:
        writer.add_name(name)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    elif arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * c.hidden_size)
                                        // c.num_attention_heads)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_sliding_window(c.sliding_window or 0)
        if c.rope_parameters["rope_type"] == "longrope":  # as llama.cpp's Phi3MiniModel.generate_extra_tensors
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
                c.original_max_position_embeddings)))
            writer.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], np.float32))
    else:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
            writer.add_sliding_window(c.sliding_window)
        if arch == "gemma3":
            writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
            writer.add_sliding_window(c.sliding_window)
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    _write_tokenizer(writer, vocab, arch, merges)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied checkpoint has no lm_head tensor to write
        data = tensor.numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            data = _permute(data, c.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma stores 1 + weight
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference_tokenizer(tmp_path, arch: str, vocab, merges: bool):
    """transformers' GGUF tokenizer for this metadata. It reads Phi-3's without a normalizer (it drops every
    space) and has no reading for Gemma 1: those two are compared with the same tokenizer metadata in a llama
    or gemma2 file, which transformers reads as the SentencePiece tokenizer Phi-3 and Gemma ship."""
    if arch in ("llama", "gemma2", "gemma3"):
        return AutoTokenizer.from_pretrained(tmp_path, gguf_file=f"{arch}.gguf")
    other = "gemma2" if arch == "gemma" else "llama"
    writer = GGUFWriter(tmp_path / "tokenizer.gguf", other)
    writer.add_block_count(1)
    _write_tokenizer(writer, vocab, arch, merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return AutoTokenizer.from_pretrained(tmp_path, gguf_file="tokenizer.gguf")


CASES = {
    # arch: (HF class, config keys the conversion must state, whether transformers loads this GGUF architecture)
    "llama": ("LlamaForCausalLM", {"tie_word_embeddings": False, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}}, True),
    "phi3": ("Phi3ForCausalLM", {"sliding_window": 10, "original_max_position_embeddings": 128}, True),
    "gemma": ("GemmaForCausalLM", {"head_dim": 32, "tie_word_embeddings": True, "hidden_activation":
                                   "gelu_pytorch_tanh"}, False),
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 32, "sliding_window": 10, "attn_logit_softcapping": 2.0,
                                     "final_logit_softcapping": 10.0, "query_pre_attn_scalar": 32,
                                     "layer_types": ["sliding_attention", "full_attention"]}, True),
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 32, "sliding_window": 10, "query_pre_attn_scalar": 32,
                                     "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                                     "final_logit_softcapping": None}, True),
}


@pytest.mark.parametrize("arch,merges", [("llama", False), ("llama", True), ("phi3", False), ("gemma", False),
                                         ("gemma2", False), ("gemma3", False)])
def test_family_matches_transformers(tmp_path, vocab, arch, merges):
    cls, keys, transformers_reads = CASES[arch]
    model = _hf_model(arch, len(vocab[0]))
    _write_gguf(tmp_path / f"{arch}.gguf", arch, model, vocab, merges)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / f"{arch}.gguf", out)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch.replace("gemma3", "gemma3_text") and config["architectures"] == [cls]
    for key, value in keys.items():
        assert config[key] == value, key
    if arch == "phi3":
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.75
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, len(vocab[0]) - 1], "pad_token_id": None}
    from infer.runtime.engine.tokenizer import Tokenizer as ServingTokenizer

    assert ServingTokenizer(out).eos_token_ids == (2, len(vocab[0]) - 1)  # the server stops at either

    # weights: the original model's (Gemma's norms through float32's 1 + w and back), and transformers' GGUF reading
    ours = load_file(out / "model.safetensors")
    original = model.state_dict()
    assert set(ours) == set(original) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.allclose(tensor, original[name], rtol=0, atol=1.2e-7 if "norm" in name else 0), name
    if transformers_reads:
        # (Phi3Config's default pad_token_id, 32000, lies outside a small vocabulary)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{arch}.gguf", dtype=torch.float32,
                                                      pad_token_id=None).state_dict()
        assert set(ours) <= set(theirs)
        for name, tensor in ours.items():
            assert torch.equal(tensor, theirs[name]), name

    # logits: transformers on the converted checkpoint equals the original model, the runtime equals transformers
    from infer.runtime.model import load_model

    ids = torch.randint(3, config["vocab_size"], (1, 24))
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=EAGER).eval()
    with torch.no_grad():
        want = converted(ids).logits
        assert torch.allclose(want, model(ids).logits, rtol=0, atol=1e-5)
    got = load_model(out, dtype=torch.float32, kernels="torch").logits(ids)
    error = (got - want).abs().max().item()
    print(f"{arch}: runtime vs transformers max |logit error| {error:.2e} (logits up to {want.abs().max():.2f})")
    assert error < 1e-4 * max(1.0, want.abs().max().item()), error

    # token ids: transformers' GGUF tokenizer's, with the BOS the file asks for (transformers' leaves it out)
    reference = _reference_tokenizer(tmp_path, arch, vocab, merges)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    fast = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        want_ids = reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=False).ids == want_ids, text
        assert tokenizer.encode(text).ids == [1] + want_ids, text
        assert fast(text)["input_ids"] == [1] + want_ids, text
        assert fast.decode(want_ids) == reference.decode(want_ids), text
    assert any(4 <= i < 260 for text in TEXTS for i in tokenizer.encode(text).ids)  # byte fallback was exercised
    # a user-defined token (Phi-3's <|user|>) is matched whole, as llama.cpp and the original tokenizer match it
    # (transformers' GGUF reading spells it out in pieces)
    ids = tokenizer.encode("<|user|>Hi", add_special_tokens=False).ids
    assert ids[0] == 3 and ids[1:] == reference("Hi", add_special_tokens=False)["input_ids"]
    assert fast.decode(ids) == reference.decode(ids) and fast.decode(ids).startswith("<|user|>")


def _tiny_file(path, arch="llama", tokenizer="llama", tensors=("token_embd.weight",)):
    writer = GGUFWriter(path, arch)
    for key, value in [("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.add_token_scores([0.0] * 3)
    writer.add_token_types([2, 3, 3])
    for name in tensors:
        writer.add_tensor(name, np.ones((3, 8) if name == "token_embd.weight" else (4,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_refuses_other_tokenizer_models(tmp_path):
    _tiny_file(tmp_path / "t5.gguf", tokenizer="t5")
    with pytest.raises(ValueError, match="t5.gguf: tokenizer model 't5' is not supported; supported: gpt2.*llama"):
        convert_gguf(tmp_path / "t5.gguf", tmp_path)


@pytest.mark.parametrize("arch,tensor", [("llama", "rope_freqs.weight"), ("gemma2", "rope_factors_long.weight")])
def test_refuses_rope_factor_tensors(tmp_path, arch, tensor):
    """Llama 3.1's llama3 rope travels as computed frequencies, whose parameters the file no longer holds
    (transformers' GGUF loading drops them and runs plain rope): refused rather than converted wrongly; so are
    longrope factors outside phi3."""
    _tiny_file(tmp_path / "scaled.gguf", arch, tensors=("token_embd.weight", tensor))
    with pytest.raises(ValueError, match=f"rotary scaling tensors {tensor}.*not supported"):
        convert_gguf(tmp_path / "scaled.gguf", tmp_path)


def test_refuses_other_architectures(tmp_path):
    _tiny_file(tmp_path / "gemma3n.gguf", "gemma3n")
    with pytest.raises(ValueError, match="'gemma3n'; supported: llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3$"):
        convert_gguf(tmp_path / "gemma3n.gguf", tmp_path)


def test_mistral_named_llama_file(tmp_path, vocab):
    """llama.cpp writes Mistral as architecture llama. transformers 5.17 cannot load such a file named "mistral"
    (it turns it into model_type mistral, which gguf-py no longer names); the conversion keeps model_type llama,
    the same maths (the file holds no sliding window), and gives the weights transformers reads from the file
    without that name."""
    model = _hf_model("llama", len(vocab[0]))
    _write_gguf(tmp_path / "mistral.gguf", "llama", model, vocab, name="mistral")
    _write_gguf(tmp_path / "llama.gguf", "llama", model, vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "mistral.gguf", out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(NotImplementedError, match="mistral"):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mistral.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="llama.gguf", dtype=torch.float32).state_dict()
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


# The split regexes of the original tokenizer.json files (as llama.cpp's llama-vocab.cpp quotes them), written out
# here apart from the converter's own constants
ORIGINAL_SPLITS = {
    "llama-bpe": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "tekken": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"""
              r"""[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "gpt-4o": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
              r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
              r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
              r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
BYTE_LEVEL_TEXTS = TEXTS + ["I'LL say getServer's camelCase 1234567 and 3.14159 zzqx", "x/y\r\n  z  ", "ÉCOLE naïve"]


@pytest.mark.parametrize("pre,arch", [("llama-bpe", "llama"), ("tekken", "llama"), ("gpt-4o", "phi3")])
def test_byte_level_split_rules(tmp_path, pre, arch):
    """Llama 3 (llama-bpe), Mistral Nemo (tekken) and Phi-4-mini (gpt-4o, a phi3 file) split text by their own
    regexes before byte-level BPE, and the first two skip the merges for a word their vocabulary holds whole:
    a byte-level tokenizer trained with that rule, written into a GGUF as llama.cpp writes one, converts to the
    same token ids (BOS as llama.cpp adds it by default for the first two)."""
    from tokenizers import Regex, models, pre_tokenizers as pre_tok, trainers
    from tokenizers import Tokenizer as HFTokenizer

    original = HFTokenizer(models.BPE())
    original.pre_tokenizer = pre_tok.Sequence([pre_tok.Split(Regex(ORIGINAL_SPLITS[pre]), behavior="isolated"),
                                               pre_tok.ByteLevel(add_prefix_space=False, use_regex=False)])
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    text += " ".join(str(n) for n in range(0, 100000, 7))  # numbers, so that digit groups merge
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tok.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=["<s>", "</s>"])
    original.train_from_iterator([text], trainer)
    spec = json.loads(original.to_str())
    spec["model"]["ignore_merges"] = pre != "gpt-4o"
    # a word the vocabulary holds whole though no merge makes it: ignore_merges takes it as one token
    spec["model"]["vocab"]["\u0120zzqx"] = len(spec["model"]["vocab"])
    original = HFTokenizer.from_str(json.dumps(spec))
    vocab = sorted(original.get_vocab().items(), key=lambda item: item[1])

    writer = GGUFWriter(tmp_path / "bpe.gguf", arch)
    for key, value in [("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.ones((len(vocab), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    convert_gguf(tmp_path / "bpe.gguf", tmp_path)

    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = [0] if pre != "gpt-4o" else []
    for text in BYTE_LEVEL_TEXTS:
        want = original.encode(text).ids
        assert ours.encode(text).ids == bos + want, text
        assert ours.decode(want, skip_special_tokens=False) == text, text
        # the split itself, piece for piece (ids alone cannot tell rules apart where no merge crosses the difference)
        assert ours.pre_tokenizer.pre_tokenize_str(text) == original.pre_tokenizer.pre_tokenize_str(text), text
    # a word the vocabulary holds whole: one token where merges are skipped, the merges' pieces where not
    assert (len(ours.encode(" zzqx", add_special_tokens=False).ids) == 1) == (pre != "gpt-4o")


def test_refuses_other_byte_level_split_rules(tmp_path):
    path = tmp_path / "other.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-llm")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="pre-tokenizer .*'deepseek-llm' is not supported; supported: default, gpt-2"):
        convert_gguf(path, tmp_path)


def test_phi3_longrope(tmp_path, vocab):
    """Phi-3.5-mini / Phi-4-mini: llama.cpp stores longrope's factors as two tensors (which transformers' GGUF
    loading drops); they come back as rope_parameters, and the converted model computes what the original does
    both within the original context (short factors) and past it (long factors)."""
    model = _hf_model("phi3", len(vocab[0]), longrope=True)
    _write_gguf(tmp_path / "phi3.gguf", "phi3", model, vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "phi3.gguf", out)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 16
    want = model.config.rope_parameters
    for key in ("short_factor", "long_factor"):
        assert torch.equal(torch.tensor(rope[key]), torch.tensor(want[key], dtype=torch.float32)), key
    assert "rope_factors_long.weight" not in load_file(out / "model.safetensors")

    from infer.runtime.model import load_model

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=EAGER).eval()
    for length in (12, 40):  # within the original 16 positions, and past them
        ids = torch.randint(3, len(vocab[0]), (1, length))
        with torch.no_grad():
            theirs = converted(ids).logits
            assert torch.allclose(theirs, model(ids).logits, rtol=0, atol=1e-5), length
    # the runtime keeps one choice for the whole served context (long: 128 > 16), as transformers makes past 16
    got = load_model(out, dtype=torch.float32, kernels="torch").logits(ids)
    error = (got - theirs).abs().max().item()
    print(f"phi3 longrope: runtime vs transformers max |logit error| {error:.2e} "
          f"(logits up to {theirs.abs().max():.2f})")
    assert error < 1e-4 * max(1.0, theirs.abs().max().item()), error
