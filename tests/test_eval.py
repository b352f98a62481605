"""infer.eval's metrics, lm-eval adapter and local tasks, against independent references."""

from __future__ import annotations

import json
import math
import socket
import xml.etree.ElementTree as ET

import pytest
import torch

from infer.eval.gates import evaluate_gates, failure_message, junit_xml
from infer.eval.metrics import (EvalSettings, Window, engine_perplexity, greedy_agreement, load_prompts, load_windows,
                                make_windows)


# ---------------------------------------------------------------- windows and gates (pure)
def test_windows_score_every_token_once():
    ids = list(range(1000))
    wins = make_windows(ids, seq_len=128, stride=128, max_windows=100)
    assert [len(w.ids) for w in wins[:-1]] == [128] * (len(wins) - 1) and all(w.score_from == 1 for w in wins)
    wins = make_windows(ids, seq_len=128, stride=64, max_windows=100)
    scored = [w.ids[j] for w in wins for j in range(w.score_from, len(w.ids))]
    assert scored == list(range(1, 1000))  # overlapping windows: each token scored once, with >= 64 of context
    assert all(w.score_from == 64 for w in wins[1:])
    assert len(make_windows(ids, 128, 128, 3)) == 3


def _evaluation(ppl=10.2, base=10.0, top1=0.95, kld=0.01):
    return {"perplexity": {"ppl": ppl}, "baseline_perplexity": {"ppl": base},
            "comparison": {"ppl_increase_pct": (ppl / base - 1) * 100, "top1_agreement": top1, "mean_kld": kld,
                           "greedy_agreement": 1.0}}


def test_gates_verdicts_messages_and_junit():
    results = evaluate_gates({"ppl_increase_pct": 1.0, "top1_agreement_min": 0.9, "mean_kld_max": None}, _evaluation())
    by = {r.name: r for r in results}
    assert by["ppl_increase_pct"].passed is False and by["top1_agreement_min"].passed is True
    assert by["mean_kld_max"].passed is None and by["greedy_agreement_min"].passed is None
    msg = failure_message(results)
    assert "ppl_increase_pct" in msg and "2%" in msg and "<= 1%" in msg  # the gate, the value, the threshold
    root = ET.fromstring(junit_xml(results))
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"ppl_increase_pct", "top1_agreement_min", "mean_kld_max", "greedy_agreement_min",
                          "chat_top1_agreement_min", "chat_mean_kld_max"}
    assert cases["ppl_increase_pct"].find("failure") is not None
    assert cases["top1_agreement_min"].find("failure") is None and cases["top1_agreement_min"].find("skipped") is None
    assert cases["mean_kld_max"].find("skipped") is not None
    assert root.get("failures") == "1"
    # a gate that needs a baseline fails (never passes silently) when there is none
    no_base = evaluate_gates({"top1_agreement_min": 0.5}, {"perplexity": {"ppl": 3.0}})
    assert no_base[1].passed is False and "no baseline" in no_base[1].message


def test_greedy_agreement_is_common_prefix_share():
    g = greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [5, 6]])
    assert g["greedy_agreement"] == pytest.approx((2 / 4 + 1.0) / 2) and g["greedy_exact_match"] == 0.5
    assert len(load_prompts("default", 100)) >= 8


# ---------------------------------------------------------------- the engine against transformers
def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_engine_perplexity_matches_transformers(embedded_llm, hf_reference):
    model, _ = hf_reference
    settings = EvalSettings(seq_len=128, stride=128, max_windows=4)
    windows, info = load_windows(embedded_llm.tokenizer, settings)
    assert info["windows"] == 4 and info["tokens_scored"] == 4 * 127
    ours = engine_perplexity(embedded_llm, windows)
    nll, n = 0.0, 0
    for w in windows:
        lp = _hf_logprobs(model, w.ids)
        for j in range(w.score_from, len(w.ids)):
            nll -= lp[j - 1, w.ids[j]].item()
            n += 1
    ref = math.exp(nll / n)
    assert n == ours["tokens"]
    assert abs(ours["ppl"] / ref - 1) < 1e-3, (ours["ppl"], ref)  # within 0.1%
    print(f"\nengine perplexity {ours['ppl']:.4f}, transformers {ref:.4f} ({(ours['ppl'] / ref - 1) * 100:+.4f}%)")


def test_compare_distributions_of_a_model_with_itself_is_zero(embedded_llm):
    from infer.eval.metrics import compare_distributions

    model = embedded_llm.engine.model
    w = [Window(list(range(100, 164)), 1)]
    c = compare_distributions(model, model, w)
    assert c["mean_kld"] == pytest.approx(0.0, abs=1e-7) and c["top1_agreement"] == 1.0
    assert c["ppl_variant"] == pytest.approx(c["ppl_baseline"]) and c["rms_delta_p"] == pytest.approx(0.0, abs=1e-7)
    assert c["layer_hidden_error"] is not None and max(c["layer_hidden_error"]) < 1e-6


# ---------------------------------------------------------------- the lm-eval adapter
@pytest.fixture(scope="module")
def adapter(embedded_llm):
    from infer.eval.lm_adapter import InferLM

    return InferLM(embedded_llm, max_length=64)


