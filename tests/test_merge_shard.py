"""Tensor-parallel shard and merge stages (pipeline/shard.py, pipeline/merge.py) on tiny random models."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from conftest import need
from infer.pipeline.build import BuildError, build
from infer.pipeline.config import compose_recipe
from infer.pipeline.merge import MergeError, merge, per_rank_layout
from infer.pipeline.shard import ShardError, check_tp, shard
from infer.pipeline.sources import SourceError
from infer.runtime.artifact import LAYOUT_FILE, ArtifactError, verify_artifact

ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def _tokenizer(path: Path, vocab: int = 320) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, vocab)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _tiny(arch: str, path: Path, **overrides) -> transformers.PreTrainedModel:
    """A random 2-layer model (hidden 64, 4 heads, 2 KV heads, vocab 320, float32) saved as HF."""
    config_cls, model_cls = ARCHS[arch]
    kw = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 50000.0,
          "rms_norm_eps": 1e-6}
    model = model_cls(config_cls(**{**kw, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so a mixed-up norm shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (0 if name.endswith("bias") else 1))
    model.save_pretrained(path)
    _tokenizer(path, model.config.vocab_size)
    return model


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _dirs(root: Path, *names: str) -> list[Path]:
    for n in names:
        (root / n).mkdir()
    return [root / n for n in names]


def _ids(n: int = 12, vocab: int = 320) -> torch.Tensor:
    g = torch.Generator().manual_seed(torch.initial_seed())
    return torch.randint(0, vocab, (1, n), generator=g)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


# ---------------------------------------------------------------- shard -> merge is the identity

@pytest.mark.parametrize("arch", ARCHS)
def test_shard_then_merge_gives_the_same_tensors(arch, tmp_path):
    _tiny(arch, tmp_path / "src")
    _dirs(tmp_path, "tp", "merged")
    info = shard(tmp_path / "src", tmp_path / "tp", 2)
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == [
        "config.json", "generation_config.json", "rank0.safetensors", "rank1.safetensors", LAYOUT_FILE,
        "tokenizer.json"]
    doc = json.loads((tmp_path / "tp" / LAYOUT_FILE).read_text())
    t = doc["tensors"]
    assert doc["tp_size"] == 2 and doc["ranks"] == ["rank0.safetensors", "rank1.safetensors"]
    assert t["model.layers.0.self_attn.k_proj.weight"] == {"split": "column", "dim": 0, "dtype": "F32",
                                                           "shape": [32, 64], "local_shapes": [[16, 64], [16, 64]]}
    assert (t["model.layers.1.self_attn.o_proj.weight"]["split"], t["model.layers.1.self_attn.o_proj.weight"]["dim"]) \
        == ("row", 1)
    assert t["model.layers.1.mlp.down_proj.weight"]["local_shapes"] == [[64, 64], [64, 64]]
    assert t["model.embed_tokens.weight"]["split"] == t["model.norm.weight"]["split"] == "replicated"
    if arch == "qwen2":
        assert t["model.layers.0.self_attn.v_proj.bias"]["local_shapes"] == [[16], [16]]
    assert info["splits"]["row"] == 4
    assert per_rank_layout(tmp_path / "tp") == "infer-tp"
    merge(tmp_path / "tp", tmp_path / "merged")
    _assert_same(_tensors(tmp_path / "src"), load_file(tmp_path / "merged" / "model.safetensors"))
    assert (tmp_path / "merged" / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()


def test_shard_is_byte_identical_and_merge_refuses_mismatched_ranks(tmp_path):
    _tiny("qwen2", tmp_path / "src")
    a, b, m = _dirs(tmp_path, "a", "b", "m")
    shard(tmp_path / "src", a, 2)
    shard(tmp_path / "src", b, 2)
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    # rank files that do not belong together are refused, not merged into a wrong model
    rank1 = load_file(b / "rank1.safetensors")
    rank1["model.norm.weight"] = rank1["model.norm.weight"] + 1
    save_file(rank1, b / "rank1.safetensors", metadata={"format": "pt", "tp_rank": "1", "tp_size": "2"})
    with pytest.raises(MergeError, match=r"rank1.safetensors: replicated tensor model.norm.weight differs"):
        merge(b, m)
    shutil.copyfile(a / "rank0.safetensors", a / "rank1.safetensors")
    with pytest.raises(MergeError, match=r"rank1.safetensors: its metadata says tp_rank 0 of 2, but .* rank 1 of 2"):
        merge(a, m)


def test_vocab_parallel_uneven_split_and_hf_shards_merge(tmp_path):
    model = _tiny("llama", tmp_path / "src", vocab_size=321)
    tp, m1, hf, m2 = _dirs(tmp_path, "tp", "m1", "hf", "m2")
    shard(tmp_path / "src", tp, 2, vocab_parallel=True)
    t = json.loads((tp / LAYOUT_FILE).read_text())["tensors"]
    assert t["lm_head.weight"]["split"] == "vocab" and t["lm_head.weight"]["local_shapes"] == [[161, 64], [160, 64]]
    merge(tp, m1)
    _assert_same(_tensors(tmp_path / "src"), _tensors(m1))
    # (a): an HF checkpoint over several files (an index) becomes one model.safetensors
    model.save_pretrained(hf, max_shard_size="100KB")
    assert len(list(hf.glob("*.safetensors"))) > 2
    merge(hf, m2)
    assert [p.name for p in m2.glob("*.safetensors")] == ["model.safetensors"]
    _assert_same(_tensors(tmp_path / "src"), _tensors(m2))


# ---------------------------------------------------------------- the ranks' math

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer(parts: list[dict], i: int, x, cos, sin, cfg) -> torch.Tensor:
    """Decoder layer ``i`` run the tensor-parallel way: each part (rank) attends with its own heads and
    multiplies its own MLP channels, and the row-parallel outputs are summed (the all-reduce)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    p, hd, eps = f"model.layers.{i}.", _head_dim(cfg), cfg.rms_norm_eps
    b, n = x.shape[:2]
    h = _rms(x, parts[0][p + "input_layernorm.weight"], eps)
    attn = 0
    for t in parts:
        q, k, v = (F.linear(h, t[p + f"self_attn.{m}_proj.weight"], t.get(p + f"self_attn.{m}_proj.bias"))
                   .view(b, n, -1, hd).transpose(1, 2) for m in "qkv")
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        attn = attn + F.linear(a.transpose(1, 2).reshape(b, n, -1), t[p + "self_attn.o_proj.weight"])
    x = x + attn
    h = _rms(x, parts[0][p + "post_attention_layernorm.weight"], eps)
    mlp = sum(F.linear(F.silu(F.linear(h, t[p + "mlp.gate_proj.weight"])) * F.linear(h, t[p + "mlp.up_proj.weight"]),
                       t[p + "mlp.down_proj.weight"]) for t in parts)
    return x + mlp


