"""The quantize stage: every scheme builds and serves, bad settings fail before calibration,
identical rebuilds are byte-identical, compressed-tensors sources pass through.

Builds run on a tiny random Llama (2 layers, hidden 128) that shares the embedded model's
tokenizer, with 8 calibration windows of 64 tokens: the whole stage, in seconds. The numerical
checks of the runtime against transformers on the embedded model are in test_quant_runtime.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from infer.runtime.model.quant_linear import int4_cpu_backend
from quant_helpers import compare_logits

TINY_CALIB = ["calib.samples=8", "calib.seq_len=64"]
FORMATS = {"gptq": "pack-quantized", "awq": "pack-quantized", "w8a8": "int-quantized", "fp8": "float-quantized"}
BACKENDS = {"gptq": int4_cpu_backend(), "awq": int4_cpu_backend(), "w8a8": "cpu-w8a8", "fp8": "cpu-fp8"}  # float32
# as served: the shipped 8-bit recipes build from the bfloat16 model, which loads on the 8-bit kernels (from avx2)
SERVED = {**BACKENDS, "w8a8": "cpu-w8a8-blocks", "fp8": "cpu-fp8-blocks"}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, embedded_artifact) -> Path:
    """A random 2-layer Llama in HF format with the embedded model's tokenizer."""
    import transformers

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_artifact / name, out / name)
    return out


def _build(overrides: list[str], out: Path, cache: Path):
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    # untuned: these builds are about quantization, and a table timed anew would differ between caches
    return build(compose_recipe([*overrides, "tune.enabled=false", f"output_dir={out}", f"cache_dir={cache}"]))


def _tiny(method: str, tiny: Path) -> list[str]:
    # quant.ignore: the fp8 recipe also leaves named layers of the 30-layer embedded model in float, which
    # the 2-layer tiny model does not have (an ignore pattern that matches no layer is an error)
    # w8a8: one SmoothQuant strength and no gates (the recipe's candidates are chosen by release gates,
    # tests/test_quant_quality.py)
    return [f"recipe=smollm2_135m_{method}", f"model.source={tiny}", "quant.group_size=32" if method in ("gptq", "awq")
            else "quant.group_size=-1", "quant.ignore=[lm_head]", *TINY_CALIB,
            *(["quant.smoothing_strength=0.8", "eval=default"] if method == "w8a8" else [])]


# ---------------------------------------------------------------------------- data

def test_calibration_and_evaluation_splits_are_disjoint_and_cover_the_topics():
    from pydoc_data.topics import topics

    from infer.eval.datasets import calibration_texts, evaluation_texts

    keys = sorted(topics)
    calib, ev = calibration_texts(), evaluation_texts()
    assert calib == [topics[k] for k in keys[0::2]] and ev == [topics[k] for k in keys[1::2]]
    assert len(calib) + len(ev) == len(topics) and calib and ev


def test_user_data_files_and_deterministic_windows(tmp_path, embedded_artifact):
    from tokenizers import Tokenizer

    from infer.eval.datasets import DataError, load_texts, token_windows, windows_digest

    (tmp_path / "a.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one two three " * 100}) + "\n\n" +
                                      json.dumps({"text": "four five"}) + "\n")
    assert load_texts(str(tmp_path / "a.txt")) == [(tmp_path / "a.txt").read_text()]
    assert load_texts(str(tmp_path / "b.jsonl")) == ["one two three " * 100, "four five"]
    assert len(load_texts(str(tmp_path))) == 3  # a directory: every .txt and .jsonl in it, sorted
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(DataError, match="calib.data.*line 1.*'text'"):
        load_texts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="calib.data.*no such file"):
        load_texts(str(tmp_path / "missing.txt"))

    tok = Tokenizer.from_file(str(embedded_artifact / "tokenizer.json"))

    class Enc:
        @staticmethod
        def encode(text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens).ids

    texts = load_texts("pydoc_topics")
    a, b = token_windows(texts, Enc, 64, 8, seed=0), token_windows(texts, Enc, 64, 8, seed=0)
    assert a == b and len(a) == 8 and all(len(w) == 64 for w in a)
    assert windows_digest(token_windows(texts, Enc, 64, 8, seed=1)) != windows_digest(a)
    many = token_windows(texts[:2], Enc, 64, 500)  # more samples than the text holds: overlapping windows
    assert len(many) == 500 and all(len(w) == 64 for w in many)


