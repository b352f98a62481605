"""``infer-bench replicas``: prefix-aware routing against round-robin over 2 replicas, and one tenant's
latency while another floods the engine (fair share against first come, first served).

routing: ``infer-replicas ART --replicas 2`` (one core each) under each policy in turn, the same
seeded workload both times: T tenants, each with its own long system prompt (about ``--prefix-tokens``
tokens), Poisson arrivals of streamed requests (the tenant's prompt plus a short question). Each
replica's KV cache holds ``--cache-prefixes`` system prompts, so the tenants' prompts fit across the
two caches but not into one. Reports prefix-cache hit rate (cached prompt tokens / prompt tokens) and
TTFT p50/p99 per policy.

fairness: one ``infer-run`` (both cores). Tenant b sends short requests at a steady rate, alone
(unloaded), then while tenant a sends ``--flood`` long prompts at once: with ``--tenants`` (fair
share, the per-step prompt budget) and without (first come, first served). Reports b's TTFT and
TPOT p50/p99 in each case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def stream_one(c: httpx.AsyncClient, url: str, body: dict, key: str | None = None) -> dict:
    """One streamed completion: TTFT, TPOT, cached prompt tokens (from infer-run's per-choice metrics)."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    cached = prompt = None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}, headers=headers) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"error": d["error"]}
            if d.get("usage"):
                prompt = d["usage"]["prompt_tokens"]
            for ch in d.get("choices", []):
                if ch.get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
                if ch.get("metrics"):
                    cached = ch["metrics"].get("num_cached_tokens")
    return {"ttft": (first or time.perf_counter()) - t0,
            "tpot": (last - first) / (n - 1) if n > 1 else None, "cached": cached,
            "prompt": prompt}


def _start(cmd: list[str], log: Path, env=None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    from infer.runtime.serving.replicas import wait_healthy

    if wait_healthy(url, timeout, proc):
        return
    if proc.poll() is not None:
        raise SystemExit(f"infer-bench replicas: the server exited:\n{log.read_text()[-3000:]}")
    raise SystemExit(f"infer-bench replicas: not ready after {timeout}s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


# ------------------------------------------------------------------ routing
async def routing_workload(url: str, prompts: list[str], questions: list[tuple[int, str]], rate: float,
                           max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as c:
        tasks = []
        for tenant, q in questions:
            body = {"prompt": prompts[tenant] + "\nQuestion: " + q, "max_tokens": max_tokens, "ignore_eos": True}
            tasks.append(asyncio.create_task(stream_one(c, url, body)))
            await asyncio.sleep(rng.expovariate(rate))
        out = await asyncio.gather(*tasks)
    return out


def run_routing(args, work: Path) -> dict:
    rng = random.Random(args.seed)
    prompts = [f"You are the assistant of tenant {t}. " + _text(rng, args.prefix_tokens * 10 // 18) for t in range(args.tenants)]
    questions = [(rng.randrange(args.tenants), _text(rng, 12)) for _ in range(args.requests)]
    per_token = 30 * 2 * 3 * 64 * 2  # the embedded model's K and V bytes per token in bfloat16
    kv = int(per_token * (args.cache_prefixes * (args.prefix_tokens + 64) + 1024))
    port = args.port
    results = {}
    for rnd in range(args.rounds):
        for policy in ("prefix", "round_robin"):
            log = work / f"replicas-{policy}-{rnd}.log"
            proc = _start([_bin("infer-replicas"), args.artifact, "--replicas", "2", "--port", str(port),
                           "--policy", policy, "--log-dir", str(work / f"logs-{policy}-{rnd}"),
                           "--dtype", args.dtype, "--kernels", args.kernels, "--kv-cache-memory", str(kv),
                           "--max-model-len", str(args.prefix_tokens * 2 + 512)], log)
            try:
                _wait_ready(f"http://127.0.0.1:{port}", proc, log)
                time.sleep(2)  # the router's first health checks
                t0 = time.perf_counter()
                out = asyncio.run(routing_workload(f"http://127.0.0.1:{port}", prompts, questions, args.rate,
                                                   args.max_tokens, args.seed))
                wall = time.perf_counter() - t0
                status = httpx.get(f"http://127.0.0.1:{port}/router/status", timeout=5).json()
            finally:
                _stop(proc)
            ok = [r for r in out if "error" not in r]
            res = results.setdefault(policy, {"ttft": [], "cached": [], "prompt": [], "errors": 0, "wall": [],
                                              "sent": []})
            res["ttft"] += [r["ttft"] for r in ok]
            res["cached"] += [r["cached"] or 0 for r in ok]
            res["prompt"] += [r["prompt"] or 0 for r in ok]
            res["errors"] += len(out) - len(ok)
            res["wall"].append(wall)
            res["sent"].append([b["sent"] for b in status["replicas"]])
            print(f"round {rnd} {policy}: TTFT p50 {pct([r['ttft'] for r in ok], 50):.3f}s "
                  f"p99 {pct([r['ttft'] for r in ok], 99):.3f}s, {len(out) - len(ok)} errors, {wall:.0f}s", flush=True)
    return results


# ------------------------------------------------------------------ fairness
async def fairness_phase(url: str, flood: int, rng_seed: int, args, keys: tuple[str, str]) -> list[dict]:
    rng = random.Random(rng_seed)
    async with httpx.AsyncClient(timeout=600) as c:
        flood_tasks = [asyncio.create_task(stream_one(c, url, {"prompt": _text(rng, args.prefix_tokens * 10 // 18),
                                                               "max_tokens": 16, "ignore_eos": True}, keys[0]))
                       for _ in range(flood)]
        await asyncio.sleep(0.5 if flood else 0)
        mine = []
        for i in range(args.probe):
            mine.append(asyncio.create_task(stream_one(c, url, {"prompt": _text(rng, 48), "max_tokens": 24,
                                                                "ignore_eos": True}, keys[1])))
            await asyncio.sleep(1.0 / args.probe_rate)
        out = await asyncio.gather(*mine)
        for t in flood_tasks:
            t.cancel()  # the client goes away: the server aborts them
        await asyncio.gather(*flood_tasks, return_exceptions=True)
    return out


def run_fairness(args, work: Path) -> dict:
    tenants = work / "tenants.yaml"
    tenants.write_text(f"prompt_tokens_per_step: {args.prompt_budget}\ndecode_slowdown_max: {args.decode_slowdown}\n"
                       f"tenants:\n  a: {{key: sk-a}}\n  b: {{key: sk-b}}\n")
    results = {}
    for mode in args.modes.split(","):
        log = work / f"fair-{mode}.log"
        extra = ["--tenants", str(tenants)] if mode == "fair" else ["--api-key", "sk-a"]
        proc = _start([_bin("infer-run"), args.artifact, "--port", str(args.port), "--dtype", args.dtype,
                       "--kernels", args.kernels, "--kv-cache-memory", "1G", "--step-trace",
                       str(work / f"fair-{mode}-steps.jsonl"), *extra], log)
        try:
            _wait_ready(f"http://127.0.0.1:{args.port}", proc, log)
            url = f"http://127.0.0.1:{args.port}"
            keys = ("sk-a", "sk-b") if mode == "fair" else ("sk-a", "sk-a")  # without the file: one key, one line
            for phase, flood in (("unloaded", 0), ("loaded", args.flood)):
                if mode == "fcfs" and phase == "unloaded":
                    continue
                out = asyncio.run(fairness_phase(url, flood, args.seed, args, keys))
                ok = [r for r in out if "error" not in r]
                key = "unloaded" if phase == "unloaded" else f"loaded-{mode}"
                results[key] = {"ttft": [r["ttft"] for r in ok], "tpot": [r["tpot"] for r in ok if r["tpot"]],
                                "errors": len(out) - len(ok)}
                print(f"{key}: TTFT p50 {pct(results[key]['ttft'], 50):.3f}s p99 {pct(results[key]['ttft'], 99):.3f}s, "
                      f"TPOT p50 {pct(results[key]['tpot'], 50) * 1e3:.1f}ms p99 {pct(results[key]['tpot'], 99) * 1e3:.1f}ms",
                      flush=True)
        finally:
            _stop(proc)
    return results


def main(argv=None) -> None:
    from .throughput import save_json

    p = argparse.ArgumentParser(prog="infer-bench replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--what", choices=["routing", "fairness", "both"], default="both")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1024, help="words of each tenant's system prompt (~tokens)")
    p.add_argument("--cache-prefixes", type=int, default=5, help="system prompts one replica's KV cache holds")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="prefix, round_robin, prefix, ... (interleaved)")
    p.add_argument("--flood", type=int, default=64, help="long prompts tenant a sends at once")
    p.add_argument("--probe", type=int, default=10, help="short requests tenant b sends")
    p.add_argument("--probe-rate", type=float, default=1.0)
    p.add_argument("--modes", default="fair,fcfs", help="fairness: fair (--tenants), fcfs (no tenants file)")
    p.add_argument("--prompt-budget", type=int, default=256, help="prompt_tokens_per_step in the tenants file")
    p.add_argument("--decode-slowdown", type=float, default=0, help="decode_slowdown_max in the tenants file (0: off)")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "infer-bench-replicas.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="infer-bench-replicas-"))
    result = {"bench": "replicas", "args": {k: str(v) for k, v in vars(args).items()}, "cores": len(os.sched_getaffinity(0))}
    if args.what in ("routing", "both"):
        r = run_routing(args, work)
        print(f"\n{'policy':<12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT mean':>9} {'TTFT p99':>9} {'errors':>6}  "
              f"sent per replica")
        for policy, v in r.items():
            v["hit_rate"] = sum(v["cached"]) / max(1, sum(v["prompt"]))  # cached prompt tokens / prompt tokens
            v["ttft_p50"], v["ttft_p99"] = pct(v["ttft"], 50), pct(v["ttft"], 99)
            v["ttft_mean"] = sum(v["ttft"]) / max(1, len(v["ttft"]))
            print(f"{policy:<12} {v['hit_rate']:>8.2f} {v['ttft_p50']:>8.3f}s {v['ttft_mean']:>8.3f}s "
                  f"{v['ttft_p99']:>8.3f}s {v['errors']:>6}  {v['sent']}")
        if "prefix" in r and "round_robin" in r:
            print(f"prefix-aware TTFT p50 is {r['round_robin']['ttft_p50'] / r['prefix']['ttft_p50']:.2f}x better, "
                  f"mean {r['round_robin']['ttft_mean'] / r['prefix']['ttft_mean']:.2f}x")
        result["routing"] = r
    if args.what in ("fairness", "both"):
        f = run_fairness(args, work)
        print(f"\n{'tenant b':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
        for k, v in f.items():
            v.update(ttft_p50=pct(v["ttft"], 50), ttft_p99=pct(v["ttft"], 99), tpot_p50=pct(v["tpot"], 50),
                     tpot_p99=pct(v["tpot"], 99))
            print(f"{k:<16} {v['ttft_p50']:>8.3f}s {v['ttft_p99']:>8.3f}s {v['tpot_p50'] * 1e3:>7.1f}ms "
                  f"{v['tpot_p99'] * 1e3:>7.1f}ms")
        result["fairness"] = f
    result["dtype"] = args.dtype
    save_json(result, args.out)


if __name__ == "__main__":
    main()
