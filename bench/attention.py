"""Prompt-chunk attention: the AVX-512 BF16 chunk kernel against torch's SDPA, same run, same inputs.

The embedded model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16) at
one layer, for a fresh prompt of each length and for a chunk after cached tokens (a request
reusing a cached system prompt). SDPA gets the keys and values already contiguous (what the
engine's fresh-prompt path gives it; a chunk after cached tokens would first gather them), so
its figure is a lower bound on what the engine paid before. Both outputs are checked against a
float64 reference, so a fast wrong kernel cannot pass.

    python -m infer.bench.attention [--repeats 50] [--json bench/results/attention.json]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from .throughput import RESULTS, save_json

SHAPES = [(64, 0), (256, 0), (512, 0), (1024, 0), (32, 430), (128, 1024)]  # (new tokens, cached tokens)


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", type=__import__("pathlib").Path, default=RESULTS / "attention.json")
    args = p.parse_args(argv)
    from infer.kernels import bf16_attention

    module = bf16_attention.load()
    if module is None:
        raise SystemExit("this CPU has no AVX-512 BF16: the chunk kernel does not run here, nothing to compare")
    heads, kv_heads, d, block = 9, 3, 64, 16
    seed = int(time.time())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, cached in SHAPES:
        length = n + cached
        blocks = -(-length // block)
        k_cache = torch.randn(blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(blocks, block, kv_heads, d, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, heads, d, generator=gen).to(torch.bfloat16)
        out = torch.empty_like(q)
        table = torch.arange(blocks)[None]
        call = (q, k_cache, v_cache, out, torch.tensor([0]), torch.tensor([n]), torch.tensor([cached]), table, d ** -0.5)
        qt = q.transpose(0, 1)[None]
        kt = k_cache.view(-1, kv_heads, d)[:length].transpose(0, 1)[None].contiguous()
        vt = v_cache.view(-1, kv_heads, d)[:length].transpose(0, 1)[None].contiguous()
        visible = torch.arange(length)[None, :] <= cached + torch.arange(n)[:, None]
        mask = torch.zeros(n, length, dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=None if cached == 0 else mask,
                                                  is_causal=cached == 0, enable_gqa=True)

        kernel_s = _time(lambda: module.chunk_attention(*call), args.repeats)
        sdpa_s = _time(sdpa, args.repeats)
        want = F.scaled_dot_product_attention(qt.double(), kt.double().repeat_interleave(heads // kv_heads, 1),
                                              vt.double().repeat_interleave(heads // kv_heads, 1), attn_mask=visible)
        module.chunk_attention(*call)
        err = (out.double() - want[0].transpose(0, 1)).abs().max().item()
        sdpa_err = (sdpa()[0].transpose(0, 1).double() - want[0].transpose(0, 1)).abs().max().item()
        row = {"new_tokens": n, "cached_tokens": cached, "kernel_ms": round(kernel_s * 1e3, 3),
               "sdpa_ms": round(sdpa_s * 1e3, 3), "speedup": round(sdpa_s / kernel_s, 2),
               "max_err_vs_float64": round(err, 5), "sdpa_max_err_vs_float64": round(sdpa_err, 5)}
        rows.append(row)
        print(f"{n:5d} new after {cached:5d} cached: kernel {row['kernel_ms']:7.3f} ms  sdpa {row['sdpa_ms']:7.3f} ms"
              f"  ({row['speedup']:.2f}x)  max err {err:.4f} (sdpa {sdpa_err:.4f})")
        if err > 1.5 * sdpa_err + 2e-3:
            raise SystemExit(f"the kernel's output is off: max error {err:.4f} against SDPA's {sdpa_err:.4f}")
    result = {"benchmark": "chunk_attention", "seed": seed, "shape": {"heads": heads, "kv_heads": kv_heads,
              "head_dim": d, "block_size": block}, "rows": rows}
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
