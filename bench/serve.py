"""``infer-bench serve``: load OpenAI-compatible servers with Poisson arrivals and measure latency.

Every request streams (``/v1/completions``, or ``/v1/chat/completions`` for chat datasets); the
client times the first token (TTFT), the gaps between tokens (ITL), time per output token after the
first (TPOT) and end-to-end latency. Queue time is what the server reports per request (infer's
``metrics`` field on the final chunk); a server that does not report it shows n/a. Output tokens
are counted from the final usage (``stream_options.include_usage``).

``--url`` loads one server. ``--target NAME=URL[@MODEL]`` (repeatable) runs the same workload (the
same prompts, output lengths and arrival times) against each target in turn, prints them side by
side, and writes one JSON entry per target in the fields of vLLM's ``vllm bench serve
--save-result``, so that either tool's results read the same. ``--rounds N`` repeats that N times,
the targets' order reversed every other round (A B, B A, ...) so that a host growing slower or
faster mid-run weighs on each alike, and every round its own random prompts (the same arrival
times), so that no server's prefix cache answers a round from the one before (which is also why
two runs against one server want different ``--seed``). Each target's entry then holds the median
over rounds of every figure, ``rounds`` every round's full entries, and ``ratios`` the first
target's figures over each other's, round by round and their median: on a shared host one round's
p99 moves by 10-30%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from infer.runtime.artifact import TOKENIZER

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


def load_tokenizer(path: str):
    """A ``tokenizers`` tokenizer from an artifact or model directory (its tokenizer.json) or the file."""
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / TOKENIZER if p.is_dir() else p
    if not file.is_file():
        raise SystemExit(f"infer-bench: error: --tokenizer {path}: no tokenizer.json there")
    return Tokenizer.from_file(str(file))


def exact_length_text(tok, ids: list[int], length: int, allowed: list[int], rng: random.Random) -> tuple[str, int]:
    """Text that encodes to ``length`` tokens, from ``ids``: decoded text can re-encode to another
    count, so decode, re-encode, then pad with random allowed ids or cut, up to 10 times (as vLLM's
    random dataset does). Returns the text and the token count it encodes to."""
    for _ in range(10):
        text = tok.decode(ids, skip_special_tokens=False)
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) == length:
            return text, length
        ids = ids[:length] if len(ids) > length else ids + [rng.choice(allowed) for _ in range(length - len(ids))]
    text = tok.decode(ids, skip_special_tokens=False)
    return text, len(tok.encode(text, add_special_tokens=False).ids)


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int | None,
                    rng: random.Random, tokenizer=None) -> list[dict]:
    """Random lengths uniform in [len * (1 - r), len * (1 + r)], as the engine benchmark draws them.

    With a tokenizer (the servers'), each prompt is text of exactly its drawn length in tokens, built
    as vLLM's random dataset builds it: consecutive non-special token ids from a random offset, decoded.
    Else, with ``vocab`` (every target reports that vocabulary size), the prompt is the token ids
    themselves; else words, whose token count only the server knows (``prompt_len`` None)."""
    def draw(length):
        lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
        return rng.randint(lo, hi)

    if tokenizer is not None:
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        allowed = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
        reserved = tokenizer.num_special_tokens_to_add(False)  # what the server's encoding adds (BOS)
    items = []
    for i in range(n):
        k = draw(input_len)
        if tokenizer is not None:
            offset = rng.randrange(len(allowed))
            k = max(1, k - reserved)
            ids = [allowed[(offset + i + j) % len(allowed)] for j in range(k)]
            prompt, prompt_len = exact_length_text(tokenizer, ids, k, allowed, rng)
        elif vocab:  # exact prompt lengths: token ids, away from the special tokens at the start of the vocabulary
            prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(k)]
            prompt_len = k
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(k))
            prompt_len = None
        items.append({"prompt": prompt, "max_tokens": draw(output_len), "prompt_len": prompt_len})
    return items


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of ``rate`` per second
    (all at 0 for an infinite rate). The same seed gives every target the same times."""
    rng = random.Random(seed + 1)
    offsets = [0.0]
    for _ in range(n - 1):
        offsets.append(offsets[-1] + (0.0 if rate == math.inf else rng.expovariate(rate)))
    return offsets


# ------------------------------------------------------------------------------ requests
async def one_request(http: httpx.AsyncClient, base: str, model: str, item: dict, args) -> Result:
    chat = "messages" in item
    body = {"model": model, "max_tokens": item["max_tokens"], "stream": True, "temperature": args.temperature,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.json_schema is not None:  # the structured workload: vLLM and infer both take this field
        body["structured_outputs"] = {"json": args.json_schema}
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


async def run(args, items: list[dict], base: str, model: str, offsets: list[float]) -> tuple[list[Result], float]:
    """Sends ``items[i]`` at ``offsets[i]`` seconds from the start; returns the results and the duration."""
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=64)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    results: list[Result | None] = [None] * len(items)
    bar = _bar(len(items), args.quiet)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=_headers(args)) as http:
        async def fire(i, item):
            if sem:
                async with sem:
                    results[i] = await one_request(http, base, model, item, args)
            else:
                results[i] = await one_request(http, base, model, item, args)
            bar.update()

        t0 = time.perf_counter()
        tasks = []
        for i, item in enumerate(items):
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, item)))
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


