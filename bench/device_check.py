"""The GPU path's device check: one command, under 8 minutes, on a lent NVIDIA GPU (an H200).

    PYTHONUNBUFFERED=1 python3 bench/device_check.py            # on the GPU machine, from the repo root
    TRITON_INTERPRET=1 .venv/bin/python bench/device_check.py --smoke   # here: tiny shapes, no timings

Nothing large can travel to the device, so the weights are random, made on the device, in the
shapes of Qwen2.5-7B (hidden 3584, 28 heads, 4 KV heads, head_dim 128, intermediate 18944, vocab
152064; W4A16 group 128). Sections, each within what is left of a self-imposed time budget
(``--budget-s``), each recorded (or its error) without stopping the others:
1. correctness: every triton kernel against its torch reference at real shapes;
2. HBM read bandwidth: a large tensor's sum and copy, median of several;
3. decode attention at batch 1-16 and contexts 1k-4k, and the W4A16 GEMM at batch 1-16 on the
   four projection shapes: achieved bandwidth as a share of (2), next to torch's dense bf16 matmul;
4. the decode step of a stack of ``--layers`` layers built from these kernels, eager and replayed
   as a CUDA graph (kernels/cuda_graphs.py), and the graph's rows checked against the eager step;
5. the engine end to end: a tiny random Llama (2 layers, hidden 256) written as an HF checkpoint and
   sealed as an artifact in a temp dir, run by ``LLMEngine`` with device=cuda, kernels=triton (CUDA
   graphs on, then off), its greedy tokens compared with device=cpu, kernels=torch (16 tokens, 4
   prompts), and the engine's decode step time with and without graphs at batch 1 and 8. Under
   ``--smoke`` there is no CUDA: the same comparison runs on the CPU (kernels=triton interpreted
   against torch; no graphs, no timings), which checks the section's own code.
Writes ``$OUT/device_check.json`` when $OUT is set, else under $INFER_BENCH_RESULTS or $TMPDIR/infer-bench, and
prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

QWEN7B = dict(hidden=3584, heads=28, kv_heads=4, head_dim=128, inter=18944, vocab=152064, group=128, block_size=16)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256, group=32, block_size=4)


def import_kernels():
    """infer's kernels, installed or straight from this tree (the device machine has the tree, not
    the package: ``infer.X`` is the folder ``X``, as the editable install maps it)."""
    try:
        import infer.kernels.triton_ops  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("infer")
        pkg.__path__ = [str(REPO)]
        sys.modules["infer"] = pkg
    from infer.kernels import cuda_graphs, triton_ops

    return triton_ops, cuda_graphs


class Report:
    """Sections run in order while the budget lasts; each records its result, skip reason or error."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s
        self.sections: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def run(self, name: str, fn, need_s: float = 0.0, skip: str | None = None):
        if skip is None and self.left() < need_s:
            skip = f"{self.left():.0f} s of the budget left, this section needs about {need_s:.0f} s"
        if skip is not None:
            self.sections[name] = {"skipped": skip}
            print(f"[{name}] skipped: {skip}", flush=True)
            return None
        t0 = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            result = fn()
            self.sections[name] = {"seconds": round(time.perf_counter() - t0, 1), "result": result}
        except Exception as e:  # recorded, and the next section still runs
            self.sections[name] = {"seconds": round(time.perf_counter() - t0, 1), "error": repr(e),
                                   "traceback": traceback.format_exc()[-4000:]}
            print(f"[{name}] ERROR {e!r}\n{traceback.format_exc()[-2000:]}", flush=True)
            result = None
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s ({self.left():.0f} s of the budget left)",
              flush=True)
        return result


def projections(shape) -> list[tuple[str, int, int]]:
    """A layer's projections (name, N, K): fused qkv, o, fused gate_up, down."""
    H, heads, kvh, d, inter = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["inter"]
    return [("qkv", heads * d + 2 * kvh * d, H), ("o", H, heads * d), ("gate_up", 2 * inter, H), ("down", H, inter)]


def w4_bytes(n: int, k: int, group: int) -> int:
    """Bytes of an [n, k] W4A16 weight: the nibbles and a bfloat16 scale per group."""
    return n * k // 2 + n * (k // group) * 2


