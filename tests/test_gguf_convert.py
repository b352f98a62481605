"""Tests for infer.pipeline.gguf_convert: the converted checkpoint must match transformers' own GGUF loading."""

import json
import time

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.pipeline.gguf_convert import convert_gguf, embedded_gguf_path

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
TEXTS = [
    "Version 3, 29 June 2007 costs $1234.56 (or 7%)",
    "naïve café — 東京 🙂",
    "<|im_start|>user\nWhat is 12+30?<|im_end|>\n",
    " leading  spaces\t\ttabs\n\nend ",
]


@pytest.fixture(scope="module")
def gguf_file():
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    start = time.perf_counter()
    convert_gguf(gguf_file, out)
    print(f"\nconversion took {time.perf_counter() - start:.1f} s")
    return out


@pytest.fixture(scope="module")
def gguf_model(gguf_file):
    """The reference: transformers dequantizes the same GGUF itself."""
    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted_model(converted):
    return AutoModelForCausalLM.from_pretrained(converted).eval()


def test_config(converted):
    text = (converted / "config.json").read_text()
    config = json.loads(text)
    assert text == json.dumps(config, indent=2, sort_keys=True) + "\n"
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["dtype"] == config["torch_dtype"] == "float32"
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_weights_equal_transformers_gguf_loading(converted, gguf_model):
    ours = load_file(converted / "model.safetensors")
    theirs = gguf_model.state_dict()
    assert len(ours) == 272 and "lm_head.weight" not in ours
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, theirs[name]), name


def test_converted_model_matches_and_answers(converted, gguf_model, converted_model):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer("The GNU General Public License is a free, copyleft license", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(converted_model(ids).logits, gguf_model(ids).logits, atol=1e-5, rtol=0)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = converted_model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tokenizer_splits_digits(converted):
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:8192]
    assert len(tokenizer.encode(text).ids) == 1782  # 1785 without SmolLM's digit rule
    assert tokenizer.encode("2007").tokens == ["2", "0", "0", "7"]


def test_autotokenizer_agrees_and_round_trips(converted):
    fast = AutoTokenizer.from_pretrained(converted)
    raw = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert (fast.bos_token, fast.eos_token, fast.pad_token, fast.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    for text in TEXTS:
        ids = fast(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert fast.decode(ids) == text
    assert fast("<|im_start|><|im_end|>")["input_ids"] == [1, 2]


def test_conversion_is_deterministic(gguf_file, converted, tmp_path):
    convert_gguf(gguf_file, tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (converted / name).read_bytes(), name


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="fake.gguf.*not a GGUF"):
        convert_gguf(path, tmp_path)


def _write_tiny_gguf(path, arch):
    """A small random-weight byte-level model, untied lm_head, no q/k permutation: qwen2 (biases) or qwen3
    (per-head q/k norms, a head_dim apart from hidden / heads)."""
    rng = np.random.default_rng(0)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    head_dim = 32 if arch == "qwen3" else 16
    vocab, hidden, ffn, q, kv = len(tokens), 64, 96, 4 * head_dim, 2 * head_dim
    writer = GGUFWriter(path, arch)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(vocab - 3)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 3)

    def add(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    add("output.weight", vocab, hidden)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        for name, rows in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)]:
            add(f"blk.{i}.{name}.weight", rows, hidden)
            if arch == "qwen2":
                add(f"blk.{i}.{name}.bias", rows)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", head_dim)
            add(f"blk.{i}.attn_k_norm.weight", head_dim)
        add(f"blk.{i}.attn_output.weight", hidden, q)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,cls,special", [("qwen2", "Qwen2ForCausalLM", "model.layers.1.self_attn.k_proj.bias"),
                                               ("qwen3", "Qwen3ForCausalLM", "model.layers.1.self_attn.k_norm.weight")])
def test_qwen_matches_transformers_gguf_loading(tmp_path, arch, cls, special):
    _write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out, dtype=torch.bfloat16)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [cls]
    assert config["tie_word_embeddings"] is False and config["dtype"] == "bfloat16"
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ours = load_file(out / "model.safetensors")
    assert "lm_head.weight" in ours and special in ours
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, theirs[name].to(torch.bfloat16)), name
    # and the runtime computes what transformers computes from the converted checkpoint (float32 both; the
    # config is ours: transformers' GGUF loader ignores attention.key_length, so it cannot run a qwen3 file
    # whose head_dim is not hidden / heads, as Qwen3-0.6B's is not)
    from infer.runtime.model import load_model

    ids = torch.randint(0, config["vocab_size"], (1, 24))
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want = reference(ids).logits
    got = load_model(out, dtype=torch.float32, kernels="torch").logits(ids)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item()), (got - want).abs().max()

    reference_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ["the theory 1234 <|im_end|> café's   x\n\n", "The THE"]:
        assert tokenizer.encode(text).ids == reference_tokenizer(text)["input_ids"], text


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'.*llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3"):
        convert_gguf(path, tmp_path)