@pytest.mark.parametrize("arch", ARCHS)
def test_sum_of_rank_partials_equals_the_unsharded_layer(arch, tmp_path):
    model = _tiny(arch, tmp_path / "src")
    _dirs(tmp_path, "tp")
    shard(tmp_path / "src", tmp_path / "tp", 2)
    ranks = [{k: v.double() for k, v in load_file(tmp_path / "tp" / f"rank{r}.safetensors").items()} for r in range(2)]
    full = {k: v.double() for k, v in load_file(tmp_path / "src" / "model.safetensors").items()}
    model = model.double()
    with torch.no_grad():
        hidden = model(_ids(), output_hidden_states=True).hidden_states
        pos = torch.arange(hidden[0].shape[1])[None]
        cos, sin = model.model.rotary_emb(hidden[0], pos)
        ref = _layer([full], 0, hidden[0], cos, sin, model.config)
        sharded = _layer(ranks, 0, hidden[0], cos, sin, model.config)
    assert (sharded - ref).abs().max() < 1e-12  # the sharding: float64, only the sum order differs
    assert (ref - hidden[1]).abs().max() < 1e-5  # the reference is transformers' layer (its norms round to float32)
    # and the sum is what makes it: one rank alone is far off
    with torch.no_grad():
        assert (_layer(ranks[:1], 0, hidden[0], cos, sin, model.config) - ref).abs().max() > 1e-3


# ---------------------------------------------------------------- TensorRT-LLM rank files

