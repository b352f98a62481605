"""Our model against transformers on fresh random checkpoints in float64, every family of
runtime/model/families.py (tests/test_families.py builds them with infer-build and serves them)."""

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
    if family == "qwen3":  # q/k norms, head_dim apart from hidden / heads, biases on q/k/v/o
        return transformers.Qwen3Config(**common, head_dim=24, attention_bias=True)
    if family == "mistral":
        return transformers.MistralConfig(**common, head_dim=8, sliding_window=None)
    if family == "phi3":  # qkv_proj and gate_up_proj fused in the checkpoint
        return transformers.Phi3Config(**common, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama-yarn":  # YaRN with mscale (attention factor from mscale / mscale_all_dim), MLP biases
        return transformers.LlamaConfig(**{**common, "rope_theta": None}, mlp_bias=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "mscale": 0.9, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2})
    return transformers.LlamaConfig(**common)


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True),
                                        ("qwen3", False), ("mistral", True), ("phi3", False), ("llama-yarn", False)])
def test_random_checkpoint_matches_transformers(tmp_path, family, tie):
    cfg = _tiny_config(family, tie)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    with torch.no_grad():  # random biases too: HF initialises them to zero
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:  # q/k norms too: ones would hide a misplaced one
                p.normal_(1.0, 0.3)
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
    with pytest.raises(ValueError, match="gpt_neox.*supported: llama, qwen2, qwen3, mistral, phi3"):
        ModelConfig.from_hf(cfg)


def test_missing_rope_theta_is_refused():
    cfg = _tiny_config("llama", True).to_dict()
    cfg.pop("rope_theta", None)
    cfg.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig.from_hf(cfg)
