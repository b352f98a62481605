"""The spine: recipes, stages and their cache, sources, the artifact, and their failures."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from conftest import REPO, run_cli
from infer.pipeline import build as build_mod
from infer.pipeline.build import build
from infer.pipeline.config import QuantMethod, RecipeError, compose_recipe
from infer.pipeline.sources import SourceError, resolve_source
from infer.runtime.artifact import ArtifactError, verify_artifact
from infer.runtime.model import load_model


# ---------------------------------------------------------------- recipes
def test_default_and_qwen_recipes_compose_and_validate():
    default = compose_recipe()
    assert default.recipe == "smollm2_135m" and default.model.source == "embedded:smollm2-135m-instruct"
    assert default.quant.method == QuantMethod.none
    qwen = compose_recipe(["recipe=qwen7b_awq"])
    assert qwen.model.source == "Qwen/Qwen2.5-7B-Instruct"
    assert (qwen.quant.method, qwen.quant.bits, qwen.quant.group_size) == (QuantMethod.awq, 4, 128)
    assert compose_recipe(["quant.group_size=64", "recipe=qwen7b_awq"]).quant.group_size == 64


def test_every_recipe_composes_and_group_options_state_only_what_differs_from_the_defaults():
    """The defaults are pipeline/config.py's dataclasses, stated once: a group option (recipes/quant/gptq.yaml,
    ...) that restated one would be a second place to change it."""
    from omegaconf import OmegaConf

    from infer.pipeline.config import BuildConfig, to_plain

    def restated(values: dict, base: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                out += restated(value, base[key], f"{prefix}{key}.")
            elif key in base and value == base[key]:
                out.append(prefix + key)
        return out

    for path in sorted((REPO / "recipes" / "recipe").glob("*.yaml")):
        assert compose_recipe([f"recipe={path.stem}"]).recipe == path.stem
    defaults = to_plain(BuildConfig())
    for group in ("model", "quant", "calib", "tune", "eval"):
        for path in sorted((REPO / "recipes" / group).glob("*.yaml")):
            compose_recipe([f"{group}={path.stem}"])
            assert not restated(OmegaConf.to_container(OmegaConf.load(path)) or {}, defaults[group]), path


def test_unknown_key_names_the_key_and_valid_ones():
    with pytest.raises(RecipeError, match=r"unknown recipe key 'quant.bitz'.*quant.bits"):
        compose_recipe(["+quant.bitz=4"])


@pytest.mark.parametrize("override,match", [
    ("model.dtype=float64", r"model.dtype.*float32.*bfloat16"),
    ("quant.method=magic", r"quant.method.*gptq"),
    ("artifact.version=one", r"artifact.version"),
    ("recipe=qwen7b_awq quant.bits=3", r"quant.bits.*awq takes bits in \[4\]"),
])
def test_bad_values_fail_before_any_work(override, match):
    with pytest.raises(RecipeError, match=match):
        compose_recipe(override.split())


def test_cli_lists_recipes_in_help_and_rejects_unknown_recipe():
    help_ = run_cli("infer-build", "--help")
    assert help_.returncode == 0
    assert "smollm2_135m" in help_.stdout and "qwen7b_awq" in help_.stdout and "quant:" in help_.stdout
    bad = run_cli("infer-build", "recipe=nope")
    assert bad.returncode != 0
    assert "recipe/nope" in bad.stderr and "smollm2_135m" in bad.stderr
    bad_key = run_cli("infer-build", "+model.foo=1")
    assert bad_key.returncode == 2 and "model.foo" in bad_key.stderr


# ---------------------------------------------------------------- the real build, end to end
def test_cli_build_is_cached_and_byte_identical(tmp_path):
    out1, out2, cache = tmp_path / "a1", tmp_path / "a2", tmp_path / "cache"
    first = run_cli("infer-build", f"output_dir={out1}", f"cache_dir={cache}")
    assert first.returncode == 0, first.stderr
    assert "stage load      running" in first.stderr
    # each stage that ran says its time and peak memory, in the log and in a report beside the artifact
    assert re.search(r"stage load      done    in [0-9.]+s, peak anonymous memory [0-9.]+ GiB", first.stderr)
    report = json.loads((tmp_path / "a1.build-report.json").read_text())
    assert [r["stage"] for r in report["stages"]][:2] == ["load", "package"]
    assert all(not r["cached"] and r["seconds"] > 0 and r["peak_anon_gib"] > 0.05 for r in report["stages"])
    second = run_cli("infer-build", f"output_dir={out2}", f"cache_dir={cache}")
    assert second.returncode == 0, second.stderr
    assert "stage load      cached" in second.stderr and "stage package   cached" in second.stderr
    assert all(r["cached"] and r["peak_anon_gib"] is None
               for r in json.loads((tmp_path / "a2.build-report.json").read_text())["stages"])
    names = sorted(p.name for p in out1.iterdir())
    assert names == sorted(p.name for p in out2.iterdir())
    for name in names:
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name
    manifest = verify_artifact(out1).manifest
    assert manifest["source"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert manifest["build"]["packages"]["torch"].startswith("2.13.0")
    assert manifest["recipe"]["model"]["dtype"] == "float32"
    # a rebuild into a fresh cache (no stage reused) gives the same model bytes; only the kernel timings
    # measured anew by the tune stage (and the manifest listing their hash) may differ
    assert "tuning.json" in names
    third = run_cli("infer-build", f"output_dir={out2}", f"cache_dir={tmp_path / 'cache2'}")
    assert third.returncode == 0
    assert {n for n in names if (out1 / n).read_bytes() != (out2 / n).read_bytes()} <= {"tuning.json", "manifest.json"}
    assert (out1 / "model.safetensors").read_bytes() == (out2 / "model.safetensors").read_bytes()


def test_a_stages_peak_memory_counts_what_it_and_its_children_held_at_most():
    from infer.pipeline.stage import PeakMemory, anon_bytes

    before = anon_bytes()
    assert before is not None and before > 0
    with PeakMemory(every=0.01) as memory:
        block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, written, then given back
        time.sleep(0.1)
        del block
    assert memory.peak - before >= 48 << 20, (memory.peak, before)
    assert anon_bytes() < memory.peak - (32 << 20)
    child = ("import sys, time; b = bytearray(96 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush(); "
             "time.sleep(0.5)")
    with PeakMemory(every=0.01) as memory:
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.2)
        proc.wait()
    assert memory.peak - before >= 80 << 20, (memory.peak, before)


def test_interrupted_build_publishes_nothing_and_resumes(tmp_path, monkeypatch):
    cfg = compose_recipe([f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"])

    def killed(checkpoint, out, manifest):
        shutil.copyfile(checkpoint / "config.json", out / "config.json")
        raise KeyboardInterrupt  # as if the build were stopped half way through packaging

    monkeypatch.setattr(build_mod, "package", killed)
    with pytest.raises(KeyboardInterrupt):
        build(cfg)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache" / "stages").glob("package/*"))
    monkeypatch.undo()
    result = build(cfg)
    assert [(s.name, s.cached) for s in result.stages] == [("load", True), ("package", False), ("tune", False)]
    verify_artifact(result.artifact)


# ---------------------------------------------------------------- a tampered artifact is refused
def _copy(src: Path, dst: Path) -> Path:
    """A copy whose weights are hard links (the tests only touch small files), to spare CI's disk 2 GB."""
    def link_weights(a: str, b: str) -> None:
        if a.endswith(".safetensors"):
            os.link(a, b)
        else:
            shutil.copyfile(a, b)

    shutil.copytree(src, dst, copy_function=link_weights)
    return dst