# ---------------------------------------------------------------------------- pre-flight errors

@pytest.mark.parametrize("overrides, key, extra", [
    (["recipe=smollm2_135m_gptq", "quant.group_size=128"], "quant.group_size=128",
     ["model.layers.0.self_attn.q_proj", "in_features 576", "valid choices for this model: 8, 16, 32, 64, -1"]),
    (["recipe=smollm2_135m_gptq", "quant.ignore=[lm_head,not_a_layer]"], "quant.ignore", ["not_a_layer"]),
    (["recipe=smollm2_135m_w8a8", "quant.group_size=64"], "quant.group_size=64", ["valid choices: -1"]),
    (["recipe=smollm2_135m_fp8", "quant.symmetric=false"], "quant.symmetric", ["symmetric only"]),
    (["recipe=smollm2_135m_awq", "quant.act_order=true"], "quant.act_order", ["GPTQ option"]),
    (["recipe=smollm2_135m_gptq", "calib.data=/nonexistent/calib.txt"], "calib.data", ["no such file"]),
])
def test_bad_quant_settings_fail_before_calibration(overrides, key, extra, tmp_path, cache_dir, embedded_artifact):
    from infer.pipeline.build import BuildError

    stages = cache_dir / "stages" / "quantize"
    before = set(stages.iterdir()) if stages.is_dir() else set()
    with pytest.raises(BuildError) as err:
        _build(overrides, tmp_path / "out", cache_dir)
    msg = str(err.value)
    assert key in msg and all(e in msg for e in extra), msg
    after = set(stages.iterdir()) if stages.is_dir() else set()
    assert after == before, "calibration must not have started"
    assert not (tmp_path / "out").exists()


def test_fp8_recipe_leaves_the_last_mlp_in_float(embedded_artifact):
    """smollm2_135m_fp8's default quant.ignore (docs/quantization.md): lm_head and layer 29's MLP, the
    linears FP8 hurts most on this model; quant=fp8 on other recipes keeps only lm_head."""
    from infer.pipeline.config import compose_recipe
    from infer.pipeline.quantize import plan

    cfg = compose_recipe(["recipe=smollm2_135m_fp8"])
    p = plan(cfg, json.loads((embedded_artifact / "config.json").read_text()))
    assert "lm_head" in p.ignore and len(p.targets) == 30 * 7 - 3
    assert not any(t.startswith("model.layers.29.mlp.") for t in p.targets)
    assert list(compose_recipe(["recipe=smollm2_135m", "quant=fp8"]).quant.ignore) == ["lm_head"]


def test_bad_bits_is_a_recipe_error_and_the_cli_names_the_key(tmp_path, cache_dir, embedded_artifact):
    from infer.pipeline.config import RecipeError, compose_recipe

    with pytest.raises(RecipeError, match="quant.bits"):
        compose_recipe(["recipe=smollm2_135m_awq", "quant.bits=8"])
    r = run_cli("infer-build", "recipe=smollm2_135m_gptq", "quant.group_size=128", f"output_dir={tmp_path / 'o'}",
                f"cache_dir={cache_dir}")
    assert r.returncode == 1 and "quant.group_size=128" in r.stderr and "valid choices" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- every scheme builds and serves

