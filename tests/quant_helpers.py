"""Helpers for the quantization tests: quick compressed-tensors checkpoints and the comparisons."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from infer.runtime.artifact import TOKENIZER_FILES

# compressed-tensors schemes, named as the recipe methods that produce each format
RTN_SCHEMES = {
    "w4a16": {"weights": dict(num_bits=4, type="int", strategy="group", group_size=64, symmetric=True)},
    "w4a16_asym_g32": {"weights": dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)},
    "w8a16": {"weights": dict(num_bits=8, type="int", strategy="channel", symmetric=True)},
    "w8a8": {"weights": dict(num_bits=8, type="int", strategy="channel", symmetric=True),
             "input_activations": dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)},
    "fp8": {"weights": dict(num_bits=8, type="float", strategy="channel", symmetric=True),
            "input_activations": dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)},
}


def rtn_checkpoint(src: Path, out: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint of ``src`` by round-to-nearest (llm-compressor's data-free
    QuantizationModifier): the same file format GPTQ/AWQ/SmoothQuant write, in seconds."""
    import transformers
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if (out / "config.json").is_file():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = {k: QuantizationArgs(**v) for k, v in RTN_SCHEMES[scheme].items()}
    oneshot(model=model, recipe=[QuantizationModifier(
        config_groups={"g": QuantizationScheme(targets=["Linear"], **args)}, ignore=["lm_head"])], pipeline="datafree")
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, save_compressed=True)
    for n in TOKENIZER_FILES:
        if (src / n).is_file():
            shutil.copyfile(src / n, tmp / n)
    tmp.rename(out)
    return out


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |difference|, mean KL(ref || ours) per token and top-1 agreement of two [T, V] logit sets."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"max_abs": (ours - ref).abs().max().item(), "scale": ref.abs().max().item(),
            "mean_kl": kl.mean().item(), "top1": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def tiny_llama(out: Path, tokenizer_src: Path, layers: int = 2) -> Path:
    """A random Llama (hidden 128) in HF format with the embedded model's tokenizer (and chat template)."""
    import transformers

    if (out / "config.json").is_file():
        return out
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_src / name, out / name)
    return out


# a build's calibration and evaluation at the smallest sizes that still run every stage
TINY_CALIB = ["calib.samples=4", "calib.seq_len=32"]
TINY_EVAL = ["eval.seq_len=32", "eval.stride=32", "eval.max_windows=1", "eval.max_prompts=2", "eval.greedy_tokens=4"]


def compose(overrides: list[str]):
    from infer.pipeline.config import compose_recipe

    return compose_recipe(overrides)


def build_recipe(overrides: list[str], out: Path, cache: Path):
    """infer-build with ``overrides``, into ``out``, caching stages under ``cache``."""
    from infer.pipeline.build import build

    return build(compose([*overrides, f"output_dir={out}", f"cache_dir={cache}"]))