def _write_trtllm(model, out: Path, tp: int, pp: int, numbering: str = "local") -> None:
    """The model as TensorRT-LLM's convert_checkpoint.py lays it out (its llama/qwen2 conventions)."""
    cfg, sd = model.config, model.state_dict()
    nh, kv, hd, vocab, layers = (cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg), cfg.vocab_size,
                                 cfg.num_hidden_layers)
    padded = -(-vocab // tp) * tp
    per = layers // pp

    def heads(x, n, t):  # rank t's heads (duplicated KV heads when there are fewer than ranks)
        x = x.view(n, hd, *x.shape[1:])
        return (x.chunk(tp)[t] if n >= tp else x[t // (tp // n)][None]).reshape(-1, *x.shape[2:])

    for stage in range(pp):
        for t in range(tp):
            w = {}
            if stage == 0:
                w["transformer.vocab_embedding.weight"] = sd["model.embed_tokens.weight"]
            if stage == pp - 1:
                w["transformer.ln_f.weight"] = sd["model.norm.weight"]
                w["lm_head.weight"] = F.pad(sd["lm_head.weight"], (0, 0, 0, padded - vocab)).chunk(tp)[t]
            for layer in range(stage * per, (stage + 1) * per):
                h = f"model.layers.{layer}."
                p = f"transformer.layers.{layer - stage * per if numbering == 'local' else layer}."
                for s in ("weight", "bias"):
                    if h + f"self_attn.q_proj.{s}" in sd:
                        w[p + f"attention.qkv.{s}"] = torch.cat([
                            heads(sd[h + f"self_attn.q_proj.{s}"], nh, t), heads(sd[h + f"self_attn.k_proj.{s}"], kv, t),
                            heads(sd[h + f"self_attn.v_proj.{s}"], kv, t)])
                w[p + "attention.dense.weight"] = sd[h + "self_attn.o_proj.weight"].chunk(tp, 1)[t]
                w[p + "mlp.fc.weight"] = sd[h + "mlp.gate_proj.weight"].chunk(tp)[t]  # SiLU'd: TRT-LLM's fc
                w[p + "mlp.gate.weight"] = sd[h + "mlp.up_proj.weight"].chunk(tp)[t]
                w[p + "mlp.proj.weight"] = sd[h + "mlp.down_proj.weight"].chunk(tp, 1)[t]
                w[p + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
                w[p + "post_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
            save_file({k: v.contiguous() for k, v in w.items()}, out / f"rank{stage * tp + t}.safetensors")
    arch = "LlamaForCausalLM" if cfg.model_type == "llama" else "Qwen2ForCausalLM"
    (out / "config.json").write_text(json.dumps({
        "architecture": arch, "dtype": "float32", "vocab_size": vocab, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": kv, "head_size": hd,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "silu", "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox", "max_position_embeddings": cfg.max_position_embeddings,
        "rotary_base": cfg.rope_parameters["rope_theta"], "use_parallel_embedding": False,
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}}))


@pytest.mark.parametrize("arch,tp,pp,numbering,vocab", [
    ("llama", 2, 1, "local", 320), ("qwen2", 2, 1, "local", 320),
    ("llama", 4, 1, "local", 318),  # 2 KV heads on 4 ranks (duplicated) and a padded vocab
    ("qwen2", 1, 2, "local", 320), ("llama", 2, 2, "global", 320)])  # pipeline stages, both numberings
def test_trtllm_rank_files_merge_into_the_same_model(arch, tp, pp, numbering, vocab, tmp_path):
    model = _tiny(arch, tmp_path / "hf", vocab_size=vocab)
    trt, _ = _dirs(tmp_path, "trt", "merged")
    _write_trtllm(model, trt, tp, pp, numbering)
    assert per_rank_layout(trt) == "trtllm"
    merge(trt, tmp_path / "merged")
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged["rope_theta"] == 50000.0 and merged["model_type"] == arch
    _assert_same(_tensors(tmp_path / "hf"), load_file(tmp_path / "merged" / "model.safetensors"))
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = _ids(16, vocab)
    with torch.no_grad():
        assert (ours(ids).logits - model(ids).logits).abs().max() < 1e-6


def test_trtllm_quantized_and_inconsistent_checkpoints_are_refused(tmp_path):
    model = _tiny("llama", tmp_path / "hf")
    trt, _ = _dirs(tmp_path, "trt", "m")
    _write_trtllm(model, trt, 2, 1)
    config = json.loads((trt / "config.json").read_text())
    (trt / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(MergeError, match=r"attention.qkv.weight has 64 rows, expected 96"):
        merge(trt, tmp_path / "m")
    (trt / "config.json").write_text(json.dumps({**config, "quantization": {"quant_algo": "W4A16_AWQ"}}))
    with pytest.raises(MergeError, match=r"quant_algo=W4A16_AWQ.*quant.method"):
        merge(trt, tmp_path / "m")


# ---------------------------------------------------------------- bad tp values

@pytest.mark.parametrize("overrides,tp,match", [
    ({}, 3, r"num_attention_heads=4 is not divisible by 3 .*parallel.tp that divides .*: \[1, 2\]"),
    ({}, 4, r"num_key_value_heads=2 is not divisible by 4 \(each rank needs whole KV heads\).*\[1, 2\]"),
    ({"num_key_value_heads": 4, "intermediate_size": 130}, 4, r"intermediate_size=130 is not divisible by 4.*\[1, 2\]"),
])
def test_indivisible_tp_names_the_value_and_the_fix(overrides, tp, match):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, **overrides}
    with pytest.raises(ShardError, match=match):
        check_tp(config, tp)


def test_build_fails_on_bad_tp_before_sharding_and_cli_says_why(tmp_path):
    _tiny("llama", tmp_path / "src")
    cfg = compose_recipe([f"model.source={tmp_path / 'src'}", "parallel.tp=4", f"output_dir={tmp_path / 'o'}",
                          f"cache_dir={tmp_path / 'c'}"])
    with pytest.raises(BuildError, match=r"num_key_value_heads=2 is not divisible by 4"):
        build(cfg)
    assert not (tmp_path / "c" / "stages" / "shard").exists() and not (tmp_path / "o").exists()
    cli = subprocess.run([str(Path(sys.executable).parent / "infer-build"), f"model.source={tmp_path / 'src'}",
                          "parallel.tp=3", f"output_dir={tmp_path / 'o'}", f"cache_dir={tmp_path / 'c'}"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert cli.returncode == 1 and "num_attention_heads=4 is not divisible by 3" in cli.stderr


# ---------------------------------------------------------------- quantized checkpoints

@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """W4A16 round-to-nearest checkpoints (llm-compressor, data-free) of a hidden-128 Llama: asymmetric
    group 32 (packed zero points), and symmetric group 64 on a 4-KV-head variant."""
    need("llmcompressor")
    from quant_helpers import rtn_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    torch.manual_seed(0)  # module-scoped: built before any test's own seed
    _tiny("llama", root / "f32", hidden_size=128, intermediate_size=256)
    _tiny("llama", root / "f32kv4", hidden_size=128, intermediate_size=256, num_key_value_heads=4)
    return {"g32": rtn_checkpoint(root / "f32", root / "g32", "w4a16_asym_g32"),
            "g64": rtn_checkpoint(root / "f32kv4", root / "g64", "w4a16")}


def _dequant(t: dict, prefix: str, act_order: bool = False) -> torch.Tensor:
    """compressed-tensors pack-quantized W4 -> float64 [N, K], by its own unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = t[prefix + "weight_shape"].tolist()
    scale = t[prefix + "weight_scale"].double()
    q = unpack_from_int32(t[prefix + "weight_packed"], 4, torch.Size([n, k])).double()
    zero = unpack_from_int32(t[prefix + "weight_zero_point"], 4, torch.Size([n, scale.shape[1]]), packed_dim=0).double()
    g = t[prefix + "weight_g_idx"].long() if act_order else torch.arange(k) // (k // scale.shape[1])
    return (q - zero[:, g]) * scale[:, g]


def test_quantized_shard_splits_on_groups_and_round_trips(quantized, tmp_path):
    src = quantized["g32"]
    _dirs(tmp_path, "tp", "m")
    shard(src, tmp_path / "tp", 2)
    t = json.loads((tmp_path / "tp" / LAYOUT_FILE).read_text())["tensors"]
    o, q = "model.layers.0.self_attn.o_proj.", "model.layers.0.self_attn.k_proj."
    assert (t[o + "weight_scale"]["split"], t[o + "weight_scale"]["dim"], t[o + "weight_scale"]["local_shapes"]) \
        == ("row", 1, [[128, 2], [128, 2]])
    assert t[q + "weight_zero_point"]["local_shapes"] == [[4, 4], [4, 4]]  # 32 rows -> 4 int32 words per rank
    assert t[o + "weight_shape"]["split"] == "shape"
    ranks = [load_file(tmp_path / "tp" / f"rank{r}.safetensors") for r in range(2)]
    assert ranks[1][o + "weight_shape"].tolist() == [128, 64] and ranks[0][q + "weight_shape"].tolist() == [32, 128]
    merge(tmp_path / "tp", tmp_path / "m")
    _assert_same(_tensors(src), load_file(tmp_path / "m" / "model.safetensors"))
    assert (tmp_path / "m" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    # each rank's packed weight, scales and zero points still belong together
    full = _tensors(src)
    x = torch.randn(3, 256, dtype=torch.float64)
    d = "model.layers.1.mlp.down_proj."
    partial = sum(x[:, r * 128:(r + 1) * 128] @ _dequant(ranks[r], d).T for r in range(2))
    assert (partial - x @ _dequant(full, d).T).abs().max() < 1e-9
    assert torch.equal(torch.cat([_dequant(rk, q) for rk in ranks]), _dequant(full, q))


def test_act_order_row_parallel_keeps_groups_whole(quantized, tmp_path):
    """A GPTQ act-order g_idx (a permutation of groups over K): row-parallel ranks get their columns'
    g_idx and every group's scales and zero points."""
    tensors = _tensors(quantized["g32"])
    g = torch.Generator().manual_seed(torch.initial_seed())
    for name in [n for n in tensors if n.endswith(".weight_shape")]:
        k = int(tensors[name][1])
        tensors[name.replace("weight_shape", "weight_g_idx")] = (torch.arange(k) // 32)[torch.randperm(k, generator=g)] \
            .to(torch.int32)
    src, _, _ = _dirs(tmp_path, "src", "tp", "m")
    save_file(tensors, src / "model.safetensors")
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(quantized["g32"] / f, src / f)
    shard(src, tmp_path / "tp", 2)
    t = json.loads((tmp_path / "tp" / LAYOUT_FILE).read_text())["tensors"]
    d, q = "model.layers.0.mlp.down_proj.", "model.layers.0.mlp.up_proj."
    assert t[d + "weight_g_idx"]["split"] == "row" and t[d + "weight_scale"]["split"] == "replicated"
    assert t[q + "weight_g_idx"]["split"] == "replicated" and t[q + "weight_scale"]["split"] == "column"
    ranks = [load_file(tmp_path / "tp" / f"rank{r}.safetensors") for r in range(2)]
    x = torch.randn(3, 256, dtype=torch.float64)
    partial = sum(x[:, r * 128:(r + 1) * 128] @ _dequant(ranks[r], d, act_order=True).T for r in range(2))
    assert (partial - x @ _dequant(tensors, d, act_order=True).T).abs().max() < 1e-9
    merge(tmp_path / "tp", tmp_path / "m")
    _assert_same(tensors, load_file(tmp_path / "m" / "model.safetensors"))


def test_group_size_violation_names_the_layer(quantized, tmp_path):
    _dirs(tmp_path, "tp")
    with pytest.raises(ShardError, match=r"model\.layers\.\d\.self_attn\.o_proj: in_features 128 / tp 4 = 32 is not a "
                                         r"multiple of the quantization group size 64.*parallel.tp in \[1, 2\]"):
        shard(quantized["g64"], tmp_path / "tp", 4)
    config = json.loads((quantized["g64"] / "config.json").read_text())
    with pytest.raises(ShardError, match=r"model.layers.\*.self_attn.o_proj: in_features 128 / tp 4"):
        check_tp(config, 4, group_size=64)  # what the build checks before quantizing
    check_tp(config, 2, group_size=64)


def test_fp8_build_quantizes_then_shards(tmp_path):
    """infer-build recipe=..._fp8 parallel.tp=2: fp8 codes split like floats, per-channel scales follow rows."""
    need("llmcompressor")
    _tiny("llama", tmp_path / "src")
    result = build(compose_recipe(["recipe=smollm2_135m_fp8", f"model.source={tmp_path / 'src'}",
                                   "quant.ignore=[lm_head]", "parallel.tp=2", f"output_dir={tmp_path / 'a'}",
                                   f"cache_dir={tmp_path / 'c'}"]))
    assert [s.name for s in result.stages] == ["load", "quantize", "shard", "package"]
    t = json.loads((result.artifact / LAYOUT_FILE).read_text())["tensors"]
    o, u = "model.layers.0.self_attn.o_proj.", "model.layers.0.mlp.up_proj."
    assert (t[o + "weight"]["split"], t[o + "weight"]["dtype"], t[o + "weight_scale"]["split"]) == \
        ("row", "F8_E4M3", "replicated")
    assert t[u + "weight_scale"]["split"] == "column" and t[u + "weight_scale"]["local_shapes"] == [[64, 1], [64, 1]]
    merge(result.artifact, _dirs(tmp_path, "m")[0])
    _assert_same(_tensors(result.stages[1].path), _tensors(tmp_path / "m"))


# ---------------------------------------------------------------- Megatron pickles are refused

class _Tripwire:
    """Unpickling this creates a file: proof that nothing was unpickled when the file is absent."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("files", [(".metadata", "__0_0.distcp"), ("common.pt",)])
def test_megatron_checkpoint_is_refused_without_unpickling(files, tmp_path):
    ckpt, marker = _dirs(tmp_path, "iter_0000100")[0], tmp_path / "unpickled"
    for name in files:
        (ckpt / name).write_bytes(pickle.dumps(_Tripwire(marker)))
    base = [f"model.source={ckpt}", f"output_dir={tmp_path / 'o'}", f"cache_dir={tmp_path / 'c'}"]
    with pytest.raises(SourceError, match=r"Megatron.*unpickling can execute arbitrary code.*refused.*converter"):
        build(compose_recipe(base))
    # no setting turns the refusal into a promise the code cannot keep
    with pytest.raises(Exception, match=r"trust_pickled_checkpoints"):
        compose_recipe([*base, "model.trust_pickled_checkpoints=true"])
    _dirs(tmp_path, "m")
    with pytest.raises(MergeError, match=r"arbitrary code"):
        merge(ckpt, tmp_path / "m")
    assert not marker.exists()


# ---------------------------------------------------------------- end to end: infer-build parallel.tp=2

def test_build_tp2_artifact_is_verified_tamper_evident_and_rebuildable(tmp_path):
    model = _tiny("qwen2", tmp_path / "src")
    base = [f"model.source={tmp_path / 'src'}", "parallel.tp=2", "artifact.name=tiny"]
    result = build(compose_recipe([*base, f"output_dir={tmp_path / 'a'}", f"cache_dir={tmp_path / 'c'}"]))
    art = verify_artifact(result.artifact)
    files = art.manifest["files"]
    assert sorted(files) == ["config.json", "generation_config.json", "rank0.safetensors", "rank1.safetensors",
                             LAYOUT_FILE, "tokenizer.json"]
    assert art.manifest["parallel"] == {"tp": 2, "ranks": {str(r): {f"rank{r}.safetensors":
                                                                   files[f"rank{r}.safetensors"]["sha256"]}
                                                          for r in range(2)}}
    assert [s.name for s in result.stages] == ["load", "shard", "package"]
    # the same build in a fresh cache: the same bytes
    again = build(compose_recipe([*base, f"output_dir={tmp_path / 'b'}", f"cache_dir={tmp_path / 'c2'}"]))
    for name in [*files, "manifest.json"]:
        assert (result.artifact / name).read_bytes() == (again.artifact / name).read_bytes(), name
    # a changed byte in one rank file is refused, naming that file
    data = bytearray((again.artifact / "rank1.safetensors").read_bytes())
    data[-5] ^= 1
    (again.artifact / "rank1.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"rank1.safetensors: sha256 differs"):
        verify_artifact(again.artifact)
    # the sharded artifact is itself a source: merged back, it is the original model
    back = build(compose_recipe([f"model.source={result.artifact}", "artifact.name=back",
                                 f"output_dir={tmp_path / 'back'}", f"cache_dir={tmp_path / 'c'}"]))
    assert [s.name for s in back.stages] == ["merge", "load", "package", "tune"]
    _assert_same({k: v.float() for k, v in model.state_dict().items()}, _tensors(back.artifact))


# ---------------------------------------------------------------- memory: streaming, not the model at once

_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from infer.pipeline.shard import shard

    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

    open("/proc/self/clear_refs", "w").write("5")  # peak RSS from here on
    base = status("VmRSS")
    start = time.perf_counter()
    shard(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps({"base": base, "peak": status("VmHWM"), "seconds": time.perf_counter() - start}))
""")


def test_shard_peak_memory_is_about_one_tensor(tmp_path):
    """A ~390 MB checkpoint in two safetensors shards, sharded tp=2 in a fresh process."""
    src, out = _dirs(tmp_path, "src", "tp")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
              "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
              "vocab_size": 16384}
    (src / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(torch.initial_seed())
    shapes = {"model.embed_tokens.weight": (16384, 1024), "lm_head.weight": (16384, 1024), "model.norm.weight": (1024,)}
    for i in range(4):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{m}_proj.weight": (1024, 1024) for m in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": (4096, 1024), p + "mlp.up_proj.weight": (4096, 1024),
                       p + "mlp.down_proj.weight": (1024, 4096), p + "input_layernorm.weight": (1024,),
                       p + "post_attention_layernorm.weight": (1024,)})
    names = sorted(shapes)
    weight_map = {}
    for j, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{j + 1}-of-00002.safetensors"
        save_file({n: torch.randn(shapes[n], generator=g) for n in part}, src / file)
        weight_map.update({n: file for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    total = sum(4 * torch.Size(s).numel() for s in shapes.values())
    largest = max(4 * torch.Size(s).numel() for s in shapes.values())
    run = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(src), str(out), "2"], capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(f"shard tp=2 of {total / 2**20:.0f} MB (largest tensor {largest / 2**20:.0f} MB): peak RSS growth "
          f"{growth / 2**20:.0f} MB over {m['base'] / 2**20:.0f} MB, {m['seconds']:.2f} s")
    assert growth < 2 * largest + (64 << 20), f"peak RSS grew {growth / 2**20:.0f} MB"
    assert sum(f.stat().st_size for f in out.glob("rank*.safetensors")) > total  # the work was done


def test_fused_projections_shard_per_part_and_merge_back(tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank holds its share of every part ([q_r; k_r; v_r],
    [gate_r; up_r], split "column_parts"), and merge puts each part back before the next."""
    cfg = transformers.Phi3Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  rope_theta=10000.0, pad_token_id=0)
    transformers.Phi3ForCausalLM(cfg).eval().save_pretrained(tmp_path / "src")
    _tokenizer(tmp_path / "src")
    _dirs(tmp_path, "tp", "merged")
    shard(tmp_path / "src", tmp_path / "tp", 2)
    t = json.loads((tmp_path / "tp" / LAYOUT_FILE).read_text())["tensors"]
    qkv = t["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["split"] == "column_parts" and qkv["parts"] == [64, 32, 32] and qkv["local_shapes"] == [[64, 64]] * 2
    src = _tensors(tmp_path / "src")
    rank0 = load_file(tmp_path / "tp" / "rank0.safetensors")["model.layers.0.self_attn.qkv_proj.weight"]
    whole = src["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(rank0, torch.cat([whole[:32], whole[64:80], whole[96:112]]))  # q, k, v heads of rank 0
    merge(tmp_path / "tp", tmp_path / "merged")
    _assert_same(src, load_file(tmp_path / "merged" / "model.safetensors"))


@pytest.mark.parametrize("family,per_layer", [("gemma2", 4), ("gemma3_text", 6)])
def test_gemma_sandwich_and_qk_norms_are_replicated_and_merge_back(tmp_path, family, per_layer):
    """Gemma 2's four norms a layer (post_attention_layernorm norms the attention output, pre/post_feedforward
    the MLP's input and output), and Gemma 3's per-head q/k norms besides, are whole in every rank; merge gives
    every tensor back."""
    sizes = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    cfg = (transformers.Gemma2Config if family == "gemma2" else transformers.Gemma3TextConfig)(**sizes)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # Gemma stores weight - 1: random, so a mixed-up norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "src")
    _tokenizer(tmp_path / "src")
    _dirs(tmp_path, "tp", "merged")
    shard(tmp_path / "src", tmp_path / "tp", 2)
    t = json.loads((tmp_path / "tp" / LAYOUT_FILE).read_text())["tensors"]
    src = _tensors(tmp_path / "src")
    norms = [n for n in src if "norm" in n]
    assert len(norms) == per_layer * 2 + 1 and all(t[n]["split"] == "replicated" for n in norms)
    for r in range(2):
        rank = load_file(tmp_path / "tp" / f"rank{r}.safetensors")
        assert all(torch.equal(rank[n], src[n]) for n in norms)
    merge(tmp_path / "tp", tmp_path / "merged")
    _assert_same(src, load_file(tmp_path / "merged" / "model.safetensors"))
