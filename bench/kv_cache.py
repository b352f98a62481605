"""The int8 KV cache against the bfloat16 one, same run, interleaved rounds (../shared/notes/measuring.md).

1. The decode attention kernel per call at 2k context (the embedded model's shape: 9 query heads, 3 KV
   heads, head_dim 64, blocks of 16 scattered over a pool, its 30 layers' caches called in turn so that
   each call reads from memory as in a step), batches 1 and 16; each output is checked against a float64
   reference (of the dequantized cache for int8), so a fast wrong kernel fails.
2. A decode step of the engine at batch 16 over 2k-token contexts (ModelRunner.execute on a cache filled
   with random values: what a step costs does not depend on them), both engines loaded side by side.
3. Capacity: the blocks the same --kv-cache-memory holds.
4. Optionally (--kld-windows N) the mean KLD of the int8 cache against the model's own cache over N
   held-out 2048-token windows (pipeline/kv_cache.py's measurement), the model in float32 (the build's
   gate) and in bfloat16 (as served; and with the bfloat16 reference's prompt rows as decode rows, as the
   int8 cache's are: then the two runs differ by the format alone, not also by the prompt kernel's rounding).
5. Optionally (--chat N) greedy answers to N chat prompts (the eval's shipped set) with the float32 model
   and cache, the bfloat16 model and cache (prompts on the chunk kernel, and as decode rows), and the
   bfloat16 model on the int8 cache: how far the int8 cache's answers are from bfloat16's, beside how far
   bfloat16's are from float32's.
6. Optionally (--long N) long-prompt serving: N requests of 1,536 prompt tokens (held-out text, no shared
   prefixes) and 256 output tokens submitted at once, --kv-cache-memory sized so the bfloat16 cache holds
   N/2 of them whole: the most sequences running at once and the decode-phase output tok/s (decode-only
   steps, from the engine's step records), one engine per cache, one round.

7. Optionally (--formats N) why int8 and not fp8: one-byte formats emulated in transformers' forward of the
   artifact in float32 (K/V quantized per (token, KV head) row with a bfloat16 scale, after RoPE, as the
   cache holds them; prompt tokens attend to the quantized K/V as in the engine): int8 with turned keys
   (through the runtime's own store_kv_ and dequantize: a cross-check of its gate), fp8 e4m3 plain and
   with turned keys, fp8 e5m2
   (vLLM's CPU fp8); mean / p99 KLD and top-1 against the float32 cache over N held-out 2,048-token windows.

    flock -x /tmp/infer-cpu.lock python -m infer.bench.kv_cache ARTIFACT [--rounds 5] [--kld-windows 2] [--chat 16] [--long 32] [--formats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from .throughput import RESULTS, host_info, save_json

HEADS, KV_HEADS, D, BLOCK, LAYERS = 9, 3, 64, 16, 30


def _median_call(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _reference(q, k, v, tables, lens):
    out = []
    for i in range(q.shape[0]):
        keys = k[tables[i]].reshape(-1, KV_HEADS, D)[:lens[i]].double().transpose(0, 1)[None]
        vals = v[tables[i]].reshape(-1, KV_HEADS, D)[:lens[i]].double().transpose(0, 1)[None]
        o = torch.nn.functional.scaled_dot_product_attention(q[i].double()[None, :, None, :], keys, vals, enable_gqa=True)
        out.append(o[0, :, 0, :])
    return torch.stack(out)


def kernel_rows(rounds: int, context: int, batches: tuple[int, ...], gen: torch.Generator) -> list[dict]:
    """Per call, with LAYERS layers' caches read in turn as a step reads them: from memory, not from a
    last-level cache that one layer's cache would fit (13 MB of int8 at batch 16 does, and reads 1.6x faster)."""
    from infer.kernels import cpu_attention

    rows = []
    for batch in batches:
        per_seq = -(-context // BLOCK)
        pool = batch * per_seq + 8
        caches = {"bfloat16": [], "int8": []}
        for _ in range(LAYERS):
            k16 = torch.randn(pool, BLOCK, KV_HEADS, D, generator=gen).bfloat16()
            v16 = torch.randn(pool, BLOCK, KV_HEADS, D, generator=gen).bfloat16()
            k8 = torch.zeros(pool, *cpu_attention.block_shape(BLOCK, KV_HEADS, D, torch.int8), dtype=torch.int8)
            v8 = torch.zeros_like(k8)
            cpu_attention.store_kv_(k8, v8, torch.arange(pool * BLOCK), k16.view(-1, KV_HEADS, D),
                                    v16.view(-1, KV_HEADS, D))
            caches["bfloat16"].append((k16, v16))
            caches["int8"].append((k8, v8))
        tables = torch.randperm(pool, generator=gen)[:batch * per_seq].view(batch, per_seq)
        lens = torch.full((batch,), context)
        q = torch.randn(batch, HEADS, D, generator=gen).bfloat16()
        scale = D ** -0.5
        for name, layers in caches.items():  # checked once, on the first sequence of the first layer
            k, v = layers[0]
            got = cpu_attention.paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], scale)
            if name != "bfloat16":  # the int8 keys turned back (kernels/cpu_attention.py)
                k, v = cpu_attention.dequantize(k, keys=True), cpu_attention.dequantize(v)
            err = (got.double() - _reference(q[:1], k, v, tables[:1], lens[:1])).abs().max().item()
            if err > 2e-2:
                raise SystemExit(f"{name} decode kernel off by {err} from float64: not timing a wrong kernel")
        times = {name: [] for name in caches}
        for _ in range(rounds):  # interleaved: each round times both
            for name, layers in caches.items():
                per_call = []
                for k, v in layers * 2:
                    t = time.perf_counter()
                    cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale)
                    per_call.append(time.perf_counter() - t)
                times[name].append(statistics.median(per_call[LAYERS:]) * 1e6)  # the first pass warms up
        rows.append(_row(f"decode attention, batch {batch}, context {context}", "us/call", times))
        del caches
    return rows