def _instance(kind, args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_adapter_loglikelihoods_equal_a_direct_computation(adapter, hf_reference):
    model, tok = hf_reference
    pairs = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b"),
             ("Water freezes at zero degrees", " Celsius.")]
    got = adapter.loglikelihood([_instance("loglikelihood", p) for p in pairs])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
        n_ctx = len(tok(ctx, add_special_tokens=False)["input_ids"])
        lp = _hf_logprobs(model, whole)
        ref = sum(lp[j - 1, whole[j]].item() for j in range(n_ctx, len(whole)))
        ref_greedy = all(lp[j - 1].argmax().item() == whole[j] for j in range(n_ctx, len(whole)))
        assert ll == pytest.approx(ref, abs=2e-3), (ctx, ll, ref)
        assert greedy == ref_greedy

    # rolling: a text longer than the adapter's 64-token window, scored in disjoint windows
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = "Python is a programming language that lets you work quickly and integrate systems more effectively. " * 4
    (rolled,) = adapter.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 64
    ref = 0.0
    for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(ids, adapter.prefix_token_id, 64, 1)):
        whole = ctx + pred
        lp = _hf_logprobs(model, whole)
        ref += sum(lp[j - 1, whole[j]].item() for j in range(len(ctx), len(whole)))
    assert rolled == pytest.approx(ref, abs=5e-3)


def test_adapter_generate_until_stops_at_the_stop_string(adapter, hf_reference):
    model, tok = hf_reference
    ctx = "Question: What is the capital of France?\nAnswer:"
    (text,) = adapter.generate_until([_instance("generate_until", (ctx, {"until": ["\n"], "max_gen_toks": 12}))])
    ids = tok(ctx, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    ref = tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]
    assert "\n" not in text and text == ref


# ---------------------------------------------------------------- local tasks, offline
def test_local_tasks_run_offline(adapter, monkeypatch):
    from infer.eval.lm_adapter import run_tasks

    def no_network(*args, **kwargs):
        raise OSError("network access attempted during an offline evaluation")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    res = run_tasks(adapter, ["infer_lastword", "infer_mc"], limit=2)
    assert set(res) == {"infer_lastword", "infer_mc"}
    assert 0.0 <= res["infer_mc"]["acc"] <= 1.0 and res["infer_mc"]["sample_len"] == 2
    assert res["infer_lastword"]["perplexity"] > 1.0 and 0.0 <= res["infer_lastword"]["acc"] <= 1.0
    json.dumps(res)  # plain data, as eval.json stores it


# ---------------------------------------------------------------- chat prompts
def test_chat_prompts_are_rendered_as_a_chat_request_and_compared_on_the_answers(embedded_llm, hf_reference):
    from infer.eval.metrics import chat_prompt_ids, compare_on_chat

    _, tok = hf_reference
    prompts = load_prompts("default", 3)
    ids = chat_prompt_ids(embedded_llm.tokenizer, prompts)
    for p, got in zip(prompts, ids):  # transformers' own rendering of the same request
        want = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert got == list(want)
        assert got[0] == 1 and tok.decode(got, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")
    c = compare_on_chat(embedded_llm, embedded_llm, prompts, 12)
    assert c["chat_template"] is True and c["prompts"] == 3 and c["greedy_agreement"] == 1.0
    assert c["chat_mean_kld"] == pytest.approx(0.0, abs=1e-7) and c["chat_top1_agreement"] == 1.0
    assert 3 <= c["chat_tokens"] <= 3 * 12  # the answers' tokens, each scored once
    answer = embedded_llm.generate([ids[0]], __import__("infer.runtime", fromlist=["SamplingParams"]).SamplingParams(
        temperature=0.0, max_tokens=12))[0].text
    assert answer.startswith("The capital of France is Paris"), answer


def test_a_baseline_too_large_to_sit_beside_runs_first_alone_with_the_same_metrics(tiny_artifact, embedded_artifact):
    """A baseline whose weights do not fit beside the artifact's (a bfloat16 7B beside its int4 build) is run
    first, alone, its distributions kept on disk: every metric equals the one computed with both loaded."""
    from infer.eval.metrics import evaluate

    s = EvalSettings(seq_len=64, stride=48, max_windows=2, max_prompts=2, greedy_tokens=6)
    said: list[str] = []
    together = evaluate(tiny_artifact, embedded_artifact, s, memory_bytes=1 << 40)
    apart = evaluate(tiny_artifact, embedded_artifact, s, log=lambda m, *a: said.append(m % a), memory_bytes=1)
    assert any("the baseline runs first, alone" in m for m in said), said
    assert apart["perplexity"]["ppl"] == together["perplexity"]["ppl"]
    assert apart["baseline_perplexity"]["ppl"] == together["baseline_perplexity"]["ppl"]
    a, t = apart["comparison"], together["comparison"]
    assert t["mean_kld"] > 0.1  # two different models: the comparison has something to get right
    for k in ("tokens", "top1_agreement", "prompts", "greedy_agreement", "chat_tokens", "chat_top1_agreement"):
        assert a[k] == t[k], k
    for k in ("mean_kld", "p99_kld", "max_kld", "ln_ppl_ratio", "rms_delta_p", "chat_mean_kld", "ppl_increase_pct"):
        assert a[k] == pytest.approx(t[k], rel=1e-9, abs=1e-12), k
    assert a["layer_hidden_error"] is None and a["per_window"] == t["per_window"]