def _ms_stats(name: str, seconds: list[float]) -> dict:
    """vLLM's statistics of one latency in ms: mean, median, population std, p50, p99 (0 when empty, as vLLM)."""
    v = [x * 1000 for x in seconds] or [0.0]
    mean = sum(v) / len(v)
    return {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(v, 50),
            f"std_{name}_ms": math.sqrt(sum((x - mean) ** 2 for x in v) / len(v)),
            f"p50_{name}_ms": percentile(v, 50), f"p99_{name}_ms": percentile(v, 99)}


def vllm_result(results: list[Result], items: list[dict], duration: float, args) -> dict:
    """One run in the fields of ``vllm bench serve --save-result`` (with its per-request lists).

    A prompt's length is the workload's own count where it knows it (token ids, or text made to a
    length under --tokenizer), else what the server reported using. Failed requests count 0
    output tokens and a TTFT of 0 in the lists, and stay out of every statistic, as in vLLM."""
    ok = [r for r in results if r.ok]
    input_lens = [it.get("prompt_len") or r.prompt_tokens for r, it in zip(results, items)]
    output_lens = [r.output_tokens if r.ok else 0 for r in results]
    total_input = sum(n for n, r in zip(input_lens, results) if r.ok)
    total_output = sum(output_lens)
    entry = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "num_prompts": len(results), "request_rate": "inf" if args.rate == math.inf else args.rate,
        "burstiness": 1.0, "max_concurrency": args.max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_output / duration if duration else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration else 0.0,
        "input_lens": input_lens, "output_lens": output_lens,
        "ttfts": [(r.ttft or 0.0) for r in results], "itls": [r.itl for r in results],
        "errors": [r.error or "" for r in results],
    }
    for name, vals in (("ttft", [r.ttft for r in ok if r.ttft is not None]),
                       ("tpot", [r.tpot for r in ok if r.tpot is not None]),
                       ("itl", [x for r in ok for x in r.itl]),
                       ("e2el", [r.e2e for r in ok if r.e2e is not None])):
        entry.update(_ms_stats(name, vals))
    return entry