def _row(what: str, unit: str, times: dict) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"what": what, "unit": unit, **{f"{k}_median": round(m, 2) for k, m in med.items()},
            **{f"{k}_spread": [round(min(v), 2), round(max(v), 2)] for k, v in times.items()},
            "int8_speedup": round(med["bfloat16"] / med["int8"], 3)}


def step_rows(artifact: Path, rounds: int, batch: int, context: int, gen: torch.Generator) -> tuple[list[dict], dict]:
    from infer.runtime import LLM
    from infer.runtime.engine.model_runner import kv_bytes_per_block
    from infer.runtime.engine.sampling_params import SamplingParams
    from infer.runtime.engine.scheduler import ScheduledBatch
    from infer.runtime.engine.sequence import Sequence

    per_seq = -(-(context + 1) // BLOCK)
    engines, kernels, block_bytes = {}, {}, {}
    for name in ("bfloat16", "int8"):
        probe = LLM(artifact, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory=64 << 20, max_num_seqs=1)
        per_block = kv_bytes_per_block(probe.engine.model, BLOCK, probe.engine.runner.kv_cache.dtype)
        probe.close()
        del probe
        block_bytes[name] = per_block
        llm = LLM(artifact, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory=(batch * per_seq + 2) * per_block,
                  max_num_seqs=batch, max_model_len=context + BLOCK)
        cache = llm.engine.runner.kv_cache
        if cache.dtype == torch.int8:
            cache.copy_(torch.randint(-127, 128, cache.shape, dtype=torch.int8, generator=gen))
            scale = torch.tensor([0.02], dtype=torch.bfloat16).view(torch.int8)  # a plausible scale on every row
            cache[..., -2:] = scale
        else:
            cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(cache.dtype))
        engines[name] = llm
        kernels[name] = llm.engine.plan.describe()
    vocab = engines["bfloat16"].engine.model.config.vocab_size
    seqs = []
    for i in range(batch):
        seq = Sequence(f"b{i}", torch.randint(3, vocab, (context + 1,), generator=gen).tolist(), SamplingParams())
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seq.num_computed_tokens = context
        seqs.append(seq)
    step = ScheduledBatch(seqs, [1] * batch, [])
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            times[name].append(_median_call(lambda: llm.engine.runner.execute(step), 5) * 1e3)
    return [_row(f"decode step, batch {batch}, context {context}", "ms/step", times)], {"plan": kernels,
                                                                                       "block_bytes": block_bytes}


