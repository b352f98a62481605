"""An artifact cannot make the runtime open a file nobody verified; publish never deletes what
infer did not write; prefix-cache keys are a cryptographic chain.

The artifacts here are tiny hand-sealed directories (write_manifest, the build's own sealing), so
each case is a self-consistent artifact an attacker could ship: the manifest's hashes all match.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from conftest import run_cli
from infer.pipeline.package import publish
from infer.runtime.artifact import ArtifactError, verify_artifact, write_manifest
from infer.runtime.engine.block_manager import BlockManager
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.engine.sequence import Sequence
from infer.runtime.model.loader import read_state_dict, weight_files

INDEX = "model.safetensors.index.json"


def _artifact(path: Path, shards: int = 1) -> Path:
    """A sealed artifact of a few tiny tensors: config, tokenizer, weights (sharded with an index)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    if shards == 1:
        save_file({"w": torch.ones(4)}, path / "model.safetensors")
    else:
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({f"w{i}": torch.full((4,), float(i))}, path / name)
            weight_map[f"w{i}"] = name
        (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_manifest(path, {"name": "tiny", "version": "0.0.1"})
    return path


def _reseal(path: Path, files: dict | None = None) -> None:
    """Rewrites the manifest as an attacker would: every listed hash matching what is there."""
    manifest = json.loads((path / "manifest.json").read_text())
    if files is not None:
        manifest["files"] = files
    else:
        manifest = {k: v for k, v in manifest.items() if k not in ("files", "format", "format_version")}
        manifest = write_manifest(path, manifest)
        return
    (path / "manifest.json").write_text(json.dumps(manifest))


def _entry(file: Path) -> dict:
    data = file.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def test_resealing_hard_links_reads_only_new_files_and_still_catches_a_changed_byte(tmp_path, monkeypatch):
    """A later stage links the earlier one's files and re-seals: linked files keep the listed hash (no second
    read of gigabytes), a new or copied file is hashed; a byte changed in place is caught on verification."""
    import infer.runtime.artifact as artifact_mod
    from infer.pipeline.stage import link_tree

    first = _artifact(tmp_path / "first", shards=2)
    second = link_tree(first, tmp_path / "second")
    (second / "tuning.json").write_text("{}")
    os.unlink(second / "config.json")  # a copy, not a link: hashed again
    (second / "config.json").write_bytes((first / "config.json").read_bytes())
    hashed = []
    real = artifact_mod.sha256_file
    monkeypatch.setattr(artifact_mod, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    sealed = write_manifest(second, {"name": "tiny", "version": "0.0.2"}, linked_from=first)
    assert sorted(hashed) == ["config.json", "tuning.json"]
    monkeypatch.undo()
    assert sealed["files"] == {**json.loads((first / "manifest.json").read_text())["files"],
                               "tuning.json": _entry(second / "tuning.json")}
    verify_artifact(second)
    shard = second / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    with open(shard, "r+b") as f:  # in place: both directories see it (one inode)
        f.write(data)
    write_manifest(second, {"name": "tiny", "version": "0.0.3"}, linked_from=first)
    with pytest.raises(ArtifactError, match="model-00001-of-00002.safetensors"):
        verify_artifact(second)


def test_a_sealed_tiny_artifact_verifies(tmp_path):
    """The baseline every case below breaks one way: it verifies, index and all."""
    art = verify_artifact(_artifact(tmp_path / "a", shards=2))
    assert [p.name for p in art.weight_files()] == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"]


# ---------------------------------------------------------------- manifest paths
@pytest.mark.parametrize("rel", ["../outside.json", "ABSOLUTE", "sub/../../outside.json", "./config.json", ""])
def test_manifest_entries_outside_the_directory_are_refused(tmp_path, rel):
    art = _artifact(tmp_path / "a")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    rel = str(outside) if rel == "ABSOLUTE" else rel
    files = json.loads((art / "manifest.json").read_text())["files"]
    files[rel] = _entry(outside)
    _reseal(art, files)
    with pytest.raises(ArtifactError, match=r"not a plain relative path inside the artifact") as e:
        verify_artifact(art)
    assert repr(rel) in str(e.value)


def test_a_listed_symlink_leading_out_is_refused(tmp_path):
    art = _artifact(tmp_path / "a")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"chat_template": "{{ 'stolen' }}"}))
    (art / "tokenizer_config.json").unlink()
    (art / "tokenizer_config.json").symlink_to(secret)
    files = json.loads((art / "manifest.json").read_text())["files"]
    files["tokenizer_config.json"] = _entry(secret)  # the hash matches what the link leads to
    _reseal(art, files)
    with pytest.raises(ArtifactError, match=r"tokenizer_config.json.*resolves to .*secret.json, outside the artifact"):
        verify_artifact(art)