def compare_table(entries: dict[str, dict], workload: str) -> str:
    """The targets side by side: one column each."""
    rows = [("completed / failed", lambda e: f"{e['completed']} / {e['failed']}"),
            ("duration (s)", lambda e: f"{e['duration']:.1f}"),
            ("request/s", lambda e: f"{e['request_throughput']:.3f}"),
            ("output tok/s", lambda e: f"{e['output_throughput']:.2f}"),
            ("input / output tokens", lambda e: f"{e['total_input_tokens']} / {e['total_output_tokens']}")]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        for q in ("p50", "p99"):
            rows.append((f"{label} {q} (ms)", lambda e, k=f"{q}_{key}_ms": f"{e[k]:.1f}"))
    width = 2 + max(12, *(len(n) for n in entries), *(len(cell(e)) for _, cell in rows for e in entries.values()))
    lines = [f"infer-bench serve: {workload}", "",
             f"  {'':<24}" + "".join(f"{name:>{width}}" for name in entries)]
    lines += [f"  {label:<24}" + "".join(f"{cell(e):>{width}}" for e in entries.values()) for label, cell in rows]
    for name, e in entries.items():
        errors = sorted({x for x in e["errors"] if x})[:5]
        if errors:
            lines += ["", f"  {name} errors:"] + [f"    {x}" for x in errors]
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
def parse_target(text: str) -> tuple[str, str, str | None]:
    """``NAME=URL[@MODEL]`` as (name, base URL, model or None)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=URL or NAME=URL@MODEL")
    url, _, model = rest.partition("@")
    return name, url.rstrip("/").removesuffix("/v1"), model or None


def _schema_file(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{path}: not a readable JSON schema ({e})") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="infer-bench serve",
                                description="Load OpenAI-compatible servers with Poisson arrivals of streaming "
                                            "requests; report TTFT, TPOT, ITL, end-to-end and queue time.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="one server's base URL (default http://127.0.0.1:8000)")
    where.add_argument("--target", action="append", type=parse_target, metavar="NAME=URL[@MODEL]",
                       help="a server to compare, repeatable: each runs the same workload in turn (same prompts, "
                            "same arrival times); a side-by-side table, and --json in vLLM's result fields. "
                            "MODEL: the name to request (default --model, else the first of its /v1/models)")
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--rate", type=float, default=math.inf,
                   help="mean arrival rate in requests/s, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    p.add_argument("--dataset-name", choices=["random", "jsonl"], default=None,
                   help="random prompts, or the JSONL file of --dataset (default: jsonl with --dataset, else random)")
    p.add_argument("--dataset", default=None,
                   help="JSONL of {\"prompt\": ...} or {\"messages\": [...]} (optional \"max_tokens\")")
    p.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (default 32)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths are uniform in [len*(1-r), len*(1+r)] (default 0: exactly the lengths given)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the servers' tokenizer (an artifact or model directory, or its tokenizer.json): random "
                        "prompts become text of exactly their length in tokens, as vLLM's random dataset makes "
                        "them (default: token ids where every target reports the same vocabulary size in "
                        "/tokenizer_info, else words)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json-schema", type=_schema_file, default=None, metavar="FILE",
                   help="the structured workload: every request's output held to this JSON schema")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so each output runs to its max_tokens (default on; --no-ignore-eos lets "
                        "requests stop at EOS)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default $INFER_API_KEY / $OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--json", default=None, help="write the summary and per-request records here")
    p.add_argument("--plot", default=None, help="--url only: write a PNG of the latency distributions here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--rounds", type=int, default=1,
                   help="--target only: run the targets this many times, order reversed every other round, and "
                        "report medians and per-round ratios (default 1)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rate <= 0:
        p.error("--requests must be >= 1 and --rate > 0")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.rounds > 1 and not args.target:
        p.error("--rounds compares targets round by round: use it with --target")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    args.dataset_name = args.dataset_name or ("jsonl" if args.dataset else "random")
    if (args.dataset_name == "jsonl") != bool(args.dataset):
        p.error("--dataset-name jsonl needs --dataset FILE, and --dataset is a jsonl dataset")
    if args.tokenizer and args.dataset_name != "random":
        p.error("--tokenizer makes random prompts; a --dataset brings its own")
    if args.target:
        names = [t[0] for t in args.target]
        if len(set(names)) != len(names):
            p.error(f"--target names must differ: {', '.join(names)}")
        if args.plot:
            p.error("--plot draws one server's distributions: use it with --url")
    if args.api_key is None:
        import os

        args.api_key = os.environ.get("INFER_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    if not args.target:
        args.url = (args.url or "http://127.0.0.1:8000").rstrip("/").removesuffix("/v1")
    return args


def probe(http: httpx.Client, url: str, model: str | None, want_vocab: bool) -> tuple[str, int | None]:
    """A server's model name (``model``, else the first of its /v1/models) and, when asked, the
    vocabulary size its /tokenizer_info reports (None where it has none)."""
    models = http.get(f"{url}/v1/models")
    models.raise_for_status()
    model = model or models.json()["data"][0]["id"]
    vocab = None
    if want_vocab:
        info = http.get(f"{url}/tokenizer_info")
        vocab = info.json().get("vocab_size") if info.status_code == 200 else None
    return model, vocab


def server_info(http: httpx.Client, url: str) -> dict | None:
    """What a server says of itself at /version (infer: its version, model and kernels; vLLM: its
    version), so a saved figure names what ran; None where it answers nothing there."""
    try:
        answer = http.get(f"{url}/version")
        return answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def describe_workload(args, items: list[dict], vocab: int | None) -> str:
    if args.dataset_name == "jsonl":
        prompts = f"prompts from {args.dataset}"
    else:
        spread = f" (±{args.range_ratio:.0%})" if args.range_ratio else ""
        kind = (f"text made to length with {args.tokenizer}" if args.tokenizer else
                "token ids" if vocab else "words; lengths as each server counts them")
        prompts = f"random prompts of {args.input_len} tokens{spread} ({kind}), outputs of {args.output_len}{spread}"
    eos = "ignore_eos" if args.ignore_eos else "may stop at EOS"
    held = "; outputs held to a JSON schema" if args.json_schema is not None else ""
    return f"{len(items)} requests at {args.rate:g} req/s (Poisson, seed {args.seed}); {prompts}; {eos}{held}"


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    targets = args.target or [("", args.url, None)]
    want_vocab = args.dataset_name == "random" and not args.tokenizer
    models, vocabs, servers = {}, [], {}
    with httpx.Client(timeout=30, headers=_headers(args)) as http:
        for name, url, model in targets:
            try:
                models[name], vocab = probe(http, url, model or args.model, want_vocab)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                print(f"infer-bench: error: cannot reach a server at {url}: {e}", file=sys.stderr)
                return 1
            vocabs.append(vocab)
            servers[name] = server_info(http, url)
    vocab = vocabs[0] if want_vocab and len(set(vocabs)) == 1 else None  # token ids only where all agree
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer and args.dataset_name == "random" else None

    def workload_items(round_index: int) -> list[dict]:
        """Round 0's prompts come from --seed; each later round draws its own, so that a server's prefix
        cache cannot answer a round from the one before (the arrival times stay the same)."""
        r = rng if round_index == 0 else random.Random(f"{args.seed}/round {round_index}")
        if args.dataset_name == "jsonl":
            return load_dataset(args.dataset, args.requests, args.output_len, r)
        return random_workload(args.requests, args.input_len, args.output_len, args.range_ratio, vocab, r, tokenizer)

    items = workload_items(0)
    if args.rounds > 1 and args.dataset_name == "jsonl":
        print("infer-bench serve: warning: every round sends the dataset's prompts again; a server that caches "
              "prefixes answers the later rounds' from its cache", file=sys.stderr)
    offsets = arrival_offsets(len(items), args.rate, args.seed)
    config = {k: (None if v == math.inf else v) for k, v in vars(args).items() if k != "api_key"}
    from .throughput import host_info  # local: it imports torch, which the client needs for nothing else

    # which machine (the client's; the servers' too when they are local) and which kernels the figures come from
    where = {"host": host_info(), "servers": servers}
    if not args.target:
        return report_one(args, items, offsets, models[""], config, where)

    workload = describe_workload(args, items, vocab)
    rounds = []
    for r in range(args.rounds):
        if r:
            items = workload_items(r)
        entries = {}
        label = f"round {r + 1}/{args.rounds}: " if args.rounds > 1 else ""
        for name, url, _ in (targets if r % 2 == 0 else targets[::-1]):
            print(f"infer-bench serve: {label}{name} ({url}, model {models[name]}): {workload}", file=sys.stderr,
                  flush=True)
            # one request first, not counted (as vLLM's client does): a server's one-off first-call costs stay out
            warm, _ = asyncio.run(run(args, items[:1], url, models[name], [0.0]))
            if not warm[0].ok:
                print(f"infer-bench: error: {name}: the warm-up request failed: {warm[0].error}", file=sys.stderr)
                return 1
            results, duration = asyncio.run(run(args, items, url, models[name], offsets))
            entries[name] = {"label": name, "base_url": url, "model_id": models[name],
                             **vllm_result(results, items, duration, args)}
        rounds.append({name: entries[name] for name, _, _ in targets})
        if args.rounds > 1:
            print(compare_table(rounds[-1], f"round {r + 1} of {args.rounds}: {workload}"), flush=True)
    if args.rounds == 1:
        entries, summary = rounds[0], {}
    else:
        entries = {name: median_entry([rd[name] for rd in rounds]) for name, _, _ in targets}
        summary = {"rounds": rounds, "ratios": ratios(rounds, [name for name, _, _ in targets])}
    print(compare_table(entries, (f"median of {args.rounds} rounds: " if args.rounds > 1 else "") + workload))
    if summary:
        print(ratio_table(summary["ratios"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, **where, "workload": workload, "targets": entries,
                                               **summary}, indent=2) + "\n")
        print(f"  json: {args.json}")
    return 0 if all(e["failed"] == 0 for rd in rounds for e in rd.values()) else 1


RATIO_FIELDS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput")


def median_entry(entries: list[dict]) -> dict:
    """One target over rounds: each numeric figure's median (the per-request lists stay in ``rounds``)."""
    first = entries[0]
    out = {k: first[k] for k in ("label", "base_url", "model_id", "num_prompts", "request_rate", "burstiness",
                                 "max_concurrency")}
    for key, value in first.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in out:
            out[key] = statistics.median(e[key] for e in entries)
    out["errors"] = sorted({x for e in entries for x in e["errors"] if x})
    out["rounds"] = len(entries)
    return out


