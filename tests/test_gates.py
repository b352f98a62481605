"""Accuracy gates in infer-build, infer-eval, JUnit, the build report and multirun comparisons.

The "variant" here is the embedded model in bfloat16 gated against its float32 baseline (the
same recipe unquantized, at eval.baseline_dtype=float32), with small evaluation windows.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import run_cli
from infer.runtime.artifact import verify_artifact

SMALL = ["eval.seq_len=128", "eval.stride=128", "eval.max_windows=2", "eval.max_prompts=2", "eval.greedy_tokens=8"]
BF16 = ["model.dtype=bfloat16", "eval.baseline_dtype=float32", *SMALL]


@pytest.fixture(scope="module")
def passing_build(tmp_path_factory, cache_dir, embedded_artifact):
    out = tmp_path_factory.mktemp("gated") / "bf16"
    junit = out.parent / "junit.xml"
    proc = run_cli("infer-build", f"output_dir={out}", f"cache_dir={cache_dir}", *BF16,
                   "eval.gates.ppl_increase_pct=2", "eval.gates.top1_agreement_min=0.9", f"eval.junit={junit}",
                   timeout=900)
    return out, junit, proc


def test_passing_build_publishes_a_gated_artifact_with_its_report(passing_build):
    out, junit, proc = passing_build
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert "gate ppl_increase_pct passed" in proc.stderr and "gate top1_agreement_min passed" in proc.stderr
    manifest = verify_artifact(out).manifest  # eval files are sealed into the manifest like any other file
    for name in ("eval.json", "report.md", "report.html", "plots/metrics.png", "plots/layer_hidden_error.png"):
        assert name in manifest["files"], name
    assert manifest["evaluation"]["passed"] is True and "gate" in manifest["stages"] and "eval" in manifest["stages"]
    doc = json.loads((out / "eval.json").read_text())
    assert doc["passed"] is True
    c = doc["evaluation"]["comparison"]
    assert 0 < c["mean_kld"] < 0.05 and 0.9 <= c["top1_agreement"] < 1.0 and abs(c["ppl_increase_pct"]) < 2
    assert 0.0 <= c["greedy_agreement"] <= 1.0 and c["prompts"] == 2
    # the chat prompts' answers, read by both models: bfloat16 moves them a little
    assert 0 < c["chat_mean_kld"] < 0.05 and 0.8 <= c["chat_top1_agreement"] <= 1.0 and c["chat_tokens"] > 0
    assert doc["evaluation"]["baseline"]["model"]["dtype"] == "float32"
    assert [s["name"] for s in doc["stages"] if s["role"] == "artifact"] == ["load", "package", "tune"]
    assert any(s["role"] == "baseline" for s in doc["stages"]) and any(s["name"] == "eval" for s in doc["stages"])
    report = (out / "report.md").read_text()
    for needle in ("ppl_increase_pct", "top1_agreement_min", "PASS", "## Stages", "## Quantization", "## Recipe",
                   "plots/metrics.png"):
        assert needle in report, needle
    assert "<img src='plots/metrics.png'" in (out / "report.html").read_text()
    assert (out / "plots" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert len(cases) == 6 and cases["ppl_increase_pct"].find("failure") is None
    assert cases["mean_kld_max"].find("skipped") is not None
    print(f"\nbf16 vs fp32: ppl {doc['evaluation']['perplexity']['ppl']:.4f} vs "
          f"{doc['evaluation']['baseline_perplexity']['ppl']:.4f} ({c['ppl_increase_pct']:+.3f}%), "
          f"mean KLD {c['mean_kld']:.6f}, top-1 {c['top1_agreement']:.4f}, greedy {c['greedy_agreement']:.3f}")


def test_failing_gate_exits_3_names_the_gate_and_publishes_nothing(passing_build, tmp_path, cache_dir):
    out = tmp_path / "never"
    junit = tmp_path / "ci" / "gates.xml"
    proc = run_cli("infer-build", f"output_dir={out}", f"cache_dir={cache_dir}", *BF16,
                   "eval.gates.ppl_increase_pct=-100", "eval.gates.top1_agreement_min=0.5", f"eval.junit={junit}",
                   timeout=900)
    assert proc.returncode == 3, proc.stderr
    assert "stage eval      cached" in proc.stderr  # the evaluation is cached; thresholds only decide
    err = proc.stderr
    assert "ppl_increase_pct" in err and "threshold <= -100%" in err and "ppl_increase_pct = " in err
    assert "Nothing was published" in err
    assert not out.exists() and proc.stdout.strip() == ""
    failed = out.with_name(out.name + ".gate-failed")
    assert (failed / "report.md").is_file() and not (failed / "manifest.json").exists()
    assert "FAIL" in (failed / "report.md").read_text()
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["ppl_increase_pct"].find("failure") is not None
    assert "-100" in cases["ppl_increase_pct"].find("failure").get("message")
    assert cases["top1_agreement_min"].find("failure") is None


def test_failing_gate_leaves_an_earlier_good_artifact_untouched(passing_build, cache_dir):
    out, _, _ = passing_build
    before = (out / "manifest.json").read_bytes()
    proc = run_cli("infer-build", f"output_dir={out}", f"cache_dir={cache_dir}", *BF16, "eval.gates.mean_kld_max=0",
                   timeout=900)
    assert proc.returncode == 3 and "mean_kld_max" in proc.stderr
    assert (out / "manifest.json").read_bytes() == before
    verify_artifact(out)


def test_bad_gate_value_is_a_bad_recipe(cache_dir):
    proc = run_cli("infer-build", f"cache_dir={cache_dir}", "eval.gates.top1_agreement_min=1.5")
    assert proc.returncode == 2 and "eval.gates.top1_agreement_min" in proc.stderr


def test_infer_eval_on_any_artifact(passing_build, embedded_artifact, tmp_path):
    out, _, _ = passing_build
    junit, results = tmp_path / "j.xml", tmp_path / "r.json"
    # the artifact against itself: exact agreement, and the CLI's outputs
    proc = run_cli("infer-eval", str(embedded_artifact), "--baseline", str(embedded_artifact), "--max-windows", "2",
                   "--seq-len", "64", "--gate", "top1_agreement_min=0.99", "--junit", str(junit), "--json", str(results),
                   "--report", str(tmp_path / "report"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "perplexity" in proc.stdout and "PASS gate top1_agreement_min" in proc.stdout
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr  # no progress bars off a terminal
    doc = json.loads(results.read_text())
    assert doc["evaluation"]["comparison"]["top1_agreement"] == 1.0 and doc["passed"] is True
    assert (tmp_path / "report" / "report.html").is_file()
    assert len(list(ET.parse(junit).getroot().iter("testcase"))) == 6
    # an impossible gate: exit 3 with the gate named
    bad = run_cli("infer-eval", str(embedded_artifact), "--max-windows", "1", "--seq-len", "32",
                  "--gate", "greedy_agreement_min=1", timeout=600)
    assert bad.returncode == 3 and "greedy_agreement_min" in bad.stderr and "no baseline" in bad.stderr
    # a tampered or missing artifact is refused before any work
    missing = run_cli("infer-eval", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not an artifact directory" in missing.stderr


def test_multirun_sweep_writes_one_comparison_report(passing_build, cache_dir, tmp_path):
    sweep = tmp_path / "sweep"
    # float32 is its own baseline (top-1 agreement 1); bfloat16 fails a 0.99 gate but the sweep goes on
    proc = run_cli("infer-build", "-m", "model.dtype=bfloat16,float32", f"cache_dir={cache_dir}",
                   f"output_dir={tmp_path}/out-${{hydra:job.num}}", "eval.baseline_dtype=float32", *SMALL,
                   "eval.gates.top1_agreement_min=0.99", f"hydra.sweep.dir={sweep}", timeout=900)
    assert proc.returncode == 3, proc.stderr
    assert "gates failed for 1 variant(s) of the sweep" in proc.stderr
    assert (tmp_path / "out-1" / "eval.json").is_file() and not (tmp_path / "out-0").exists()
    table = (sweep / "comparison.md").read_text()
    assert "0: bfloat16" in table and "1: float32" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| 0:") or line.startswith("| 1:")}
    assert rows["0: bfloat16"].rstrip(" |").endswith("FAIL") and rows["1: float32"].rstrip(" |").endswith("PASS")
    assert (sweep / "comparison.html").is_file() and (sweep / "plots" / "comparison.png").is_file()
    assert len(list((sweep / "variants").glob("*.json"))) == 2


# ---------------------------------------------------------------------------- gates on chat prompts

_BROKEN_BUILD = '''
import sys
from safetensors.torch import load_file, save_file
import infer.pipeline.quantize as q

real = q.quantize


def broken(checkpoint, out, cfg, plan, windows):  # the scheme the recipe asks for, with corrupted scales
    info = real(checkpoint, out, cfg, plan, windows)
    state = load_file(out / "model.safetensors")
    for k in state:
        if k.endswith("mlp.down_proj.weight_scale"):
            state[k] = state[k] * 3.0
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return info


q.quantize = broken
from infer.pipeline.cli import main
sys.argv = ["infer-build", *sys.argv[1:]]
main()
'''

CHAT_SMALL = ["eval.seq_len=64", "eval.stride=64", "eval.max_windows=1", "eval.max_prompts=4", "eval.greedy_tokens=12"]


def test_chat_gates_fail_a_broken_build_with_exit_3(embedded_artifact, tmp_path):
    """FP8 (data-free, seconds) with every down_proj's weight scales tripled after quantization: the chat
    gates alone are set, and they stop it (exit 3, the gates named, nothing published)."""
    import subprocess
    import sys

    from conftest import REPO

    out, junit = tmp_path / "broken", tmp_path / "junit.xml"
    args = ["recipe=smollm2_135m_fp8", f"model.source={embedded_artifact}", "quant.ignore=[lm_head]",
            f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}", *CHAT_SMALL,
            "eval.gates.chat_top1_agreement_min=0.8", "eval.gates.chat_mean_kld_max=0.1", f"eval.junit={junit}"]
    proc = subprocess.run([sys.executable, "-c", _BROKEN_BUILD, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=900)
    assert proc.returncode == 3, proc.stderr[-3000:]
    err = proc.stderr
    assert "gate chat_top1_agreement_min FAILED" in err and "gate chat_mean_kld_max FAILED" in err, err[-3000:]
    assert "Nothing was published" in err and not out.exists()
    doc = json.loads((out.with_name(out.name + ".gate-failed") / "eval.json").read_text())
    c = doc["evaluation"]["comparison"]
    assert c["chat_top1_agreement"] < 0.8 and c["chat_mean_kld"] > 0.1 and c["chat_tokens"] > 0
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["chat_top1_agreement_min"].find("failure") is not None
    assert cases["ppl_increase_pct"].find("skipped") is not None  # only the chat gates were set
    print(f"\nbroken fp8 on chat prompts: top-1 {c['chat_top1_agreement']:.3f}, KLD {c['chat_mean_kld']:.3f}, "
          f"greedy {c['greedy_agreement']:.3f}")