def test_a_symlinked_directory_leading_out_is_refused(tmp_path):
    art = _artifact(tmp_path / "a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.png").write_bytes(b"png")
    (art / "plots").symlink_to(elsewhere, target_is_directory=True)
    files = json.loads((art / "manifest.json").read_text())["files"]
    files["plots/x.png"] = _entry(elsewhere / "x.png")
    _reseal(art, files)
    with pytest.raises(ArtifactError, match=r"plots/x.png.*outside the artifact"):
        verify_artifact(art)


def test_an_unlisted_symlink_leading_out_is_refused(tmp_path):
    art = _artifact(tmp_path / "a")
    (art / "etc").symlink_to("/etc", target_is_directory=True)  # rglob never saw a linked directory
    with pytest.raises(ArtifactError, match=r"etc: a symlink leading out of the artifact"):
        verify_artifact(art)


def test_what_the_runtime_reads_by_name_must_be_a_listed_file(tmp_path):
    """A directory or a FIFO under a name the tokenizer opens was never a 'file' to the old check:
    the tokenizer would crash on the directory, and block forever reading the FIFO."""
    art = _artifact(tmp_path / "a")
    (art / "generation_config.json").mkdir()
    with pytest.raises(ArtifactError, match=r"generation_config.json: the runtime reads it but the manifest"):
        verify_artifact(art)
    (art / "generation_config.json").rmdir()
    os.mkfifo(art / "chat_template.jinja")
    with pytest.raises(ArtifactError, match=r"chat_template.jinja: not listed in the manifest"):
        verify_artifact(art)


# ---------------------------------------------------------------- the weights index
def test_an_index_naming_a_file_outside_is_refused_and_infer_run_exits_2(tmp_path):
    art = _artifact(tmp_path / "a", shards=2)
    save_file({"w1": torch.full((4,), 666.0)}, tmp_path / "evil.safetensors")
    index = json.loads((art / INDEX).read_text())
    index["weight_map"]["w1"] = "../evil.safetensors"
    (art / INDEX).write_text(json.dumps(index))
    _reseal(art)  # the index's new hash is in the manifest: only the check of its entries can refuse it
    with pytest.raises(ArtifactError, match=r"entry 'w1'.*'../evil.safetensors'"):
        verify_artifact(art)
    run = run_cli("infer-run", str(art), "--prompt", "hi")
    assert run.returncode == 2, run.stderr
    assert "'w1'" in run.stderr and "../evil.safetensors" in run.stderr


def test_an_index_naming_an_unlisted_shard_is_refused(tmp_path):
    art = _artifact(tmp_path / "a", shards=2)
    index = json.loads((art / INDEX).read_text())
    index["weight_map"]["w1"] = "model-00009-of-00009.safetensors"  # not in the manifest (nor here)
    (art / INDEX).write_text(json.dumps(index))
    _reseal(art)
    with pytest.raises(ArtifactError, match=r"entry 'w1' names 'model-00009-of-00009.safetensors', which is not "
                                            r"a safetensors file the manifest lists"):
        verify_artifact(art)


def test_the_loader_never_follows_an_index_out_of_a_plain_directory(tmp_path):
    """load_model(path) on a directory (no manifest) reads the index: its entries stay inside."""
    art = _artifact(tmp_path / "a", shards=2)
    save_file({"w1": torch.full((4,), 666.0)}, tmp_path / "evil.safetensors")
    (art / INDEX).write_text(json.dumps({"weight_map": {"w0": "model-00001-of-00002.safetensors",
                                                        "w1": "../evil.safetensors"}}))
    with pytest.raises(ArtifactError, match=r"'../evil.safetensors' is not a plain relative path"):
        weight_files(art)
    # the verified artifact's own list is what the engine loads: exactly the manifest's weights
    good = verify_artifact(_artifact(tmp_path / "b", shards=2))
    assert sorted(read_state_dict(good.path, good.weight_files())) == ["w0", "w1"]


# ---------------------------------------------------------------- publish
def _stage(tmp_path: Path) -> Path:
    stage = _artifact(tmp_path / "stage")
    (stage / "_stage.json").write_text("{}")  # the stage record publish leaves out
    return stage


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("manifest", [{"name": "my-dataset", "files": {}},  # some other tool's manifest.json
                                      {"format": "infer-artifactX", "files": {}}, "not json"])
def test_publish_refuses_a_directory_with_a_foreign_manifest_and_leaves_it(tmp_path, manifest):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    (out / "data.csv").write_text("precious\n")
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=rf"{out}: exists and .*not an infer artifact.*choose another output_dir"):
        publish(_stage(tmp_path), out)
    assert _snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []  # no copy left behind