def ratios(rounds: list[dict], names: list[str]) -> dict:
    """The first target's figures over each other target's, per round and their median: a ratio taken
    within a round compares two runs minutes apart, not a fast round of one against a slow of the other."""
    subject = names[0]
    out = {}
    for other in names[1:]:
        per = {}
        for key in RATIO_FIELDS:
            values = [rd[subject][key] / rd[other][key] for rd in rounds if rd[other][key]]
            per[key] = {"rounds": values, "median": statistics.median(values) if values else None}
        out[f"{subject}/{other}"] = per
    return out


def ratio_table(table: dict) -> str:
    lines = []
    for pair, per in table.items():
        lines += ["", f"  {pair}, round by round (median):"]
        for key, v in per.items():
            each = " ".join(f"{x:.2f}" for x in v["rounds"])
            med = "n/a" if v["median"] is None else f"{v['median']:.2f}x"
            lines.append(f"    {key:<20} {med:>7}   ({each})")
    return "\n".join(lines)


def report_one(args, items: list[dict], offsets: list[float], model: str, config: dict, where: dict) -> int:
    """``--url``: one server's table, JSON (config, summary, every request) and plot."""
    results, duration = asyncio.run(run(args, items, args.url, model, offsets))
    summary = summarize(results, duration)
    print(table(summary, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, **where, "model": model, "summary": summary,
                                               "requests": [asdict(r) for r in results]}, indent=2) + "\n")
        print(f"  json: {args.json}")
    if args.plot:
        plot(results, args.plot, f"{model} @ {args.rate:g} req/s ({summary['completed']} requests)")
        print(f"  plot: {args.plot}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
