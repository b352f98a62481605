"""Accuracy-gated mixed precision for the 8-bit schemes: ``quant.auto`` on fp8 and w8a8 keeps the most
sensitive fused linears in float (they join ``quant.ignore``), in steps of the size budget, until the
gates pass; and the combinations it cannot do are refused before any work, naming the fix.

Builds run on a tiny random Llama with a few short calibration windows (seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quant_helpers import TINY_CALIB, TINY_EVAL, tiny_llama
from quant_helpers import build_recipe as _build
from quant_helpers import compose as _cfg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_artifact) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", embedded_artifact)


def _fused_parts(fused: str) -> list[str]:
    name = "model." + fused
    if name.endswith("qkv_proj"):
        return [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if name.endswith("gate_up_proj"):
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def test_shipped_auto_recipes_extend_the_8bit_recipes():
    fp8, fp8_auto = _cfg(["recipe=smollm2_135m_fp8"]), _cfg(["recipe=smollm2_135m_fp8_auto"])
    assert fp8_auto.quant.auto and fp8_auto.quant.ignore == fp8.quant.ignore  # one place: the fp8 recipe
    w8a8 = _cfg(["recipe=smollm2_135m_w8a8_auto"])
    assert w8a8.quant.auto and w8a8.quant.smoothing_strength == 0.8 and w8a8.quant.method.value == "w8a8"
    for c in (fp8_auto, w8a8):
        assert c.eval.gates.greedy_agreement_min == 0.8 and c.eval.gates.ppl_increase_pct == 2
        assert c.eval.gates.chat_top1_agreement_min == 0.9 and c.quant.size_budget_pct == 20


@pytest.mark.parametrize("method", ["fp8", "w8a8"])
def test_auto_keeps_the_most_sensitive_linears_in_float_until_the_gates_pass(tiny, tmp_path, method):
    from infer.pipeline.gate import GateFailed
    from infer.runtime.model import load_model
    from infer.runtime.model.quant_linear import quantized_modules

    recipe = [f"recipe=smollm2_135m_{method}_auto", f"model.source={tiny}", "quant.ignore=[lm_head]",
              "quant.size_budget_pct=2", *TINY_CALIB, *TINY_EVAL, "eval.gates.ppl_increase_pct=null",
              "eval.gates.top1_agreement_min=null", "eval.gates.chat_top1_agreement_min=null",
              "eval.gates.greedy_agreement_min=null"]
    if method == "w8a8":
        recipe.append("quant.smoothing_strength=0")
    cache = tmp_path / "cache"
    with pytest.raises(GateFailed) as err:  # an impossible gate: every step is built, gated and reported
        _build([*recipe, "eval.gates.chat_mean_kld_max=0"], tmp_path / "never", cache)
    sel = err.value.doc["selection"]
    rows = sel["candidates"]
    assert sel["key"] == "quant.ignore" and sel["wide_format"].startswith("float")
    assert rows[0]["candidate"] == "plain" and rows[0]["settings"] == {"quant.ignore": ["lm_head"]} and len(rows) >= 2
    assert len(sel["sensitivity"]) == 2 * 4 and all(v > 0 for v in sel["sensitivity"].values())
    plain = rows[0]["size_bytes"]
    assert sel["plain_size_bytes"] == plain
    for r in rows[1:]:  # each step larger than the last, never past the budget, each float layer costs a byte a weight more
        assert plain < r["size_bytes"] <= plain * 1.02 + 1, (r, plain)
        assert r["settings"]["quant.ignore"][0] == "lm_head" and len(r["settings"]["quant.ignore"]) > 1
    assert [r["size_bytes"] for r in rows] == sorted(r["size_bytes"] for r in rows)
    first = sel["order"][0]  # the most sensitive linear per byte is kept in float first
    assert set(_fused_parts(first)) <= set(rows[1]["settings"]["quant.ignore"]), (first, rows[1]["settings"])
    assert err.value.doc["plots"] and "plots/sensitivity.png" in err.value.doc["plots"]

    # a gate the plain build fails and the widest step passes: a widened candidate is published
    kld = [r["chat_mean_kld"] for r in rows]
    assert kld[-1] < kld[0], kld  # more float, closer to the float baseline
    threshold = (kld[0] + min(kld[1:])) / 2
    ok = _build([*recipe, f"eval.gates.chat_mean_kld_max={threshold}"], tmp_path / "ok", cache)
    manifest = json.loads((ok.artifact / "manifest.json").read_text())
    chosen = manifest["evaluation"]["selection"]
    assert chosen["chosen"] != "plain" and chosen["candidates"][0]["passed"] is False
    assert chosen["candidates"][-1]["passed"] is True and chosen["candidates"][-1]["chat_mean_kld"] <= threshold
    assert chosen["sensitivity"] == sel["sensitivity"] and chosen["wide_format"].startswith("float")
    ignore = manifest["recipe"]["quant"]["ignore"]
    assert manifest["recipe"]["quant"]["auto"] is False and len(ignore) > 1  # rebuilding it gives the same artifact
    qcfg = json.loads((ok.artifact / "config.json").read_text())["quantization_config"]
    assert set(ignore) <= set(qcfg["ignore"])
    backends = quantized_modules(load_model(ok.artifact))
    kept = {n for n in ignore if n != "lm_head"}
    assert kept and not any("model." + m in kept for m in backends)  # the float layers are plain linears
    # the recipe builds from the bfloat16 model: its 8-bit linears load on the 8-bit kernels (from avx2)
    assert set(backends.values()) == {"cpu-fp8-blocks" if method == "fp8" else "cpu-w8a8-blocks"}


def test_8bit_sensitivity_fake_quantizes_weights_and_activations(tiny):
    from infer.pipeline.quantize import fused_groups, layer_sensitivity, model_linears

    config = json.loads((tiny / "config.json").read_text())
    groups = fused_groups(config, [lin.name for lin in model_linears(config) if lin.name != "lm_head"])
    windows = [list(range(100, 132)), list(range(500, 532))]
    torch.manual_seed(0)
    fp8 = layer_sensitivity(tiny, None, windows, groups, fake_quant="fp8")
    w8a8 = layer_sensitivity(tiny, None, windows, groups, fake_quant="w8a8")
    assert set(fp8) == set(w8a8) == {name for name, _ in groups}
    assert all(v > 0 for v in fp8.values()) and fp8 != w8a8  # e4m3 (3 mantissa bits) is coarser than int8
    assert sum(fp8.values()) > sum(w8a8.values())


def test_auto_refuses_what_it_cannot_do_before_any_work(tiny, tmp_path):
    from infer.pipeline.build import BuildError

    cases = [
        (["recipe=smollm2_135m", "quant.auto=true", "eval=release"], r"method none quantizes nothing.*valid with"),
        (["recipe=smollm2_135m_w8a8", "quant.auto=true", "quant.ignore=[lm_head]"],
         r"quant.smoothing_strength=\[0.0, 0.5, 0.8\].*set one SmoothQuant strength"),
        (["recipe=smollm2_135m_fp8_auto", "quant.ignore=[lm_head]", "quant.wide_layers=[down_proj]"],
         r"stay in float.*remove quant.wide_layers"),
        (["recipe=smollm2_135m_gptq_auto", "quant.bits=8"], r"needs quant.bits=4.*w8a8 or fp8"),
        (["recipe=smollm2_135m_fp8", "quant.auto=true", "quant.ignore=[lm_head]"], r"quant.auto=true.*none is set"),
    ]
    for overrides, message in cases:
        with pytest.raises(BuildError, match=message):
            _build([*overrides, f"model.source={tiny}", *TINY_CALIB], tmp_path / "o", tmp_path / "c")
    assert not (tmp_path / "c" / "stages" / "quantize").exists()


def test_auto_steps_are_shares_of_the_budget_in_increasing_order():
    from infer.pipeline.config import RecipeError

    assert _cfg(["recipe=smollm2_135m_fp8_auto"]).quant.auto_steps == [0.25, 0.5, 1.0]
    assert _cfg(["recipe=smollm2_135m_w8a8_auto", "quant.auto_steps=[1.0]"]).quant.auto_steps == [1.0]
    for bad in ("[]", "[0.5,0.25]", "[0,1.0]", "[1.5]"):
        with pytest.raises(RecipeError, match="quant.auto_steps.*increasing shares"):
            _cfg(["recipe=smollm2_135m_fp8_auto", f"quant.auto_steps={bad}"])