def long_prompt_serving(artifact: Path, requests: int, prompt_tokens: int = 1536, output_tokens: int = 256,
                        whole: int | None = None) -> dict:
    """``requests`` long prompts at once through one engine per cache format, the memory the bfloat16 cache
    needs for ``whole`` of them (half by default): the most sequences running in a step, the mean batch of the decode-only steps
    (StepRecord.kind: the sequences decoding at once), and output tok/s over those steps and the whole run."""
    from infer.pipeline.kv_cache import eval_windows
    from infer.runtime import LLM, SamplingParams
    from infer.runtime.engine.model_runner import kv_bytes_per_block

    prompts = eval_windows(artifact, "pydoc_topics", prompt_tokens, requests)
    if len(prompts) < requests:
        raise SystemExit(f"--long {requests}: the held-out text gives {len(prompts)} prompts of {prompt_tokens} tokens")
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    out = {}
    memory = None
    for name in ("bfloat16", "int8"):
        llm = LLM(artifact, dtype="bfloat16", kv_cache_dtype=name, max_num_seqs=requests,
                  enable_prefix_caching=False, kv_cache_memory=memory or 64 << 20)
        engine = llm.engine
        if memory is None:  # half the requests whole in the bfloat16 cache, then the same bytes for int8
            bs = engine.config.block_size
            per_seq = -(-(prompt_tokens + output_tokens) // bs) * kv_bytes_per_block(engine.model, bs,
                                                                                    engine.model.dtype)
            memory = (whole or requests // 2) * per_seq
            llm.close()
            llm = LLM(artifact, dtype="bfloat16", kv_cache_dtype=name, max_num_seqs=requests,
                      enable_prefix_caching=False, kv_cache_memory=memory)
            engine = llm.engine
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        records = list(engine.step_records)
        decode = [r for r in records if r.kind == "decode"]
        decode_s = sum(r.dur_ms for r in decode) / 1e3
        out[name] = {"kv_cache_memory": memory, "blocks": engine.num_blocks,
                     "max_running": max(r.running for r in records),
                     "mean_decode_batch": round(sum(r.decode_rows for r in decode) / len(decode), 2) if decode else None,
                     "decode_tok_s": round(sum(r.decode_rows for r in decode) / decode_s, 2) if decode_s else None,
                     "output_tok_s": round(sum(len(o.token_ids) for o in outs) / wall, 2), "wall_s": round(wall, 1),
                     "steps": len(records), "preemptions": engine.scheduler.num_preemptions}
        llm.close()
    for key in ("max_running", "mean_decode_batch", "decode_tok_s", "output_tok_s"):
        b, q = out["bfloat16"][key], out["int8"][key]
        out.setdefault("int8_x", {})[key] = round(q / b, 3) if b and q else None
    return out


def one_byte_formats(artifact: Path, windows: int) -> dict:
    """Mean / p99 KLD and top-1 agreement of each one-byte KV format against the float32 cache (item 7 above)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from infer.kernels import cpu_attention
    from infer.pipeline.kv_cache import eval_windows

    def rows_scaled(x, top, cast):  # per row: a bfloat16 scale absmax / top, values cast against it
        s = (x.abs().amax(-1, keepdim=True) / top).bfloat16().float()
        return cast(x / torch.where(s > 0, s, 1)) * s

    def int8(keys):  # the runtime's own: store_kv_ quantizes (keys turned), dequantize reads back
        def through_the_cache(x):  # x [batch, kv_heads, tokens, head_dim]
            b, h, t, d = x.shape
            rows = x.transpose(1, 2).reshape(-1, h, d).contiguous()
            kc = torch.zeros(-(-len(rows) // BLOCK), *cpu_attention.block_shape(BLOCK, h, d, torch.int8),
                             dtype=torch.int8)
            vc = torch.zeros_like(kc)
            cpu_attention.store_kv_(kc, vc, torch.arange(len(rows)), rows, rows)  # x as keys and as values
            back = cpu_attention.dequantize(kc if keys else vc, keys=keys).reshape(-1, h, d)[:len(rows)]
            return back.reshape(b, t, h, d).transpose(1, 2)
        return through_the_cache

    def fp8(dtype, top):
        return lambda x: rows_scaled(x, top, lambda y: y.to(dtype).float())

    def turned(fn):  # keys: H k stored, turned back by H / n (kernels/cpu_attention.hadamard)
        return lambda x: fn(x @ cpu_attention.hadamard(x.shape[-1])) @ cpu_attention.hadamard(x.shape[-1]) / x.shape[-1]

    e4m3, e5m2 = fp8(torch.float8_e4m3fn, 448.0), fp8(torch.float8_e5m2, 57344.0)
    formats = {"float32": (None, None), "int8 (keys turned)": (int8(True), int8(False)), "fp8 e4m3": (e4m3, e4m3),
               "fp8 e4m3 (keys turned)": (turned(e4m3), e4m3), "fp8 e5m2": (e5m2, e5m2)}
    current = {}

    def attention(module, q, k, v, mask, **kw):
        kq, vq = current["fns"]
        if kq is not None:
            k, v = kq(k.float()).to(k.dtype), vq(v.float()).to(v.dtype)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("infer_kv_formats", attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32,
                                                              attn_implementation="infer_kv_formats").eval()
    texts = eval_windows(artifact, "pydoc_topics", 2048, windows)
    logp = {}
    for name, fns in formats.items():
        current["fns"] = fns
        with torch.no_grad():
            logp[name] = [model(torch.tensor([w])).logits[0].log_softmax(-1) for w in texts]
    out = {}
    for name in list(formats)[1:]:
        kld = torch.cat([(b.exp() * (b - a)).sum(-1) for a, b in zip(logp[name], logp["float32"])])
        top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(logp[name], logp["float32"])])
        out[name] = {"tokens": kld.numel(), "mean_kld": round(kld.mean().item(), 6),
                     "p99_kld": round(kld.quantile(0.99).item(), 5), "top1_agreement": round(top1.mean().item(), 4)}
    return out


def chat_agreement(artifact: Path, prompts: int, max_tokens: int) -> dict:
    """Greedy chat answers (the eval's shipped prompts) of four engines run one after another: float32
    model and cache, bfloat16 model and cache (prompt chunks on the chunk kernel, and as decode rows), bfloat16
    model on the int8 cache; each pair's agreement (the shared prefix's share of the longer answer,
    eval/metrics.py)."""
    from infer.eval.metrics import greedy_agreement, greedy_outputs, load_prompts
    from infer.runtime import LLM

    texts = load_prompts("default", prompts)
    answers = {}
    # kv_cache_dtype "bfloat16" is the 16-bit cache: the model's own dtype (float32 for the float32 engine)
    # "bfloat16 as decode rows": the bfloat16 cache read by the kernels that read the int8 cache (prompt rows as
    # decode rows): against it the int8 answers differ by the format alone, not also by the prompt kernel's rounding
    for name, dtype, kv, rows in (("float32", "float32", "bfloat16", "auto"), ("bfloat16", "bfloat16", "bfloat16", "auto"),
                                  ("bfloat16 as decode rows", "bfloat16", "bfloat16", "decode-rows"),
                                  ("int8", "bfloat16", "int8", "auto")):
        with LLM(artifact, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=256 << 20, prompt_rows=rows) as llm:
            answers[name] = greedy_outputs(llm, texts, max_tokens)
    pairs = {"bfloat16 vs float32": ("bfloat16", "float32"), "int8 vs bfloat16": ("int8", "bfloat16"),
             "int8 vs float32": ("int8", "float32"),
             "int8 vs bfloat16 as decode rows": ("int8", "bfloat16 as decode rows"),
             "bfloat16 as decode rows vs bfloat16": ("bfloat16 as decode rows", "bfloat16"),
             "bfloat16 as decode rows vs float32": ("bfloat16 as decode rows", "float32")}
    return {pair: greedy_agreement(answers[a], answers[b]) for pair, (a, b) in pairs.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the speed rows (0: skip them)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kld-windows", type=int, default=0, help="2048-token windows for the KLD (0: skip)")
    p.add_argument("--chat", type=int, default=0, help="chat prompts for greedy agreement (0: skip)")
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=0, help="long-prompt requests at once (0: skip)")
    p.add_argument("--long-whole", type=int, default=None,
                   help="--kv-cache-memory for this many whole long sequences in the bfloat16 cache (half of --long)")
    p.add_argument("--formats", type=int, default=0, help="2048-token windows for the one-byte formats (0: skip)")
    p.add_argument("--json", type=Path, default=RESULTS / "kv_cache.json")
    args = p.parse_args(argv)
    seed = int(time.time())
    print(f"seed {seed}; host {host_info().get('cpu')}; torch threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(seed)
    rows, engine = [], {"plan": None, "block_bytes": {}}
    if args.rounds:
        rows = kernel_rows(args.rounds, args.context, (1, args.batch), gen)
        more, engine = step_rows(args.artifact, args.rounds, args.batch, args.context, gen)
        rows += more
    memory = 1 << 30
    tokens = {name: memory // b * BLOCK for name, b in engine["block_bytes"].items()}
    result = {"benchmark": "kv_cache", "seed": seed, "rows": rows, "plan": engine["plan"],
              "capacity": {"kv_cache_memory": memory, "tokens": tokens,
                           "int8_x": round(tokens["int8"] / tokens["bfloat16"], 3) if tokens else None}}
    print(f"{'what':44} {'bfloat16':>10} {'int8':>10} {'int8 x':>7}  spread bf16 | int8")
    for r in rows:
        print(f"{r['what']:44} {r['bfloat16_median']:>10} {r['int8_median']:>10} {r['int8_speedup']:>7}  "
              f"{r['bfloat16_spread']} | {r['int8_spread']}  {r['unit']}")
    if args.kld_windows:
        from infer.pipeline.kv_cache import compare_caches, eval_windows

        windows = eval_windows(args.artifact, "pydoc_topics", 2048, args.kld_windows)
        # float32 compute (the build's gate: the format's own loss) and bfloat16 (as served: both runs' own
        # rounding drifts apart too)
        result["kld"] = {c: compare_caches(args.artifact, windows, compute=c) for c in ("float32", "bfloat16")}
        # in bfloat16 the served reference runs prompt chunks on the chunk kernel and the int8 cache as decode rows:
        # the same comparison with the reference's prompt rows as decode rows too leaves the format alone
        result["kld"]["bfloat16, reference as decode rows"] = compare_caches(args.artifact, windows, compute="bfloat16",
                                                                             reference_rows="decode-rows")
        for c, r in result["kld"].items():
            print(f"int8 vs {r['reference']} cache ({r['reference_rows']}), model in {c.split(',')[0]}:",
                  {k: r[k] for k in ("tokens", "mean_kld", "p99_kld", "top1_agreement")})
    if args.chat:
        result["chat"] = chat_agreement(args.artifact, args.chat, args.chat_tokens)
        for pair, r in result["chat"].items():
            print(f"greedy chat answers, {pair}: agreement {r['greedy_agreement']:.3f}, exact "
                  f"{r['greedy_exact_match']:.3f} over {r['prompts']} prompts")
    if args.long:
        result["long_prompts"] = long_prompt_serving(args.artifact, args.long, whole=args.long_whole)
        for name in ("bfloat16", "int8"):
            r = result["long_prompts"][name]
            print(f"long prompts, {name} cache: {r['max_running']} running at most, {r['mean_decode_batch']} "
                  f"decoding at once on average, decode phase "
                  f"{r['decode_tok_s']} tok/s, {r['output_tok_s']} output tok/s overall, {r['wall_s']} s, "
                  f"{r['preemptions']} preemptions")
        print("long prompts, int8 / bfloat16:", result["long_prompts"]["int8_x"])
    if args.formats:
        result["one_byte_formats"] = one_byte_formats(args.artifact, args.formats)
        for name, r in result["one_byte_formats"].items():
            print(f"{name:24} vs the float32 cache, model in float32 (transformers):", r)
    if tokens:
        print(f"capacity at --kv-cache-memory 1G: {tokens} tokens ({result['capacity']['int8_x']}x)")
        print("plan:", engine["plan"])
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