def test_tampered_artifact_is_refused(embedded_artifact, tmp_path):
    changed = _copy(embedded_artifact, tmp_path / "changed")
    data = bytearray((changed / "tokenizer_config.json").read_bytes())
    data[10] ^= 1
    (changed / "tokenizer_config.json").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"tokenizer_config.json: sha256 differs"):
        verify_artifact(changed)
    run = run_cli("infer-run", str(changed), "--prompt", "hi")
    assert run.returncode == 2 and "tokenizer_config.json" in run.stderr and "rebuild" in run.stderr

    missing = _copy(embedded_artifact, tmp_path / "missing")
    (missing / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer.json: listed in the manifest but missing"):
        verify_artifact(missing)

    future = _copy(embedded_artifact, tmp_path / "future")
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["format_version"] = 99
    (future / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"format version 99 is not supported"):
        verify_artifact(future)

    extra = _copy(embedded_artifact, tmp_path / "extra")
    (extra / "evil.py").write_text("print('hi')")
    with pytest.raises(ArtifactError, match=r"evil.py: not listed in the manifest"):
        verify_artifact(extra)


# ---------------------------------------------------------------- sources
def _tiny_llama(path: Path, shard: str | None = None) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


def test_local_sharded_checkpoint_builds_and_matches(tmp_path, embedded_artifact):
    src = tmp_path / "src"
    ref = _tiny_llama(src, shard="100KB")
    assert (src / "model.safetensors.index.json").exists()
    shutil.copyfile(embedded_artifact / "tokenizer.json", src / "tokenizer.json")  # any valid tokenizer
    cfg = compose_recipe([f"model.source={src}", f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'c'}",
                          "artifact.name=tiny"])
    result = build(cfg)
    manifest = verify_artifact(result.artifact).manifest
    assert manifest["source"]["kind"] == "hf" and len([f for f in manifest["files"] if f.endswith(".safetensors")]) > 1
    ids = torch.randint(0, 300, (1, 20))
    ours = load_model(result.artifact).logits(ids)
    with torch.no_grad():
        assert (ours - ref(ids).logits).abs().max() < 1e-4