def test_publish_refuses_an_artifact_holding_files_it_did_not_list(tmp_path):
    out = _artifact(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match=r"also holds notes.txt, which its manifest does not list"):
        publish(_stage(tmp_path), out)
    assert _snapshot(out) == before


def test_publish_replaces_an_earlier_artifact_and_an_empty_directory(tmp_path):
    stage = _stage(tmp_path)
    old = _artifact(tmp_path / "out")
    (old / "config.json").write_text("{}")
    _reseal(old)
    publish(stage, old)
    assert verify_artifact(old).config["model_type"] == "llama"
    empty = tmp_path / "empty"
    empty.mkdir()
    publish(stage, empty)
    verify_artifact(empty)


# ---------------------------------------------------------------- prefix-cache keys
def _admit(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence("r", list(tokens), SamplingParams())
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.register_full_blocks(seq)
    return seq


def test_prefix_keys_are_a_sha256_chain_seeded_by_the_model():
    bm = BlockManager(8, 4, model_id="model-a")
    seq = _admit(bm, list(range(9)))
    root = hashlib.sha256(b"infer-prefix\0model-a").digest()
    first = hashlib.sha256(root + array("q", [0, 1, 2, 3]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", [4, 5, 6, 7]).tobytes()).digest()
    assert [bm.blocks[b].hash for b in seq.block_table[:2]] == [first, second]
    assert bm.blocks[seq.block_table[2]].hash is None  # the partial block has no key
    other = BlockManager(8, 4, model_id="model-b")
    assert _admit(other, list(range(9))) and set(other.cached).isdisjoint(bm.cached)


def test_keys_that_pythons_hash_confuses_stay_apart():
    """hash(2**61 - 1) == hash(0) (ints hash modulo 2**61 - 1), so under the old tuple hash these two
    prompts' first blocks had one key: the second prompt waited for the first's unrelated block and
    its own block could not be cached. sha256 over the packed ids tells them apart."""
    a, b = [0, 1, 2, 3, 9], [2**61 - 1, 1, 2, 3, 9]
    assert hash((7, tuple(a[:4]))) == hash((7, tuple(b[:4])))  # the collision is real
    bm = BlockManager(16, 4)
    first = Sequence("a", a, SamplingParams())
    bm.match_prefix(first)
    bm.allocate(first, len(first))
    bm.mark_in_flight(first)  # a is computing its block
    second = Sequence("b", b, SamplingParams())
    assert bm.match_prefix(second) == 0  # nothing to wait for: a different block
    first.num_computed_tokens = len(first)
    bm.register_full_blocks(first)
    bm.allocate(second, len(second))
    second.num_computed_tokens = len(second)
    bm.register_full_blocks(second)
    assert len(bm.cached) == 2 and bm.blocks[first.block_table[0]].hash != bm.blocks[second.block_table[0]].hash


_KEYS_SCRIPT = """
from infer.runtime.engine.block_manager import BlockManager
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.engine.sequence import Sequence
bm = BlockManager(8, 4, model_id="sha-of-config")
seq = Sequence("r", list(range(12)), SamplingParams())
bm.allocate(seq, 12); seq.num_computed_tokens = 12; bm.register_full_blocks(seq)
print(",".join(repr(bm.blocks[b].hash) for b in seq.block_table))
"""


def test_prefix_keys_are_the_same_in_every_process():
    """What Python's hash() of a str is not: PYTHONHASHSEED changes it from process to process."""
    outs = {subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert len(outs) == 1 and len(outs.pop().split(",")) == 3


def test_the_artifact_file_names_and_list_are_declared_once():
    """runtime/artifact.py names the files an artifact carries and lists them; the build, the runtime,
    eval and the benchmarks import those names, so no other module spells a layout or index file name
    or writes out a second list of them."""
    import ast

    from infer.runtime.artifact import ARTIFACT_FILES, INDEX, LAYOUT_FILE

    repo = Path(__file__).resolve().parent.parent
    found = []
    for folder in ("pipeline", "runtime", "eval", "bench", "kernels"):
        for path in sorted((repo / folder).rglob("*.py")):
            if path == repo / "runtime" / "artifact.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = isinstance(node, ast.Constant) and node.value in (INDEX, LAYOUT_FILE)
                listed = isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(
                    isinstance(e, ast.Constant) and e.value in ARTIFACT_FILES for e in node.elts) >= 2
                if named or listed:
                    found.append(f"{path.relative_to(repo)}:{node.lineno}")
    assert not found, f"artifact file names written out again (import them from infer.runtime.artifact): {found}"
