"""The embedded model, through the artifact, against transformers on the same files."""

import pytest
import torch

from conftest import run_cli
from infer.runtime.model import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "In 1969, 3 astronauts flew to the Moon; 2 of them walked on it.",
    "Les feuilles mortes se ramassent à la pelle, les souvenirs et les regrets aussi.",
]


@pytest.fixture(scope="module")
def ours(embedded_artifact):
    return load_model(embedded_artifact)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours, hf_reference, prompt):
    model, tok = hf_reference
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        expected = model(ids).logits
    got = ours.logits(ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_infer_run_answers_with_paris(embedded_artifact):
    run = run_cli("infer-run", str(embedded_artifact), "--prompt", "What is the capital of France?")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout


def test_infer_run_max_tokens_and_raw(embedded_artifact, embedded_llm):
    run = run_cli("infer-run", str(embedded_artifact), "--prompt", "The capital of France is", "--raw",
                  "--max-tokens", "3")
    assert run.returncode == 0, run.stderr
    n = len(embedded_llm.tokenizer.encode(run.stdout.rstrip("\n")))
    assert 1 <= n <= 3
    assert "Paris" in run.stdout  # raw continuation, no chat template


def test_chat_template_from_chat_template_jinja(embedded_artifact, tmp_path):
    """transformers 5 (and so llm-compressor's output) saves the template beside tokenizer_config.json."""
    import json
    import shutil

    from infer.runtime.engine.tokenizer import Tokenizer

    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copyfile(embedded_artifact / name, tmp_path / name)
    cfg = json.loads((embedded_artifact / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(cfg.pop("chat_template"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = Tokenizer(embedded_artifact).apply_chat_template(messages)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")
