"""The tune stage and the runtime's use of its table: the decision rule, a table from another
machine ignored with a warning, a matching table followed, and byte-identical builds with tune.table."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from infer.runtime import tuning, tuning_measure
from infer.runtime.tuning import Tuning, bucket_for
from infer.runtime.tuning_measure import decide


def t(min_s: float, median_s: float | None = None) -> dict:
    return {"min": min_s, "median": median_s if median_s is not None else min_s}


def test_the_rule_leaves_the_default_only_for_a_clear_win():
    order = ("cpp", "torch-sdpa")
    assert decide({"cpp": t(1.0), "torch-sdpa": t(0.95)}, "cpp", order) == "cpp"  # 5%: within the margin
    assert decide({"cpp": t(1.0), "torch-sdpa": t(0.85)}, "cpp", order) == "torch-sdpa"
    # a lucky fastest run with a slow median does not move it
    assert decide({"cpp": t(1.0, 1.0), "torch-sdpa": t(0.5, 1.2)}, "cpp", order) == "cpp"
    # the default wins ties, and among others the fixed order decides
    three = ("amx", "onednn", "torch")
    assert decide({"amx": t(0.5), "onednn": t(0.5), "torch": t(1.0)}, "torch", three) == "amx"
    assert decide({"amx": t(1.0), "onednn": t(1.0)}, "onednn", three) == "onednn"


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8, 100)] == [1, 2, 4, 8, 8, 8]


def _table(hardware: dict, dtype: str = "bfloat16") -> dict:
    """A table choosing what the defaults are not: plain torch for the MLP's down projection, gather +
    SDPA for one decode, one thread for small steps."""
    entry = lambda default, choice: {"seconds": {}, "default": default, "choice": choice}  # noqa: E731
    timed = {kernel: {} for kernel in tuning_measure.LINEAR_ORDER}  # every linear kernel there is was timed
    return {"format": tuning.FORMAT, "version": tuning.VERSION, "hardware": hardware, "buckets": [1, 4, 64],
            "rule": tuning_measure.RULE, "dtype": dtype,
            "linear": {f"1536x576:{dtype}": {**entry("onednn", "torch"), "seconds": timed}},
            "decode_attention": {"1": entry("cpp", "torch-sdpa"), "4": entry("cpp", "cpp"), "64": entry("cpp", "cpp")},
            "threads": {"1": entry("2", "1"), "4": entry("2", "1"), "64": entry("2", "2")}}


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory, embedded_artifact, cache_dir):
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    out = tmp_path_factory.mktemp("tune") / "bf16"
    return build(compose_recipe([f"model.source={embedded_artifact}", "model.dtype=bfloat16", "tune.enabled=false",
                                 f"output_dir={out}", f"cache_dir={cache_dir}"])).artifact


def test_a_table_from_other_hardware_is_ignored_with_one_warning_naming_what_differs(bf16_artifact, tmp_path, caplog):
    from infer.runtime import LLM

    other = {**tuning.hardware(), "cpu": "Some Other CPU", "amx": not tuning.hardware()["amx"]}
    path = tuning.write(_table(other), tmp_path / "other.json")
    with caplog.at_level(logging.WARNING, logger="infer.tuning"):
        llm = LLM(bf16_artifact, tuning=str(path), kv_cache_memory=64 << 20)
    warnings = [r.getMessage() for r in caplog.records if r.name == "infer.tuning"]
    assert len(warnings) == 1 and "Some Other CPU" in warnings[0] and "amx" in warnings[0], warnings
    assert llm.engine.tuning is None
    assert type(llm.engine.model.layers[0].mlp.down_proj).__name__ == "PackedLinear"  # the defaults


def test_a_table_measured_in_another_dtype_is_ignored_with_one_warning(bf16_artifact, tmp_path, caplog):
    """The default build's table times float32 steps: a bfloat16 engine (infer-run --dtype bfloat16 on such an
    artifact) followed its decode-attention and thread choices, which were never timed for its kernels."""
    from infer.runtime import LLM

    path = tuning.write(_table(tuning.hardware(), dtype="float32"), tmp_path / "float32.json")
    with caplog.at_level(logging.WARNING):
        llm = LLM(bf16_artifact, tuning=str(path), kv_cache_memory=64 << 20)
    warnings = [r.getMessage() for r in caplog.records if "tuning table measured in" in r.getMessage()]
    assert len(warnings) == 1 and "float32" in warnings[0] and "--dtype bfloat16 --retune" in warnings[0], warnings
    assert llm.engine.tuning is None and llm.engine.plan.tuning is None
    same = LLM(bf16_artifact, tuning=str(tuning.write(_table(tuning.hardware()), tmp_path / "bf16.json")),
               kv_cache_memory=64 << 20)
    assert same.engine.tuning is not None  # measured in bfloat16: followed


def test_a_linear_choice_timed_without_a_kernel_this_runtime_has_is_not_followed(bf16_artifact, tmp_path, caplog):
    """A table from before a kernel existed chose among fewer: its choice for that shape is stale."""
    from infer.runtime import LLM

    table = _table(tuning.hardware())
    runs_here = LLM(bf16_artifact, tuning="off", kv_cache_memory=64 << 20).engine.model.layers[0].mlp.down_proj.kernel
    table["linear"]["1536x576:bfloat16"]["seconds"] = {"torch": {}}  # timed against torch alone
    path = tuning.write(table, tmp_path / "old.json")
    with caplog.at_level(logging.WARNING, logger="infer.tuning"):
        llm = LLM(bf16_artifact, tuning=str(path), kv_cache_memory=64 << 20)
    warnings = [r.getMessage() for r in caplog.records if r.name == "infer.tuning"]
    assert len(warnings) == 1 and "1536x576" in warnings[0] and runs_here in warnings[0], warnings
    assert llm.engine.model.layers[0].mlp.down_proj.kernel == runs_here  # the default, not the stale "torch"


def test_a_matching_table_is_followed_and_changes_no_output(bf16_artifact, tmp_path):
    from infer.runtime import LLM, SamplingParams

    path = tuning.write(_table(tuning.hardware()), tmp_path / "here.json")
    tuned = LLM(bf16_artifact, tuning=str(path), kv_cache_memory=64 << 20)
    plain = LLM(bf16_artifact, tuning="off", kv_cache_memory=64 << 20)
    assert tuned.engine.tuning is not None and plain.engine.tuning is None
    assert type(tuned.engine.model.layers[0].mlp.down_proj) is torch.nn.Linear  # the table's "torch"
    assert type(tuned.engine.model.layers[0].mlp.gate_up_proj).__name__ == "PackedLinear"  # not in the table
    runner = tuned.engine.runner
    seen = []
    original = runner._context

    def spy(inputs):
        ctx = original(inputs)
        seen.append((len(inputs.input_ids), ctx.decode_kernel is None, torch.get_num_threads()))
        return ctx

    runner._context = spy
    threads_before = torch.get_num_threads()
    params = SamplingParams(max_tokens=6, temperature=0)
    try:
        one = tuned.generate(["The capital of France is"], params)[0]
    finally:
        runner._context = original
        torch.set_num_threads(threads_before)
    decodes = [s for s in seen[1:]]  # after the prompt step, one decode a step
    assert decodes and all(no_kernel for _, no_kernel, _ in decodes)  # gather + SDPA at one decode
    assert one.token_ids == plain.generate(["The capital of France is"], params)[0].token_ids
    assert Tuning.load(path).changed() == ["linear[1536x576:bfloat16]: onednn -> torch",
                                           "decode_attention[1]: cpp -> torch-sdpa",
                                           "threads[1]: 2 -> 1", "threads[4]: 2 -> 1"]


def test_measure_times_every_candidate_and_records_the_hardware(bf16_artifact):
    from infer.kernels import isa
    from infer.kernels.onednn import can_pack

    table = tuning_measure.measure(bf16_artifact, [1, 4])
    assert table["hardware"] == tuning.hardware() and table["buckets"] == [1, 4]
    assert table["hardware"]["cpu_class"] == isa.active()
    # every alternative this class has: plain torch, oneDNN's layout where it packs bfloat16 (AVX-512), AMX tiles
    # on amx, else the column blocks from AVX2 up (the resolver loads one or the other: kernels/resolver.py)
    tiles = {"amx"} if isa.active() == "amx" else {"blocks"} if isa.at_least("avx2") else set()
    want = {"torch"} | ({"onednn"} if can_pack(torch.bfloat16) else set()) | tiles
    for key, entry in table["linear"].items():
        assert set(entry["seconds"]) >= want and entry["choice"] in entry["seconds"], key
        assert all(set(per) == {"1", "4"} for per in entry["seconds"].values())
    # the paged kernel's float path beside its vdpbf16ps dots where the build has them (a bfloat16 model)
    from infer.kernels import cpu_attention

    attention = {"cpp", "torch-sdpa"} | ({"cpp-float"} if cpu_attention.load().has_bf16_dots() else set())
    assert set(table["decode_attention"]) == {"1", "4"}
    for entry in table["decode_attention"].values():
        assert set(entry["seconds"]) == attention and entry["choice"] in entry["seconds"]
        assert all(v["min"] <= v["median"] for v in entry["seconds"].values())


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_builds_write_a_table_and_tune_table_makes_them_byte_identical(tmp_path, embedded_artifact):
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe
    from infer.runtime.artifact import verify_artifact

    def make(name: str, *extra: str) -> Path:
        return build(compose_recipe([f"model.source={embedded_artifact}", "tune.batch_buckets=[1,2]",
                                     f"output_dir={tmp_path / name}", f"cache_dir={tmp_path / ('cache-' + name)}",
                                     *extra])).artifact

    a, b = make("a"), make("b")  # two fresh caches: measured twice
    manifest = verify_artifact(a).manifest
    assert "tuning.json" in manifest["files"] and manifest["tuning"]["source"] == "measured"
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys()
    assert {n for n in fa if fa[n] != fb[n]} <= {"tuning.json", "manifest.json"}
    c, d = make("c", f"tune.table={a / 'tuning.json'}"), make("d", f"tune.table={a / 'tuning.json'}")
    assert _files(c) == _files(d)
    assert json.loads((c / "tuning.json").read_text()) == json.loads((a / "tuning.json").read_text())
    assert verify_artifact(c).manifest["tuning"]["source"] == "tune.table"


def test_a_bad_tune_table_fails_the_build_naming_the_key(tmp_path, embedded_artifact):
    from infer.pipeline.build import BuildError, build
    from infer.pipeline.config import compose_recipe

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(BuildError, match="tune.table"):
        build(compose_recipe([f"model.source={embedded_artifact}", f"tune.table={bad}",
                              f"output_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"]))
    assert not (tmp_path / "out").exists()
