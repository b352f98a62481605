"""``infer-bench serve``: load an OpenAI-compatible server with Poisson arrivals and measure latency.

Every request streams (``/v1/completions``, or ``/v1/chat/completions`` for chat datasets); the
client times the first token (TTFT), the gaps between tokens (ITL), time per output token after the
first (TPOT) and end-to-end latency. Queue time is what the server reports per request (infer's
``metrics`` field on the final chunk); a server that does not report it shows n/a. Output tokens
are counted from the final usage (``stream_options.include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room mother area money story month lot right "
         "study book job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back parent "
         "face others level office door health art war history party result change morning reason research").split()


@dataclass
class Result:
    ok: bool
    status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    queue_time: float | None = None
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    start: float = 0.0


# ------------------------------------------------------------------------------ workload
def load_dataset(path: str, n: int, default_max_tokens: int, rng: random.Random) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "messages" in d:
            item = {"messages": d["messages"]}
        else:
            text = d.get("prompt", d.get("text"))
            if not isinstance(text, str):
                raise SystemExit(f"infer-bench: error: {path}: each line needs 'prompt' (or 'text' or 'messages')")
            item = {"prompt": text}
        item["max_tokens"] = int(d.get("max_tokens", d.get("output_len", default_max_tokens)))
        rows.append(item)
    if not rows:
        raise SystemExit(f"infer-bench: error: {path} holds no prompts")
    return [rows[i % len(rows)] for i in range(n)] if len(rows) >= n else [rng.choice(rows) for _ in range(n)]


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int | None,
                    rng: random.Random) -> list[dict]:
    """Random lengths uniform in [len * (1 - r), len * (1 + r)], as the engine benchmark draws them."""
    def draw(length):
        lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
        return rng.randint(lo, hi)

    items = []
    for _ in range(n):
        k = draw(input_len)
        if vocab:  # exact prompt lengths: token ids, away from the special tokens at the start of the vocabulary
            prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(k)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(k))
        items.append({"prompt": prompt, "max_tokens": draw(output_len)})
    return items


# ------------------------------------------------------------------------------ requests
async def one_request(http: httpx.AsyncClient, base: str, model: str, item: dict, args) -> Result:
    chat = "messages" in item
    body = {"model": model, "max_tokens": item["max_tokens"], "stream": True, "temperature": args.temperature,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = item["messages"]
    else:
        body["prompt"] = item["prompt"]
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    res = Result(ok=False, start=time.perf_counter())
    t0 = res.start
    last = None
    try:
        async with http.stream("POST", url, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = str(ev["error"])[:200]
                    return res
                now = time.perf_counter()
                for c in ev.get("choices") or []:
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if text:
                        if res.ttft is None:
                            res.ttft = now - t0
                        elif last is not None:
                            res.itl.append(now - last)
                        last = now
                    if c.get("finish_reason"):
                        res.finish_reason = c["finish_reason"]
                    m = c.get("metrics")
                    if m and m.get("queue_time") is not None:
                        res.queue_time = m["queue_time"]
                if ev.get("usage"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
            res.e2e = time.perf_counter() - t0
            res.ok = done and res.finish_reason is not None
            if res.ttft is not None and res.output_tokens > 1:
                res.tpot = (res.e2e - res.ttft) / (res.output_tokens - 1)
            if not res.ok and res.error is None:
                res.error = "stream ended early"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args, items: list[dict], model: str) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=64)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    results: list[Result | None] = [None] * len(items)
    bar = _bar(len(items), args.quiet)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=_headers(args)) as http:
        async def fire(i, item):
            if sem:
                async with sem:
                    results[i] = await one_request(http, args.url, model, item, args)
            else:
                results[i] = await one_request(http, args.url, model, item, args)
            bar.update()

        t0 = time.perf_counter()
        tasks = []
        for i, item in enumerate(items):
            tasks.append(asyncio.create_task(fire(i, item)))
            if args.rate != math.inf and i + 1 < len(items):
                await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals
        await asyncio.wait(tasks, timeout=args.timeout + 60)
        duration = time.perf_counter() - t0
    bar.close()
    return [r or Result(ok=False, error="did not finish") for r in results], duration


def _bar(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=quiet, file=sys.stderr)


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# ------------------------------------------------------------------------------ summary
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    metrics = {"ttft": [r.ttft for r in ok if r.ttft is not None],
               "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [x for r in ok for x in r.itl],
               "e2e": [r.e2e for r in ok if r.e2e is not None],
               "queue_time": [r.queue_time for r in ok if r.queue_time is not None]}
    for name, vals in metrics.items():
        summary[name] = {"mean": (sum(vals) / len(vals)) if vals else None,
                         **{f"p{q}": percentile(vals, q) for q in (50, 95, 99)}}
    return summary


def table(s: dict, args) -> str:
    def ms(v):
        return "n/a" if v is None else f"{v * 1000:.1f}"

    lines = [f"infer-bench serve: {args.url}  rate {args.rate:g} req/s  {s['requests']} requests",
             f"  completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.1f} s",
             f"  request throughput {s['request_throughput']:.3f} req/s  output {s['output_throughput']:.2f} tok/s  "
             f"(prompt tokens {s['total_prompt_tokens']}, output tokens {s['total_output_tokens']})",
             "", f"  {'metric (ms)':<22}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}"]
    for key, label in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (inter-token)"), ("e2e", "end-to-end"),
                       ("queue_time", "queue time")]:
        m = s[key]
        lines.append(f"  {label:<22}{ms(m['mean']):>10}{ms(m['p50']):>10}{ms(m['p95']):>10}{ms(m['p99']):>10}")
    if s["errors"]:
        lines += ["", "  errors:"] + [f"    {e}" for e in s["errors"]]
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = [("TTFT (s)", [r.ttft for r in ok if r.ttft is not None]),
              ("TPOT (s)", [r.tpot for r in ok if r.tpot is not None]),
              ("end-to-end (s)", [r.e2e for r in ok if r.e2e is not None]),
              ("queue time (s)", [r.queue_time for r in ok if r.queue_time is not None])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (label, vals) in zip(axes.flat, series):
        if vals:
            ax.hist(vals, bins=min(30, max(5, len(vals) // 2)), color="#4c72b0", alpha=0.85)
            for q, style in ((50, "-"), (95, "--"), (99, ":")):
                ax.axvline(percentile(vals, q), color="k", linestyle=style, linewidth=1, label=f"p{q}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="infer-bench serve",
                                description="Load an OpenAI-compatible server with Poisson arrivals of streaming "
                                            "requests; report TTFT, TPOT, ITL, end-to-end and queue time.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--rate", type=float, default=math.inf,
                   help="mean arrival rate in requests/s, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    p.add_argument("--dataset", default=None,
                   help="JSONL of {\"prompt\": ...} or {\"messages\": [...]} (optional \"max_tokens\"); default random")
    p.add_argument("--input-len", type=int, default=128, help="random workload: mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="mean output tokens (default 32)")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="random lengths are uniform in [len*(1-r), len*(1+r)] (default 0.5)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore it so output lengths are as drawn)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default $INFER_API_KEY / $OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--json", default=None, help="write the summary and per-request records here")
    p.add_argument("--plot", default=None, help="write a PNG of the latency distributions here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rate <= 0:
        p.error("--requests must be >= 1 and --rate > 0")
    if args.api_key is None:
        import os

        args.api_key = os.environ.get("INFER_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    args.url = args.url.rstrip("/").removesuffix("/v1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    try:
        with httpx.Client(timeout=30, headers=_headers(args)) as http:
            models = http.get(f"{args.url}/v1/models")
            models.raise_for_status()
            model = args.model or models.json()["data"][0]["id"]
            vocab = None
            if not args.dataset:
                info = http.get(f"{args.url}/tokenizer_info")
                vocab = info.json().get("vocab_size") if info.status_code == 200 else None
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"infer-bench: error: cannot reach a server at {args.url}: {e}", file=sys.stderr)
        return 1
    items = (load_dataset(args.dataset, args.requests, args.output_len, rng) if args.dataset else
             random_workload(args.requests, args.input_len, args.output_len, args.range_ratio, vocab, rng))
    results, duration = asyncio.run(run(args, items, model))
    summary = summarize(results, duration)
    print(table(summary, args))
    if args.json:
        config = {k: (None if v == math.inf else v) for k, v in vars(args).items() if k != "api_key"}
        Path(args.json).write_text(json.dumps({"config": config, "model": model, "summary": summary,
                                               "requests": [asdict(r) for r in results]}, indent=2) + "\n")
        print(f"  json: {args.json}")
    if args.plot:
        plot(results, args.plot, f"{model} @ {args.rate:g} req/s ({summary['completed']} requests)")
        print(f"  plot: {args.plot}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