def rel_err(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------- weights and inputs

def random_w4(n: int, k: int, group: int, device, asym=False, act_order=False, seed=0):
    """Random W4A16 tensors in compressed-tensors' layout: any int32 word is 8 valid nibbles."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32, device=device)
    # int4 values have std ~4.6: this scale keeps a layer's output about as large as its input
    scale = (torch.rand(n, k // group, generator=g, device=device) * 0.5 + 0.75) / (4.6 * k ** 0.5)
    zero = torch.randint(-2**31, 2**31 - 1, (n // 8, k // group), generator=g, dtype=torch.int32,
                         device=device) if asym else None
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32, device=device)
        g_idx[torch.randperm(k, generator=g, device=device)] = (torch.arange(k, device=device) // group).int()
    return packed, scale.to(torch.bfloat16), zero, g_idx


def paged_inputs(seqs, ctx, shape, device, dtype, num_blocks=None, seed=0):
    """A KV cache of one layer and the block tables of ``seqs`` sequences of ``ctx`` tokens (a list:
    one length per sequence), blocks scattered at random as an engine's allocator leaves them."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    bs, kvh, d = shape["block_size"], shape["kv_heads"], shape["head_dim"]
    lens = torch.tensor(ctx, device=device)
    width = -(-max(ctx) // bs)
    num_blocks = num_blocks or seqs * width + 1
    k = torch.randn(num_blocks, bs, kvh, d, generator=g, device=device).to(dtype)
    v = torch.randn(num_blocks, bs, kvh, d, generator=g, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=g, device=device)[:seqs * width].view(seqs, width).int()
    q = torch.randn(seqs, shape["heads"], d, generator=g, device=device).to(dtype)
    return q, k, v, tables, lens.int()


# ---------------------------------------------------------------------------- 1. correctness

def correctness(T, shape, device, smoke):
    import torch

    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(1)
    H, heads, kvh, d, inter = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["inter"]
    out = {}
    ctx = [1, 37, 1000, 4096] if not smoke else [1, 9, 30]
    q, k, v, tables, lens = paged_inputs(len(ctx), ctx, shape, device, dt)
    ref = T.paged_decode_attention_reference(q, k, v, tables, lens, d ** -0.5)
    for splits in (None, 1):
        got = T.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, splits=splits)
        out[f"decode_attention splits={splits or 'auto'}"] = rel_err(got, ref)

    for name, n, kk in [p for p in projections(shape) if p[0] in ("qkv", "down")]:
        for asym, act in ((False, False), (True, False), (False, True)):
            w = random_w4(n, kk, shape["group"], device, asym, act, seed=2)
            for rows in (1, 4, 12):  # the CUDA-core kernel (one program's rows, all of them), the dot kernel
                x = torch.randn(rows, kk, generator=g, device=device).to(dt)
                label = f"w4a16 {name} {n}x{kk} {'asym' if asym else 'sym'}{' act-order' if act else ''} x{rows}"
                out[label] = rel_err(T.w4a16_gemm(x, *w), T.w4a16_gemm_reference(x, *w))

    x, res = (torch.randn(16, H, generator=g, device=device).to(dt) for _ in range(2))
    weight = (torch.rand(H, generator=g, device=device) + 0.5).to(dt)
    rn, rr = T.rms_norm_reference(x, weight, 1e-6, res)
    xs, rs = x.clone(), res.clone()
    T.fused_add_rms_norm_(xs, rs, weight, 1e-6)
    out["fused_add_rms_norm normed"] = rel_err(xs, rn)
    out["fused_add_rms_norm residual"] = rel_err(rs, rr)
    out["rms_norm"] = rel_err(T.rms_norm(x, weight, 1e-6), T.rms_norm_reference(x, weight, 1e-6)[0])

    cos, sin = rope_tables(d, 8192, device)
    qkv = torch.randn(16, (heads + 2 * kvh) * d, generator=g, device=device).to(dt)
    pos = torch.randint(0, 8192, (16,), generator=g, device=device)
    want = T.rotary_reference(qkv, pos, cos, sin, heads + kvh, d)
    T.rotary_(qkv, pos, cos, sin, heads + kvh, d)
    out["rotary"] = rel_err(qkv, want)

    gu = torch.randn(16, 2 * inter, generator=g, device=device).to(dt)
    out["silu_and_mul"] = rel_err(T.silu_and_mul(gu), T.silu_and_mul_reference(gu))

    kc, vc = (torch.randn(64, shape["block_size"], kvh, d, generator=g, device=device).to(dt) for _ in range(2))
    kk_, vv = (torch.randn(16, kvh, d, generator=g, device=device).to(dt) for _ in range(2))
    slots = torch.randperm(64 * shape["block_size"], generator=g, device=device)[:16]
    slots[3] = -1
    want_k, want_v = T.store_kv_reference(kc, vc, slots, kk_, vv)
    T.store_kv_(kc, vc, slots, kk_, vv)
    out["store_kv (exact)"] = float(not (torch.equal(kc, want_k) and torch.equal(vc, want_v)))

    # bf16: 2 ulps is 2**-7; a sum over K rounds once more at the output
    tol = {"store_kv (exact)": 0.0}
    result = {name: {"rel_err": err, "ok": err <= tol.get(name, 2e-2)} for name, err in out.items()}
    return result


def rope_tables(head_dim, positions, device, theta=1_000_000.0):
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    emb = torch.outer(torch.arange(positions, device=device).float(), inv).repeat(1, 2)
    return emb.cos().contiguous(), emb.sin().contiguous()


# ---------------------------------------------------------------------------- 2. bandwidth

def bench_ms(fn) -> float:
    """Median ms of fn on the GPU; triton's do_bench flushes L2 between runs, so small working sets
    (one layer's weights, a short KV cache) are read from HBM, not from the 60 MB of L2."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


L2_FLUSH_BYTES = 256 << 20  # four times the H200's L2: inputs cycled through this much are read from HBM


def copies_for(nbytes: int, most: int = 32) -> int:
    """How many copies of a working set of ``nbytes`` to cycle through so that each call reads HBM."""
    return max(2, min(most, -(-L2_FLUSH_BYTES // max(1, nbytes))))


def graph_ms(calls, replays: int = 20) -> float:
    """Median GPU ms of one call with no launch cost: ``calls`` (the same op over different copies of
    its inputs, together larger than L2) are captured in one CUDA graph, replayed, timed by events.
    What bench_ms reports on top of this is the host's cost of launching the op."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: autotuning and compiles happen here
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def hbm_bandwidth(device):
    import torch

    x = torch.ones(2 << 30, dtype=torch.bfloat16, device=device)  # 4 GiB
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    sums, copies = [], []
    for _ in range(7):
        sums.append(bench_ms(functools.partial(torch.sum, x, dtype=torch.float32)))
        copies.append(bench_ms(functools.partial(y.copy_, x)))
    read = nbytes / (statistics.median(sums) * 1e-3) / 1e9
    copy = 2 * nbytes / (statistics.median(copies) * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return {"read_gbps (sum of 4 GiB)": round(read), "copy_gbps (read + write)": round(copy),
            "reference_gbps": round(max(read, copy))}


def attention_bandwidth(T, shape, device, peak_gbps):
    """Each (batch, context) at the default split count, launched (bench_ms) and graph-replayed over
    copies of the cache (graph_ms: the kernel's own time); at batch 1 every split count too."""
    import torch

    rows = []
    for batch in (1, 4, 16):
        for ctx in (1024, 4096):
            nbytes = 2 * batch * ctx * shape["kv_heads"] * shape["head_dim"] * 2 + 2 * batch * shape["heads"] * \
                shape["head_dim"] * 2
            sets = [paged_inputs(batch, [ctx] * batch, shape, device, torch.bfloat16, seed=i)
                    for i in range(copies_for(nbytes))]
            scale = shape["head_dim"] ** -0.5
            q, k, v, tables, lens = sets[0]
            default = T.default_splits(batch, shape["kv_heads"], tables.shape[1] * shape["block_size"], q.device)
            for s in sorted({default, 1, 4, 8, 16, 32}) if batch == 1 else (default,):
                us = graph_ms([functools.partial(T.paged_decode_attention, *inp, scale, splits=s)
                               for inp in sets]) * 1e3
                gbps = nbytes / (us * 1e-6) / 1e9
                row = {"batch": batch, "context": ctx, "splits": s, "default": s == default, "graph_us": round(us, 1),
                       "gbps": round(gbps), "share": round(gbps / peak_gbps, 3)}
                if s == default:
                    row["launched_us"] = round(bench_ms(lambda: T.paged_decode_attention(q, k, v, tables, lens, scale,
                                                                                         splits=s)) * 1e3, 1)
                rows.append(row)
            del sets
    return rows


def gemm_bandwidth(T, shape, device, peak_gbps):
    """Each projection of a layer at 1-16 rows: the W4A16 kernel and torch's dense bf16 matmul,
    graph-replayed over copies of the weight (the kernels' own time, from HBM), and the W4A16
    kernel launched as the engine calls it without graphs (bench_ms: the host's cost on top)."""
    import torch

    rows = []
    for name, n, k in projections(shape):
        w_bytes = w4_bytes(n, k, shape["group"])
        ws = [random_w4(n, k, shape["group"], device, seed=i) for i in range(copies_for(w_bytes))]
        denses = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            us = graph_ms([functools.partial(T.w4a16_gemm, x, *w) for w in ws]) * 1e3
            dense_us = graph_ms([functools.partial(torch.matmul, x, dense.t()) for dense in denses]) * 1e3
            launched_us = bench_ms(lambda: T.w4a16_gemm(x, *ws[0])) * 1e3
            gbps = (w_bytes + (m * k + m * n) * 2) / (us * 1e-6) / 1e9
            rows.append({"shape": f"{name} {n}x{k}", "batch": m, "us": round(us, 1), "gbps": round(gbps),
                         "share": round(gbps / peak_gbps, 3), "dense_bf16_us": round(dense_us, 1),
                         "speedup_vs_dense": round(dense_us / us, 2), "launched_us": round(launched_us, 1)})
        del ws, denses
    return rows


def int4pack_args(w, group):
    """random_w4's compressed-tensors tensors -> kernels/int4pack.py's packing and matmul's arguments."""
    from infer.kernels import int4pack
    from infer.kernels.triton_ops import w4a16

    packed, scale, zero, _ = w
    n, k = packed.shape[0], packed.shape[1] * 8
    q = w4a16.unpack_int4(packed, k)
    z = None if zero is None else w4a16.unpack_int4(zero, n, dim=0)
    return (*int4pack.pack(q, scale, z), group)


def int4pack_gemm_check(T, shape, device, peak_gbps):
    """torch's own int4 kernel (kernels/int4pack.py, tinygemm, what the runtime's cuda-int4pack backend
    runs for decode rows) on the same projections: its error against the W4A16 reference (symmetric,
    and asymmetric on o) and its graph-replayed time beside the triton kernel's and dense bf16's."""
    import torch

    from infer.kernels import int4pack

    rows = []
    for name, n, k in projections(shape):
        w_bytes = w4_bytes(n, k, shape["group"])
        ws = [random_w4(n, k, shape["group"], device, asym=(name == "o"), seed=i) for i in range(copies_for(w_bytes))]
        packs = [int4pack_args(w, shape["group"]) for w in ws]
        denses = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            err = rel_err(int4pack.matmul(x, *packs[0]), T.w4a16_gemm_reference(x, *ws[0]))
            us = graph_ms([functools.partial(int4pack.matmul, x, *p) for p in packs]) * 1e3
            triton_us = graph_ms([functools.partial(T.w4a16_gemm, x, *w) for w in ws]) * 1e3
            dense_us = graph_ms([functools.partial(torch.matmul, x, dense.t()) for dense in denses]) * 1e3
            gbps = (w_bytes + (m * k + m * n) * 2) / (us * 1e-6) / 1e9
            rows.append({"shape": f"{name} {n}x{k}{' asym' if name == 'o' else ''}", "batch": m,
                         "rel_err": round(err, 5), "ok": err <= 2e-2, "us": round(us, 1), "gbps": round(gbps),
                         "share": round(gbps / peak_gbps, 3), "triton_us": round(triton_us, 1),
                         "speedup_vs_triton": round(triton_us / us, 2), "dense_bf16_us": round(dense_us, 1),
                         "speedup_vs_dense": round(dense_us / us, 2)})
        del ws, packs, denses
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


# ---------------------------------------------------------------------------- 4. decode step

class DecoderStack:
    """Qwen2-shaped decoder layers built only from the triton kernels (W4A16 projections, bf16 KV
    cache), the embedding and a dense bf16 lm_head: the decode step a GPU engine would run."""

    def __init__(self, T, shape, layers, max_seqs, max_ctx, device):
        import torch

        self.T, self.s, self.layers = T, shape, layers
        H, heads, kvh, d, inter = (shape[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "inter"))
        g = torch.Generator(device=device).manual_seed(3)
        bf = torch.bfloat16
        self.embed = (torch.randn(shape["vocab"], H, generator=g, device=device) * 0.02).to(bf)
        self.lm_head = (torch.randn(shape["vocab"], H, generator=g, device=device) * H ** -0.5).to(bf)
        self.norms = [(torch.rand(H, generator=g, device=device) + 0.5).to(bf) for _ in range(2 * layers + 1)]
        qkv_n = (heads + 2 * kvh) * d
        self.qkv = [random_w4(qkv_n, H, shape["group"], device, seed=10 + i) for i in range(layers)]
        self.qkv_bias = [(torch.randn(qkv_n, generator=g, device=device) * 0.02).to(bf) for _ in range(layers)]
        self.o = [random_w4(H, heads * d, shape["group"], device, seed=100 + i) for i in range(layers)]
        self.gate_up = [random_w4(2 * inter, H, shape["group"], device, seed=200 + i) for i in range(layers)]
        self.down = [random_w4(H, inter, shape["group"], device, seed=300 + i) for i in range(layers)]
        self.block_size = shape["block_size"]
        self.max_blocks = -(-max_ctx // self.block_size)
        num_blocks = max_seqs * self.max_blocks + 1
        self.k_cache = [torch.randn(num_blocks, self.block_size, kvh, d, generator=g, device=device).to(bf)
                        for _ in range(layers)]
        self.v_cache = [torch.randn_like(c) for c in self.k_cache]
        self.cos, self.sin = rope_tables(d, max_ctx + 1, device)

    def use_int4pack(self):
        """Every projection through torch's int4 kernel (kernels/int4pack.py) instead of triton's."""
        from infer.kernels import int4pack

        for attr in ("qkv", "o", "gate_up", "down"):
            setattr(self, attr, [int4pack_args(w, self.s["group"]) for w in getattr(self, attr)])
        self.gemm = int4pack.matmul

    def step(self, x):
        """DecodeInputs -> logits [rows, vocab] bf16. No host syncs: capturable."""
        T, s = self.T, self.s
        gemm = getattr(self, "gemm", T.w4a16_gemm)
        heads, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
        h = self.embed.index_select(0, x.input_ids)
        residual = h
        hidden = T.rms_norm(h, self.norms[0], 1e-6)
        for i in range(self.layers):
            if i > 0:
                T.fused_add_rms_norm_(hidden, residual, self.norms[2 * i], 1e-6)
            qkv = gemm(hidden, *self.qkv[i]) + self.qkv_bias[i]
            T.rotary_(qkv, x.positions, self.cos, self.sin, heads + kvh, d, check=False)
            q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
            T.store_kv_(self.k_cache[i], self.v_cache[i], x.slot_mapping, k.view(-1, kvh, d), v.view(-1, kvh, d),
                        check=False)
            attn = T.paged_decode_attention(q.view(-1, heads, d), self.k_cache[i], self.v_cache[i], x.block_tables,
                                            x.context_lens, d ** -0.5)
            hidden = gemm(attn.view(-1, heads * d), *self.o[i])
            T.fused_add_rms_norm_(hidden, residual, self.norms[2 * i + 1], 1e-6)
            hidden = gemm(T.silu_and_mul(gemm(hidden, *self.gate_up[i])), *self.down[i])
        T.fused_add_rms_norm_(hidden, residual, self.norms[-1], 1e-6)
        return hidden @ self.lm_head.t()


def decode_batch(cg, stack, batch, ctx, device, seed=0):
    """A decode step's inputs: each sequence has ctx - 1 cached tokens and stores its ctx-th."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bs = stack.block_size
    width = -(-ctx // bs)
    blocks = torch.randperm(stack.k_cache[0].shape[0], generator=g)[:batch * width].view(batch, width)
    lens = torch.full((batch,), ctx)
    slots = blocks[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    ids = torch.randint(0, stack.s["vocab"], (batch,), generator=g)
    to = dict(device=device)
    return cg.DecodeInputs(ids.to(**to), (lens - 1).to(**to), slots.to(**to), blocks.to(**to), lens.to(**to))


def step_bytes(stack, batch, ctx) -> int:
    """What one decode step must read from memory: every weight once, and each sequence's KV cache."""
    import torch

    tensors = [stack.embed[0], stack.lm_head, *stack.norms, *stack.qkv_bias]
    for layer in (*stack.qkv, *stack.o, *stack.gate_up, *stack.down):
        tensors += [t for t in layer if isinstance(t, torch.Tensor)]
    kv = 2 * stack.layers * batch * ctx * stack.s["kv_heads"] * stack.s["head_dim"] * 2
    return sum(t.numel() * t.element_size() for t in tensors) + kv


def decode_step(T, cg, shape, layers, device, smoke, peak_gbps=None, int4pack=True):
    import torch

    batches, ctx = ((1, 3, 4, 16), 1024) if not smoke else ((1, 3), 12)
    stack = DecoderStack(T, shape, layers, max(batches), ctx, device)
    runner = cg.GraphRunner(stack.step, stack.max_blocks, device, buckets=(1, 2, 4, 8, 16))
    rows = []
    for batch in batches:
        x = decode_batch(cg, stack, batch, ctx, device, seed=batch)
        eager = stack.step(x).float()
        graphed = runner(x).float()  # the first call at a bucket warms up and captures
        # not bitwise: split-K GEMMs add their partial sums atomically, in whatever order they land
        rel = rel_err(graphed, eager)
        row = {"batch": batch, "bucket": cg.choose_bucket(batch, runner.buckets), "layers": layers,
               "graph_vs_eager_rel": rel, "ok": bool(torch.isfinite(eager).all()) and rel < 5e-2}
        if not smoke:
            row["eager_ms"] = round(bench_ms(lambda: stack.step(x)), 3)
            row["graph_ms"] = round(bench_ms(lambda: runner(x)), 3)
            row["graph_speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
            if peak_gbps:
                floor_ms = step_bytes(stack, batch, ctx) / (peak_gbps * 1e9) * 1e3
                row["floor_ms"] = round(floor_ms, 3)
                row["share_of_floor"] = round(floor_ms / row["graph_ms"], 3)
        rows.append(row)
    rows.append({"graphs_captured": sorted(runner.graphs)})
    if not smoke and int4pack:
        stack.use_int4pack()
        packed_runner = cg.GraphRunner(stack.step, stack.max_blocks, device, buckets=(1, 2, 4, 8, 16))
        for row in rows[:-1]:
            x = decode_batch(cg, stack, row["batch"], ctx, device, seed=row["batch"])
            packed_runner(x)  # captures
            row["graph_ms_int4pack"] = round(bench_ms(lambda: packed_runner(x)), 3)
            if peak_gbps:
                row["share_of_floor_int4pack"] = round(step_bytes(stack, row["batch"], ctx) / (peak_gbps * 1e9) * 1e3
                                                       / row["graph_ms_int4pack"], 3)
    return rows


# ---------------------------------------------------------------------------- 5. the engine

ENGINE_MODEL = dict(vocab=512, hidden=256, inter=512, layers=2, heads=4, kv_heads=2, max_positions=256)


def tiny_artifact(root: Path, m: dict, seed: int = 0) -> Path:
    """A random Llama as an HF checkpoint (config.json, model.safetensors, a word-level tokenizer.json),
    sealed with a manifest so that the engine verifies and loads it like any built artifact. Weights
    are large enough (std 0.1) that each greedy step has a clear argmax: CPU and GPU agree on tokens."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from infer.runtime.artifact import CONFIG, TOKENIZER, write_manifest

    root.mkdir(parents=True, exist_ok=True)
    h, d = m["hidden"], m["hidden"] // m["heads"]
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).contiguous()  # noqa: E731
    tensors = {"model.embed_tokens.weight": torch.randn(m["vocab"], h, generator=g),
               "model.norm.weight": torch.ones(h)}
    for i in range(m["layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(m["heads"] * d, h),
                        p + "self_attn.k_proj.weight": w(m["kv_heads"] * d, h),
                        p + "self_attn.v_proj.weight": w(m["kv_heads"] * d, h),
                        p + "self_attn.o_proj.weight": w(h, m["heads"] * d),
                        p + "mlp.gate_proj.weight": w(m["inter"], h), p + "mlp.up_proj.weight": w(m["inter"], h),
                        p + "mlp.down_proj.weight": w(h, m["inter"]),
                        p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    save_file(tensors, str(root / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab"],
              "hidden_size": h, "intermediate_size": m["inter"], "num_hidden_layers": m["layers"],
              "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"], "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": m["max_positions"], "tie_word_embeddings": True,
              "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
    (root / CONFIG).write_text(json.dumps(config, indent=1))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(m["vocab"])}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / TOKENIZER))
    write_manifest(root, {"name": "device-check-tiny", "version": "0"})
    return root


def generate(engine, prompts, max_tokens):
    """Greedy tokens of each prompt (ids), and each step's wall time in ms (a step ends with the
    sampled ids back on the host, so it is synchronous)."""
    from infer.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens, times = {}, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        times.append((time.perf_counter() - t0) * 1e3)
    return [tokens[f"r{i}"] for i in range(len(prompts))], times


def w4a16_artifact(src: Path, root: Path, group: int = 32) -> Path:
    """``src`` (tiny_artifact) with every decoder linear as compressed-tensors W4A16 (pack-quantized,
    symmetric, round to nearest in groups of ``group``), served in bfloat16: the int4 path on each device."""
    import torch
    from safetensors.torch import load_file, save_file

    from infer.kernels.triton_ops import pack_int4
    from infer.runtime.artifact import CONFIG, TOKENIZER, write_manifest

    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            n, k = t.shape
            groups = t.float().view(n, k // group, group)
            scale = groups.abs().amax(-1) / 7
            q = (groups / scale.unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).view(n, k)
            base = name.removesuffix(".weight")
            tensors.update({base + ".weight_packed": pack_int4(q), base + ".weight_scale": scale.to(torch.bfloat16),
                            base + ".weight_shape": torch.tensor([n, k])})
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(root / "model.safetensors"))
    config = json.loads((src / CONFIG).read_text())
    config.update(torch_dtype="bfloat16", quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": True}}}})
    (root / CONFIG).write_text(json.dumps(config, indent=1))
    (root / TOKENIZER).write_bytes((src / TOKENIZER).read_bytes())
    write_manifest(root, {"name": "device-check-tiny-w4a16", "version": "0"})
    return root


def int4_engine_check(art: Path, device_type: str, prompts, new_tokens: int) -> dict:
    """A bfloat16 W4A16 model served on ``device_type`` with the triton kernels (cuda: the cuda-int4pack
    linears, graphs on) against the CPU's own int4 linears and torch ops: the share of greedy tokens that
    agree (both bfloat16, different kernels: a near tie may flip one) and the backends each side ran."""
    from infer.runtime import LLMEngine
    from infer.runtime.model.quant_linear import quantized_modules

    common = dict(dtype="bfloat16", kv_cache_memory=64 << 20, max_num_seqs=16)
    ref_engine = LLMEngine(art, device="cpu", kernels="torch", **common)
    engine = LLMEngine(art, device=device_type, kernels="triton", **common)
    ref, _ = generate(ref_engine, prompts, new_tokens)
    got, _ = generate(engine, prompts, new_tokens)
    same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
    total = sum(len(x) for x in ref)
    return {"backends": sorted(set(quantized_modules(engine.model).values())),
            "cpu_backends": sorted(set(quantized_modules(ref_engine.model).values())),
            "tokens_agreeing": f"{same}/{total}", "first_difference": [
                next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(got, ref)],
            "ok": same >= 0.9 * total}


def engine_check(device_type: str, smoke: bool):
    """The engine's tokens on ``device_type`` with the triton kernels against the CPU with torch ops;
    on CUDA with graphs on and off, and the decode step times of both."""
    import tempfile

    import torch

    from infer.runtime import LLMEngine

    m = ENGINE_MODEL if not smoke else {**ENGINE_MODEL, "hidden": 64, "inter": 128, "vocab": 128}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, m["vocab"], (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    common = dict(dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=16)
    out = {"model": m, "prompts": [len(p) for p in prompts], "new_tokens": 16}
    with tempfile.TemporaryDirectory() as tmp:
        art = tiny_artifact(Path(tmp) / "art", m)
        ref, _ = generate(LLMEngine(art, device="cpu", kernels="torch", **common), prompts, 16)
        runs = {"graphs": dict(cuda_graphs=True), "eager": dict(cuda_graphs=False)} if device_type == "cuda" \
            else {"eager": {}}
        engines = {}
        for name, extra in runs.items():
            engine = engines[name] = LLMEngine(art, device=device_type, kernels="triton", **common, **extra)
            placed = {"model": str(engine.model.device), "kv_cache": str(engine.runner.kv_cache.device)}
            graphs = engine.runner.graphs
            replays = []  # one fill of the static buffers per padded decode step (a replay on CUDA)
            if graphs is not None:
                fill = graphs.buffers.fill
                graphs.buffers.fill = lambda x, bucket, _f=fill: replays.append(bucket) or _f(x, bucket)
            got, _ = generate(engine, prompts, 16)
            same = [a == b for a, b in zip(got, ref)]
            out[name] = {"placed": placed, "tokens_equal_cpu_torch": same,
                         "first_difference": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                              for a, b in zip(got, ref)],
                         "graphs_captured": sorted(graphs.graphs) if graphs is not None else [],
                         "decode_steps_replayed": len(replays)}
        if device_type == "cuda" and not smoke:
            short = [p[:4] for p in prompts]
            for name, engine in engines.items():
                rows = []
                for batch in (1, 8):
                    generate(engine, (short * 2)[:batch], 8)  # warm: the first steps at this batch
                    _, times = generate(engine, (short * 2)[:batch], 48)
                    decode = times[2:]  # after the prompt step: one decode a step for every sequence
                    rows.append({"batch": batch, "step_ms_median": round(statistics.median(decode), 3),
                                 "step_ms_min": round(min(decode), 3), "steps": len(decode)})
                out[name]["decode_step"] = rows
            out["graph_speedup"] = [round(e["step_ms_median"] / g_["step_ms_median"], 2)
                                    for e, g_ in zip(out["eager"]["decode_step"], out["graphs"]["decode_step"])]
        out["w4a16_bfloat16"] = int4_engine_check(w4a16_artifact(art, Path(tmp) / "art-w4a16"), device_type,
                                                  prompts, 16)
    out["ok"] = all(all(out[n]["tokens_equal_cpu_torch"]) for n in runs) and \
        (device_type != "cuda" or out["graphs"]["decode_steps_replayed"] > 0) and out["w4a16_bfloat16"]["ok"] and \
        (device_type != "cuda" or out["w4a16_bfloat16"]["backends"] == ["cuda-int4pack"])
    return out


# ---------------------------------------------------------------------------- the command

def print_table(report: Report) -> None:
    for name, section in report.sections.items():
        print(f"\n== {name} ({section.get('seconds', '-')} s)")
        if "skipped" in section or "error" in section:
            print("  " + (f"skipped: {section['skipped']}" if "skipped" in section else f"ERROR {section['error']}"))
            continue
        result = section["result"]
        if isinstance(result, dict):
            width = max(len(k) for k in result)
            for k, v in result.items():
                print(f"  {k:<{width}}  {v}")
        elif isinstance(result, list) and result:
            keys = list(dict.fromkeys(k for r in result for k in r))
            print("  " + " | ".join(keys))
            for r in result:
                print("  " + " | ".join(str(r.get(k, "")) for k in keys))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1; no timings (checks that it runs)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this many seconds")
    ap.add_argument("--sections", default="all",
                    help="comma-separated: correctness,engine,hbm,attention,gemm,int4pack,decode_step (default all)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers in the decode-step section (default: all 28 of Qwen2.5-7B; 2 with --smoke)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration
    import torch
    import triton

    T, cg = import_kernels()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = TINY if args.smoke else QWEN7B
    layers = args.layers or (2 if args.smoke else 28)
    report = Report(args.budget_s)
    no_timing = "--smoke: the interpreter's timings mean nothing, so none are taken" if args.smoke else None
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
           "smoke": args.smoke, "shape": shape, "decode_step_layers": layers}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    report.sections["env"] = {"result": env}
    print(json.dumps(env), flush=True)

    chosen = set(args.sections.split(",")) if args.sections != "all" else None

    def unless_chosen(name, reason=None):
        return reason if chosen is None or name in chosen else f"not in --sections {args.sections}"

    report.run("correctness", lambda: correctness(T, shape, device, args.smoke), need_s=60,
               skip=unless_chosen("correctness"))
    if args.smoke:
        print("[engine] --smoke: no CUDA here, so the CUDA engine and its graphs do not run; the same token "
              "comparison runs on the CPU (kernels=triton interpreted against torch)", flush=True)
    report.run("engine", lambda: engine_check(device.type, args.smoke), need_s=90, skip=unless_chosen("engine"))
    hbm = report.run("hbm_bandwidth", lambda: hbm_bandwidth(device), need_s=20, skip=unless_chosen("hbm", no_timing))
    peak = (hbm or {}).get("reference_gbps")
    no_peak = no_timing or (None if peak else "no HBM bandwidth measured to compare with")
    report.run("decode_attention_bandwidth", lambda: attention_bandwidth(T, shape, device, peak), need_s=60,
               skip=unless_chosen("attention", no_peak))
    report.run("w4a16_gemm_bandwidth", lambda: gemm_bandwidth(T, shape, device, peak), need_s=90,
               skip=unless_chosen("gemm", no_peak))
    report.run("int4pack_gemm", lambda: int4pack_gemm_check(T, shape, device, peak), need_s=40,
               skip=unless_chosen("int4pack", no_peak))
    report.run("decode_step", lambda: decode_step(T, cg, shape, layers, device, args.smoke, peak,
                                                  int4pack=chosen is None or "int4pack" in chosen),
               need_s=60, skip=unless_chosen("decode_step"))
    report.sections["total_seconds"] = {"result": {"seconds": round(time.perf_counter() - report.start, 1)}}

    out_dir = Path(os.environ.get("OUT") or os.environ.get("INFER_BENCH_RESULTS")
                   or Path(tempfile.gettempdir()) / "infer-bench")  # as bench/throughput.py's RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("device_check_smoke.json" if args.smoke and not os.environ.get("OUT") else "device_check.json")
    path.write_text(json.dumps(report.sections, indent=1, default=str))
    print_table(report)
    print(f"\nwrote {path}")
    failed = [k for k, v in (report.sections.get("correctness", {}).get("result") or {}).items() if not v["ok"]]
    failed += [f"decode_step batch {r['batch']}" for r in report.sections.get("decode_step", {}).get("result") or []
               if not r.get("ok", True)]
    failed += ["engine"] if not (report.sections.get("engine", {}).get("result") or {"ok": True})["ok"] else []
    failed += ["int4pack_gemm"] if not (report.sections.get("int4pack_gemm", {}).get("result") or {"ok": True})["ok"] \
        else []
    errors = [k for k, v in report.sections.items() if "error" in v]
    if failed or errors:
        print(f"FAILED: {failed + errors}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
