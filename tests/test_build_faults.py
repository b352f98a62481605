"""Faults in the build: ``kill -9`` at any stage, then the same command again, resumes and gives the
very bytes an uninterrupted build gives; corrupt sources are refused with the file named.

The kills are real: ``infer-build`` runs as a subprocess with ``INFER_TEST_PAUSE_AT=<stage>:<point>``
(the test hook in pipeline/stage.py), which makes it stop at exactly that point and say so; the
test then sends SIGKILL. The model is a tiny Llama written here (no download, no transformers) and
the recipe quantizes it with the data-free FP8 scheme, so every stage runs in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from infer.pipeline.build import build
from infer.pipeline.config import compose_recipe
from infer.pipeline.sources import SourceError, resolve_source
from infer.runtime.artifact import verify_artifact

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
LAYER = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
         "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}


def _tiny_source(path: Path, shards: int = 1) -> Path:
    """An HF Llama directory: 2 layers of width 64, random weights, a word-level tokenizer."""
    path.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32", "eos_token_id": 1}
    (path / "config.json").write_text(json.dumps(config))
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(300, 64, generator=gen),
               "lm_head.weight": torch.randn(300, 64, generator=gen) * 0.05, "model.norm.weight": torch.ones(64)}
    for i in range(2):
        for name, shape in LAYER.items():
            tensors[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.05
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(64)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(64)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _recipe(source: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    args = [f"model.source={source}", "artifact.name=tiny", f"output_dir={out}", f"cache_dir={cache}", *extra]
    if hasattr(compose_recipe(), "tune"):  # the tune stage times this machine: its table differs run to run
        args.append("tune.enabled=false")
    return args


def _infer_build(args: list[str], pause: str | None = None) -> tuple[int, str]:
    """Runs infer-build; with ``pause``, SIGKILLs it the moment it reports reaching that point.
    Returns (exit status, stderr); -9 when killed."""
    env = {k: v for k, v in os.environ.items() if k != "INFER_TEST_PAUSE_AT"}
    if pause:
        env["INFER_TEST_PAUSE_AT"] = pause
    proc = subprocess.Popen([str(Path(sys.executable).parent / "infer-build"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    watchdog = threading.Timer(600, proc.kill)  # a build that neither pauses nor ends fails, not hangs
    watchdog.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if pause and line.strip() == f"infer-test-paused {pause}":
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.stderr.close()
        rc = proc.wait()
    finally:
        watchdog.cancel()
    stderr = "".join(lines)
    if pause:
        assert rc == -signal.SIGKILL, f"infer-build did not reach {pause} (exit {rc}):\n{stderr[-3000:]}"
    return rc, stderr


def _finished_stages(cache: Path) -> set[str]:
    """Stages whose output is in place (a killed one's temporary directory does not count)."""
    return {p.parent.parent.name for p in (cache / "stages").glob("*/*/_stage.json") if not p.parent.name.startswith(".")}


def _stage_states(stderr: str) -> dict[str, str]:
    """{stage: cached | running} as the build logged them."""
    states = {}
    for line in stderr.splitlines():
        words = line.split()
        if "stage" in words and words.index("stage") + 2 < len(words):
            i = words.index("stage")
            if words[i + 2] in ("cached", "running"):
                states.setdefault(words[i + 1], words[i + 2])
    return states


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_kill_9_at_every_stage_then_the_same_command_resumes_byte_identical(tmp_path):
    source = _tiny_source(tmp_path / "src")
    reference = tmp_path / "reference"
    rc, err = _infer_build(_recipe(source, reference, tmp_path / "ref-cache", "quant=fp8", "quant.ignore=[lm_head]"))
    assert rc == 0, err[-3000:]
    expected = _files(reference)
    assert {"manifest.json", "model.safetensors", "config.json"} <= set(expected)

    out, cache = tmp_path / "out", tmp_path / "cache"
    args = _recipe(source, out, cache, "quant=fp8", "quant.ignore=[lm_head]")
    # (pause point, stages in place when it is reached): each run reuses what the killed ones finished
    before = set()
    for point, finished in [("load:started", set()), ("load:written", set()),
                            ("quantize:started", {"load"}), ("quantize:written", {"load"}),
                            ("package:written", {"load", "quantize"}),
                            ("publish:copied", {"load", "quantize", "package"})]:
        _, err = _infer_build(args, pause=point)
        assert _finished_stages(cache) == finished, point
        assert all(_stage_states(err).get(s) == "cached" for s in before), (point, _stage_states(err))
        assert not out.exists(), point  # nothing half-built is ever published
        before = finished
    assert _leftovers(out), "the killed publish left its copy (the next publish removes it)"
    rc, err = _infer_build(args)
    assert rc == 0, err[-3000:]
    assert all(_stage_states(err)[s] == "cached" for s in ("load", "quantize", "package")), _stage_states(err)
    assert _files(out) == expected
    assert _leftovers(out) == []

    # killed in the middle of replacing that artifact: the old one lies aside whole, and the rerun publishes
    _infer_build(args, pause="publish:swapped")
    assert not out.exists()
    (aside,) = [out.parent / n for n in _leftovers(out) if ".old-" in n]
    assert _files(aside) == expected and verify_artifact(aside)
    rc, err = _infer_build(args)
    assert rc == 0, err[-3000:]
    assert _files(out) == expected
    assert _leftovers(out) == []


# ---------------------------------------------------------------- corrupt sources
def _header_length(file: Path) -> int:
    return struct.unpack("<Q", file.read_bytes()[:8])[0]


@pytest.mark.parametrize("damage", ["truncated", "trailing bytes", "header length"])
def test_a_truncated_or_extended_safetensors_source_is_refused_before_any_stage(tmp_path, damage):
    source = _tiny_source(tmp_path / "src")
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[:-1000])
    elif damage == "trailing bytes":
        weights.write_bytes(data + b"\0" * 16)
    else:
        weights.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    with pytest.raises(SourceError, match=rf"{weights}: corrupt or unreadable safetensors file .*re-download or re-export"):
        resolve_source(str(source), None, tmp_path / "cache")


