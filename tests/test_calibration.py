"""Calibration windows that cover what the model is asked: chat-formatted samples (the model's chat
template, special tokens included) mixed with raw text, a user's conversations, determinism and
the manifest record. Token-level only: no calibration runs here (tests/test_quant.py builds)."""

from __future__ import annotations

import json
import shutil

import pytest

from infer.pipeline.config import RecipeError, compose_recipe


def _windows(overrides, tokenizer_dir):
    from infer.pipeline.quantize import calibration_windows

    return calibration_windows(compose_recipe(["recipe=smollm2_135m_gptq", *overrides]), tokenizer_dir)


@pytest.fixture(scope="module")
def tok(embedded_artifact):
    from infer.runtime.engine.tokenizer import Tokenizer

    return Tokenizer(embedded_artifact)


def test_chat_windows_carry_the_templates_special_tokens(embedded_artifact, tok):
    im_start, im_end = tok._tok.token_to_id("<|im_start|>"), tok._tok.token_to_id("<|im_end|>")
    assert (im_start, im_end) == (1, 2)
    windows, rec = _windows(["calib.samples=10", "calib.seq_len=128", "calib.chat_fraction=0.5"], embedded_artifact)
    assert len(windows) == 10 and all(len(w) == 128 for w in windows)
    raw, chat = windows[:5], windows[5:]
    assert rec["raw_samples"] == 5 and rec["chat"]["samples"] == 5 and rec["samples"] == 10
    assert rec["chat"]["source"] == "built from calib.data documents" and len(rec["chat"]["template_sha256"]) == 64
    for w in chat:  # a chat request's first tokens: <|im_start|>system\n ... <|im_end|> ... <|im_start|>user
        assert w[0] == im_start and w.count(im_start) >= 2 and im_end in w, w[:8]
        text = tok.decode(w, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in text
    assert not any(im_start in w or im_end in w for w in raw)  # raw text has no special tokens
    # deterministic, and the record names exactly these tokens
    again, rec2 = _windows(["calib.samples=10", "calib.seq_len=128", "calib.chat_fraction=0.5"], embedded_artifact)
    assert again == windows and rec2 == rec
    other, rec3 = _windows(["calib.samples=10", "calib.seq_len=128", "calib.seed=1"], embedded_artifact)
    assert rec3["tokens_sha256"] != rec["tokens_sha256"] and other != windows


def test_chat_fraction_mixes_and_zero_is_raw_text_only(embedded_artifact):
    from infer.eval.datasets import calibration_texts, token_windows
    from infer.runtime.engine.tokenizer import Tokenizer

    raw, rec = _windows(["calib.samples=6", "calib.seq_len=64", "calib.chat_fraction=0"], embedded_artifact)
    assert rec["chat"]["samples"] == 0 and rec["raw_samples"] == 6
    assert raw == token_windows(calibration_texts(), Tokenizer(embedded_artifact), 64, 6, 0)
    only_chat, rec = _windows(["calib.samples=6", "calib.seq_len=64", "calib.chat_fraction=1"], embedded_artifact)
    assert rec["raw_samples"] == 0 and all(w[0] == 1 for w in only_chat)
    _, rec = _windows(["calib.samples=7", "calib.seq_len=64", "calib.chat_fraction=0.3"], embedded_artifact)
    assert rec["chat"]["samples"] == 2 and rec["raw_samples"] == 5  # round(0.3 * 7)
    with pytest.raises(RecipeError, match="calib.chat_fraction"):
        compose_recipe(["recipe=smollm2_135m_gptq", "calib.chat_fraction=1.5"])


def test_a_users_jsonl_of_conversations(embedded_artifact, tmp_path, tok):
    from infer.pipeline.quantize import QuantError

    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 8}]} for i in range(12)]
    rows.append({"text": "A plain document next to the conversations. " * 40})
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    windows, rec = _windows([f"calib.data={data}", "calib.samples=4", "calib.seq_len=64"], embedded_artifact)
    assert rec["chat"]["source"] == "calib.data messages" and rec["chat"]["conversations"] == 12
    chat_text = [tok.decode(w, skip_special_tokens=False) for w in windows[rec["raw_samples"]:]]
    assert all(t.startswith("<|im_start|>system") and "Question" in t for t in chat_text)
    # the users' own turns, rendered with the generation template's roles
    assert any("<|im_start|>assistant\n" in t for t in chat_text)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    with pytest.raises(QuantError, match=r"calib.data=.*bad.jsonl: line 1: 'messages'"):
        _windows([f"calib.data={bad}", "calib.samples=2", "calib.seq_len=16"], embedded_artifact)


def test_no_chat_template_calibrates_on_raw_text_and_says_so(embedded_artifact, tmp_path):
    from infer.pipeline.quantize import QuantError

    plain = tmp_path / "tok"
    plain.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copyfile(embedded_artifact / name, plain / name)
    cfg = json.loads((embedded_artifact / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    windows, rec = _windows(["calib.samples=4", "calib.seq_len=64"], plain)
    assert rec["raw_samples"] == 4 and rec["chat"]["samples"] == 0 and "no chat template" in rec["chat"]["skipped"]
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi " * 50}]}) + "\n")
    with pytest.raises(QuantError, match="no chat template"):
        _windows([f"calib.data={data}", "calib.samples=2", "calib.seq_len=16"], plain)
