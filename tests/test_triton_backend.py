"""The resolver's ``triton`` backend wired through the engine, run on the CPU by triton's interpreter:
a tiny model's greedy outputs and logprobs with the Triton kernels equal those with plain torch ops
(chunked prefill, decodes, prefix caching). On a GPU the same code runs the compiled kernels."""

from __future__ import annotations

import os
import shutil

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET before triton is imported"

import pytest  # noqa: E402
import torch  # noqa: E402

from infer.runtime.artifact import TOKENIZER_FILES  # noqa: E402


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, embedded_artifact):
    """A 2-layer random Llama with the embedded model's tokenizer, built into an artifact (float32)."""
    import transformers

    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    root = tmp_path_factory.mktemp("tiny-triton")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)  # fixed weights: a clear argmax at every step, so the comparison is exact
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(root / "src")
    for name in TOKENIZER_FILES:
        if (embedded_artifact / name).is_file():
            shutil.copyfile(embedded_artifact / name, root / "src" / name)
    return build(compose_recipe([f"model.source={root / 'src'}", "tune.enabled=false", "artifact.name=tiny",
                                 f"output_dir={root / 'art'}", f"cache_dir={root / 'cache'}"])).artifact


def test_the_triton_backend_is_resolved_with_its_kernels():
    from infer.kernels import triton_ops
    from infer.kernels.resolver import resolve

    k = resolve("triton", dtype=torch.float32)
    assert k.decode_attention is triton_ops.paged_decode_attention and k.store_kv is triton_ops.store_kv_
    assert k.layer_ops.add_rms_norm_ is triton_ops.fused_add_rms_norm_
    assert k.describe(torch.float32) == {**k.describe(torch.float32), "backend": "triton", "layer_ops": "triton",
                                         "decode_attention": "triton", "kv_store": "triton", "linear": "torch"}


def test_engine_outputs_with_the_triton_kernels_equal_torch_ops(tiny_artifact):
    from infer.runtime import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,",
               "The capital of France is a city"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    outs = {}
    for kernels in ("triton", "torch"):
        llm = LLM(tiny_artifact, kernels=kernels, max_num_batched_tokens=8, kv_cache_memory=16 << 20)
        assert llm.engine.kernels.backend == kernels
        outs[kernels] = llm.generate(prompts, params)
        assert llm.engine.stats["steps"] > len(prompts)  # prompts went in chunks beside decodes
    for t, r in zip(outs["triton"], outs["torch"]):
        assert t.token_ids == r.token_ids, (t.prompt, t.token_ids, r.token_ids)
        diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(t.logprobs, r.logprobs)]
        assert max(diffs) < 1e-4, diffs


def _int4_weight(n: int, k: int, group: int, asym: bool, act_order: bool):
    """A random int4 grouped QuantWeight as the compressed-tensors reader returns one (values, scales,
    signed zero points, g_idx)."""
    from infer.runtime.model.compressed_tensors import Args, QuantWeight

    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 0.05 + 0.01
    zero = torch.randint(-3, 4, (n, k // group), dtype=torch.int8) if asym else None
    g_idx = torch.randperm(k).remainder(k // group).to(torch.int32) if act_order else None
    return QuantWeight(Args(4, "int", "group", not asym, group), None, q, scale, zero, g_idx)


@pytest.mark.parametrize("group,asym,act_order", [(32, False, False), (32, True, False), (64, True, True)],
                         ids=["g32-sym", "g32-asym", "g64-asym-actorder"])
def test_int4_linears_on_cuda_run_the_triton_w4a16_gemm(group, asym, act_order):
    """make_linear picks triton-w4a16 for an int4 layer on cuda (cpu-int4 on the CPU); the module, run
    here by the interpreter on CPU tensors, matches a float64 dequantization of the same weight."""
    from infer.runtime.model.quant_linear import int4_cpu_backend, make_linear

    w = _int4_weight(32, 128, group, asym, act_order)
    on_cuda = make_linear(w, None, torch.float32, device="cuda")  # packed on the CPU; the loader moves it
    assert on_cuda.backend == "triton-w4a16"
    assert make_linear(w, None, torch.float32, device="cpu").backend == int4_cpu_backend()
    odd = _int4_weight(24, 128, group, asym, act_order)  # N not a multiple of cpu-int4's 16-row tile
    assert make_linear(odd, None, torch.float32, device="cpu", disable=("cpu-int4-blocks",)).backend == "dequant"
    assert make_linear(odd, None, torch.float32, device="cpu").backend == (  # the AVX-512 kernel pads N
        "cpu-int4-blocks" if int4_cpu_backend() == "cpu-int4-blocks" else "dequant")
    x = torch.randn(3, 128)
    col = w.g_idx.long() if act_order else torch.arange(128) // group
    q = w.q.double() - (w.zero.double()[:, col] if asym else 0)
    want = x.double() @ (q * w.scale.double()[:, col]).t()
    got = on_cuda(x)
    assert got.shape == (3, 32) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max(), (got.double() - want).abs().max()


@pytest.mark.parametrize("group,asym,act_order", [(32, False, False), (64, True, True)],
                         ids=["g32-sym", "g64-asym-actorder"])
def test_int4_linears_of_bfloat16_models_on_cuda_run_torch_int4_for_decode_rows(group, asym, act_order, monkeypatch):
    """cuda-int4pack for a bfloat16 model's int4 layer on cuda (torch's int4 kernel takes bfloat16 only:
    a float32 model keeps triton-w4a16); packed for it when moved to the GPU (here, by hand, for torch's
    CPU variant); up to INT4PACK_MAX_ROWS rows through it, more through the triton GEMM; both match a
    float64 dequantization of the same weight."""
    from infer.kernels import int4pack
    from infer.runtime.model import quant_linear
    from infer.runtime.model.quant_linear import INT4PACK_MAX_ROWS, make_linear

    w = _int4_weight(32, 128, group, asym, act_order)
    layer = make_linear(w, None, torch.bfloat16, device="cuda")
    assert layer.backend == "cuda-int4pack"
    assert make_linear(w, None, torch.float32, device="cuda").backend == "triton-w4a16"
    assert layer.int4pack_weight is None  # packed where it runs, on the move to cuda
    layer.pack_for_int4pack()
    assert (layer.int4pack_perm is not None) == act_order
    calls = []
    real = int4pack.matmul
    monkeypatch.setattr(int4pack, "matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    col = w.g_idx.long() if act_order else torch.arange(128) // group
    q = w.q.double() - (w.zero.double()[:, col] if asym else 0)
    dense = q * w.scale.double()[:, col]
    for rows in (1, INT4PACK_MAX_ROWS, INT4PACK_MAX_ROWS + 1):  # inputs from conftest's printed seed
        x = torch.randn(rows, 128).to(torch.bfloat16)
        want = x.double() @ dense.t()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 32)
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max(), rows
    assert calls == [1, INT4PACK_MAX_ROWS]  # the 9-row call ran the triton GEMM
    uneven = _int4_weight(32, 128, group, asym, False)
    uneven.g_idx = torch.zeros(128, dtype=torch.int32)  # one group of 128 columns: no contiguous order of `group`
    assert make_linear(uneven, None, torch.bfloat16, device="cuda").backend == "triton-w4a16"
    odd = _int4_weight(20, 128, group, False, False)  # N not a multiple of tinygemm's 8-row tile
    assert quant_linear._cuda_int4pack(odd, torch.device("cuda")) is False
    assert make_linear(odd, None, torch.bfloat16, device="cuda").backend == "triton-w4a16"