def test_hub_id_from_populated_cache_and_clear_error_without(tmp_path, monkeypatch, embedded_artifact):
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / ("a" * 40)
    _tiny_llama(snap)
    shutil.copyfile(embedded_artifact / "tokenizer.json", snap / "tokenizer.json")
    (hub / "models--acme--tiny" / "refs").mkdir(parents=True)
    (hub / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    src = resolve_source("acme/tiny", "main", tmp_path / "cache")
    assert src.kind == "hub" and src.path == snap
    with pytest.raises(SourceError, match=r"cannot fetch hub model 'Qwen/Qwen2.5-7B-Instruct'.*huggingface-cli download"):
        resolve_source("Qwen/Qwen2.5-7B-Instruct", "main", tmp_path / "cache")


def test_bad_sources_are_refused_clearly(tmp_path):
    with pytest.raises(SourceError, match=r"checkpoint not found: '/no/such/dir'"):
        resolve_source("/no/such/dir", None, tmp_path)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(SourceError, match=r"refusing pickled weights \['pytorch_model.bin'\].*arbitrary code"):
        resolve_source(str(pickled), None, tmp_path)
    corrupt = tmp_path / "corrupt"
    _tiny_llama(corrupt)
    shutil.copyfile(corrupt / "config.json", corrupt / "tokenizer.json")
    (corrupt / "model.safetensors").write_bytes(b"garbage" * 10)
    cfg = compose_recipe([f"model.source={corrupt}", f"output_dir={tmp_path / 'o'}", f"cache_dir={tmp_path / 'c'}"])
    with pytest.raises(SourceError, match=r"model.safetensors: corrupt or unreadable"):
        build(cfg)
    assert not (tmp_path / "o").exists()


def test_qwen_recipe_fails_fast_with_a_clear_message(tmp_path):
    run = run_cli("infer-build", "recipe=qwen7b_awq", f"output_dir={tmp_path / 'q'}", f"cache_dir={tmp_path / 'c'}",
                  env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert run.returncode == 1
    assert "build failed" in run.stderr and ("Qwen/Qwen2.5-7B-Instruct" in run.stderr or "quant" in run.stderr)
    assert not (tmp_path / "q").exists()