def test_a_header_lying_about_a_tensor_size_is_refused(tmp_path):
    source = _tiny_source(tmp_path / "src")
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    n = _header_length(weights)
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["shape"] = [65]  # 64 floats of data, a shape of 65
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(blob) == n
    weights.write_bytes(data[:8] + blob + data[8 + n:])
    with pytest.raises(SourceError, match=rf"{weights}: corrupt or unreadable safetensors file .*invalid shape, data type, "
                                          r"or offset for tensor"):
        resolve_source(str(source), None, tmp_path / "cache")


def test_an_index_naming_a_file_outside_the_source_is_refused(tmp_path):
    source = _tiny_source(tmp_path / "src", shards=2)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    (tmp_path / "elsewhere.safetensors").write_bytes((source / "model-00002-of-00002.safetensors").read_bytes())
    index["weight_map"] = {k: "../elsewhere.safetensors" if v.startswith("model-00002") else v
                           for k, v in index["weight_map"].items()}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"weight_map names '../elsewhere.safetensors', not a .safetensors file of"):
        resolve_source(str(source), None, tmp_path / "cache")


def test_a_shard_not_holding_what_the_index_says_is_refused(tmp_path):
    source = _tiny_source(tmp_path / "src", shards=2)
    first, second = source / "model-00001-of-00002.safetensors", source / "model-00002-of-00002.safetensors"
    second.write_bytes(first.read_bytes())  # a stale copy: a valid file with the wrong tensors
    with pytest.raises(SourceError, match=r"says tensor '.*' is in model-00002-of-00002.safetensors, which does not hold it"):
        resolve_source(str(source), None, tmp_path / "cache")


def test_a_weight_corrupted_to_nan_is_refused_and_nothing_is_published(tmp_path):
    """The header stays valid: only the NaN/inf scan of the loaded weights can see this."""
    source = _tiny_source(tmp_path / "src")
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    n = _header_length(weights)
    begin = json.loads(data[8:8 + n])["model.layers.1.mlp.up_proj.weight"]["data_offsets"][0]
    data[8 + n + begin + 4 * 10:8 + n + begin + 4 * 11] = struct.pack("<f", float("nan"))
    weights.write_bytes(bytes(data))
    cfg = compose_recipe(_recipe(source, tmp_path / "out", tmp_path / "cache"))
    with pytest.raises(SourceError, match=rf"{weights}: tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or inf"):
        build(cfg)
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_a_hub_cache_file_is_caught_by_its_blob_name(tmp_path):
    """huggingface_hub stores each LFS file as blobs/<its sha256>: a checksum a plain directory lacks."""
    import hashlib

    plain = _tiny_source(tmp_path / "plain")
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in plain.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    assert resolve_source(str(snapshot), None, tmp_path / "cache").kind == "hf"  # intact: accepted
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: the header cannot see it
    blob.write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"model.safetensors: its content's sha256 .* differs from its hub cache "
                                          r"blob's name .*download it again"):
        resolve_source(str(snapshot), None, tmp_path / "cache2")
