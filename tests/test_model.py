"""Our model against transformers on fresh random checkpoints (Llama and Qwen2 families)."""

import pytest
import torch
import transformers

from infer.runtime.model import ModelConfig, load_model


def _tiny_config(family: str, tie: bool):
    common = dict(
        vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=tie,
    )
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_random_checkpoint_matches_transformers(tmp_path, family, tie):
    cfg = _tiny_config(family, tie)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    with torch.no_grad():  # random biases too: HF initialises them to zero
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.dtype == torch.float64
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours.logits(ids).double()
    # both sides normalise and build rotary tables in float32, so float64 agrees to ~1e-7
    assert (got - expected).abs().max().item() < 1e-6


def test_unsupported_architecture_is_refused(tmp_path):
    cfg = {"model_type": "gpt_neox", "num_attention_heads": 4}
    with pytest.raises(ValueError, match="gpt_neox.*supported: llama, qwen2"):
        ModelConfig.from_hf(cfg)


def test_missing_rope_theta_is_refused():
    cfg = _tiny_config("llama", True).to_dict()
    cfg.pop("rope_theta", None)
    cfg.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig.from_hf(cfg)
