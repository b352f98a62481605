"""Attention kernels against torch's SDPA, same run, same inputs: prompt chunks and decode steps.

The embedded model's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16) at
one layer. Prompt chunks: the class's chunk kernel (kernels/csrc/bf16_attention.cpp) and, where AMX is on,
the AMX one, for a fresh prompt of each length and for a chunk after cached tokens (a request reusing a cached
system prompt). SDPA gets the keys and
values already contiguous (what the engine's fresh-prompt path gives it; a chunk after cached
tokens would first gather them), so its figure is a lower bound on what the engine paid before.
Decode steps: the paged decode kernel on a bfloat16 cache, its AVX-512 BF16 path and its float
path (what a CPU without AVX-512 BF16 runs), against gather + SDPA, for batches of sequences of
300 tokens whose blocks lie anywhere in a pool (as a server's do), call by call in turn, medians.
Every output is checked against a float64 reference, so a fast wrong kernel cannot pass.

    python -m infer.bench.attention [--repeats 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
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
    from infer.kernels import amx_attention, bf16_attention

    module = bf16_attention.load()
    amx = amx_attention.load()  # None where AMX is off
    if module is None:
        raise SystemExit("this CPU has no AVX2 + FMA: the chunk kernels do not run here, nothing to compare")
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

        sdpa_s = _time(sdpa, args.repeats)
        want = F.scaled_dot_product_attention(qt.double(), kt.double().repeat_interleave(heads // kv_heads, 1),
                                              vt.double().repeat_interleave(heads // kv_heads, 1), attn_mask=visible)
        sdpa_err = (sdpa()[0].transpose(0, 1).double() - want[0].transpose(0, 1)).abs().max().item()
        row = {"new_tokens": n, "cached_tokens": cached, "sdpa_ms": round(sdpa_s * 1e3, 3),
               "sdpa_max_err_vs_float64": round(sdpa_err, 5)}
        line = f"{n:5d} new after {cached:5d} cached: sdpa {row['sdpa_ms']:7.3f} ms (max err {sdpa_err:.4f})"
        for name, kernel in (("kernel", module), ("amx", amx)):
            if kernel is None:
                continue
            seconds = _time(lambda: kernel.chunk_attention(*call), args.repeats)
            out.fill_(float("nan"))
            kernel.chunk_attention(*call)
            err = (out.double() - want[0].transpose(0, 1)).abs().max().item()
            prefix = "" if name == "kernel" else "amx_"
            row |= {f"{name}_ms": round(seconds * 1e3, 3), f"{prefix}speedup": round(sdpa_s / seconds, 2),
                    f"{prefix}max_err_vs_float64": round(err, 5)}
            line += f"  {name} {row[f'{name}_ms']:7.3f} ms ({sdpa_s / seconds:.2f}x, max err {err:.4f})"
            if not err <= 1.5 * sdpa_err + 2e-3:
                raise SystemExit(f"the {name} kernel's output is off: max error {err:.4f} against SDPA's "
                                 f"{sdpa_err:.4f}")
        rows.append(row)
        print(line)
    result = {"benchmark": "attention", "seed": seed, "shape": {"heads": heads, "kv_heads": kv_heads,
              "head_dim": d, "block_size": block}, "rows": rows, "decode_rows": decode_rows(gen, args.repeats)}
    save_json(result, args.json)
    return result


DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CONTEXT = 300


def decode_rows(gen: torch.Generator, repeats: int) -> list[dict]:
    from infer.kernels import cpu_attention

    module = cpu_attention.load()
    heads, kv_heads, d, block, pool = 9, 3, 64, 16, 4096
    k_cache = torch.randn(pool, block, kv_heads, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(pool, block, kv_heads, d, generator=gen).to(torch.bfloat16)
    width = -(-DECODE_CONTEXT // block)
    rows = []
    for batch in DECODE_BATCHES:
        tables = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in range(batch)])
        lens = torch.full((batch,), DECODE_CONTEXT, dtype=torch.long)
        q = torch.randn(batch, heads, d, generator=gen).to(torch.bfloat16)
        kd = k_cache[tables].view(batch, -1, kv_heads, d)[:, :DECODE_CONTEXT].transpose(1, 2)
        vd = v_cache[tables].view(batch, -1, kv_heads, d)[:, :DECODE_CONTEXT].transpose(1, 2)
        group = heads // kv_heads
        want = F.scaled_dot_product_attention(q.double()[:, :, None], kd.double().repeat_interleave(group, 1),
                                              vd.double().repeat_interleave(group, 1))[:, :, 0]

        def sdpa():  # the engine's fallback: gather the blocks, then one SDPA call
            kg = k_cache.index_select(0, tables.flatten()).view(batch, -1, kv_heads, d)[:, :DECODE_CONTEXT]
            vg = v_cache.index_select(0, tables.flatten()).view(batch, -1, kv_heads, d)[:, :DECODE_CONTEXT]
            return F.scaled_dot_product_attention(q[:, :, None], kg.transpose(1, 2), vg.transpose(1, 2),
                                                  enable_gqa=True)[:, :, 0]

        def kernel(bf16_dots: bool):
            def call():
                return module.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, bf16_dots=bf16_dots)
            return call

        row = {"batch": batch, "context": DECODE_CONTEXT}
        paths = [("float", kernel(False)), ("sdpa", sdpa)]
        if module.has_bf16_dots():  # else this CPU has no AVX-512 BF16: the float path is the kernel here
            paths.insert(0, ("avx512bf16", kernel(True)))
        seconds = {name: [] for name, _ in paths}
        for rep in range(repeats):  # call by call, the order turned every round: the host's drift weighs alike
            for name, fn in paths if rep % 2 == 0 else paths[::-1]:
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
        for name, fn in paths:
            row[f"{name}_us"] = round(statistics.median(seconds[name]) * 1e6, 1)
            row[f"{name}_max_err_vs_float64"] = round((fn().double() - want).abs().max().item(), 5)
        rows.append(row)
        fast = row.get("avx512bf16_us")
        print(f"decode batch {batch:3d} x {DECODE_CONTEXT} tokens: " +
              (f"avx512bf16 {fast:8.1f} us  " if fast else "") +
              f"float path {row['float_us']:8.1f} us  gather + sdpa {row['sdpa_us']:8.1f} us" +
              (f"  (avx512bf16 {row['float_us'] / fast:.2f}x the float path)" if fast else ""))
        worst = max(v for k, v in row.items() if k.endswith("_err_vs_float64"))
        if worst > 2e-2:
            raise SystemExit(f"decode attention is off at batch {batch}: max error {worst:.4f}")
    return rows


if __name__ == "__main__":
    main()