@pytest.mark.parametrize("method", ["gptq", "awq", "w8a8", "fp8"])
def test_scheme_builds_and_serves(method, tiny_checkpoint, tmp_path, cache_dir, caplog):
    import logging

    import transformers

    from infer.runtime import LLM, SamplingParams
    from infer.runtime.model import load_model
    from infer.runtime.model.quant_linear import quantized_modules

    caplog.set_level(logging.INFO, logger="infer.build")
    result = _build(_tiny(method, tiny_checkpoint), tmp_path / method, cache_dir)
    art = result.artifact
    assert [s.name for s in result.stages][:3] == ["load", "quantize", "package"]
    # calibration says how far it is and how long is left, a subgraph (decoder layer) at a time
    progress = [r.getMessage() for r in caplog.records if "subgraphs calibrated" in r.getMessage()]
    if method != "fp8":  # data-free: no calibration pass
        assert [m.split(" subgraphs")[0] for m in progress] == ["quantize: 1/3", "quantize: 2/3", "quantize: 3/3"]
        assert progress[-1].endswith("about 0.0 min left")
    config = json.loads((art / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == FORMATS[method]
    assert config["rope_theta"] == 10000.0
    manifest = json.loads((art / "manifest.json").read_text())
    rec = manifest["quantize"]
    assert rec["method"] == method and rec["format"] == FORMATS[method] and rec["quantized_layers"] == 14
    if method == "fp8":
        assert rec["calibration"] is None  # data-free
    else:
        assert rec["calibration"]["samples"] == 8 and len(rec["calibration"]["tokens_sha256"]) == 64
    assert manifest["quantization"]["format"] == FORMATS[method]

    assert set(quantized_modules(load_model(art)).values()) == {SERVED[method]}
    model = load_model(art, torch.float32)  # the checkpoint against transformers without bfloat16's rounding
    assert set(quantized_modules(model).values()) == {BACKENDS[method]}
    assert len(quantized_modules(model)) == 8  # q/k/v and gate/up fused: 4 per layer; lm_head left float
    ref = transformers.AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    ids = torch.randint(3, 49152, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cmp = compare_logits(model.logits(ids)[0], ref(ids).logits[0].float())
    # a random 2-layer model: nearly flat distributions, so compare logits directly
    assert cmp["max_abs"] <= 0.02 * cmp["scale"] + 1e-3, cmp

    llm = LLM(art, kv_cache_memory=64 << 20)
    outs = llm.generate(["Hello there", "The capital of France is"], SamplingParams(temperature=0.0, max_tokens=6,
                                                                                   ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_identical_rebuilds_are_byte_identical(method, tiny_checkpoint, tmp_path, caplog):
    # the second build holds at most 10 MiB of weights in memory (quant.memory_gib): its layers wait on disk
    # and are read in as calibrated, which changes no byte
    import logging

    caplog.set_level(logging.INFO, logger="infer.build")
    outs = []
    for i, memory in enumerate(([], ["quant.memory_gib=0.01"])):  # separate caches: the stage really runs twice
        outs.append(_build([*_tiny(method, tiny_checkpoint), *memory], tmp_path / f"a{i}", tmp_path / f"cache{i}").artifact)
    assert sum("layers beyond it wait on disk" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "cache1").rglob(".offload-*"))  # the folder went with the stage
    from llmcompressor.core import active_session

    assert active_session().lifecycle.state.model is None  # the calibrated model is not kept past the stage
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == sorted(p.name for p in outs[1].iterdir())
    for name in files:
        if name != "manifest.json":
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # the manifests differ in the recipe they record, and only there
    manifests = [json.loads((o / "manifest.json").read_text()) for o in outs]
    assert [m["recipe"]["quant"].pop("memory_gib") for m in manifests] == [None, 0.01]
    assert manifests[0] == manifests[1]


def test_compressed_tensors_source_is_packaged_without_quantizing(tiny_checkpoint, tmp_path, cache_dir):
    from infer.runtime.model import load_model
    from infer.runtime.model.quant_linear import quantized_modules

    quantized = _build(_tiny("w8a8", tiny_checkpoint), tmp_path / "q", cache_dir).artifact
    src = tmp_path / "src"
    shutil.copytree(quantized, src, ignore=shutil.ignore_patterns("manifest.json"))
    result = _build(["recipe=smollm2_135m", f"model.source={src}"], tmp_path / "passthrough", cache_dir)
    assert [s.name for s in result.stages] == ["load", "package"]
    art = result.artifact
    assert (art / "model.safetensors").read_bytes() == (quantized / "model.safetensors").read_bytes()
    assert set(quantized_modules(load_model(art)).values()) == {SERVED["w8a8"]}
    # quantizing an already quantized checkpoint is refused before any work
    from infer.pipeline.build import BuildError

    with pytest.raises(BuildError, match="already quantized"):
        _build(["recipe=smollm2_135m_gptq", f"model.source={src}", *TINY_CALIB], tmp_path / "x", cache_dir)


def test_multirun_builds_several_recipes(tiny_checkpoint, tmp_path, cache_dir):
    r = run_cli("infer-build", "-m", "recipe=smollm2_135m_fp8,smollm2_135m_w8a8", f"model.source={tiny_checkpoint}",
                "quant.group_size=-1", "quant.ignore=[lm_head]", "quant.smoothing_strength=0.8", "eval=default",
                *TINY_CALIB,
                f"output_dir={tmp_path}/${{artifact.name}}",
                f"cache_dir={cache_dir}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("smollm2-135m-instruct-fp8", "smollm2-135m-instruct-w8a8"):
        assert (tmp_path / name / "manifest.json").is_file()
