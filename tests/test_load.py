"""A bounded load test of the real server: 64 concurrent streaming clients for 30 s.

It stops by itself: clients stop starting requests after 30 s and everything in flight must end
within a further bounded wait. Afterwards: no 5xx, every response complete (a [DONE], a finish
reason and exact usage), and no KV block left held. One request in eight is abandoned by its client
after the first chunk, so the abort path is loaded too.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from stream_helpers import sse_events
from test_server import start_server, wait_for

pytestmark = pytest.mark.slow

CLIENTS = 64
DURATION = 30.0
DRAIN_TIMEOUT = 150.0
PROMPTS = ["Once upon a time", "The capital of France is", "List three colours:", "def fibonacci(n):",
           "Write a haiku about the sea.", "1, 2, 3, 4,", "The weather today is", "My favourite book is"]


@pytest.fixture(scope="module")
def load_server(embedded_artifact, tmp_path_factory):
    s = start_server(embedded_artifact, tmp_path_factory.mktemp("load"), "--max-num-seqs", "64",
                     "--kv-cache-memory", "128M", "--max-queue", "1000")
    yield s
    assert s.stop() == 0


async def _one(http: httpx.AsyncClient, url: str, model: str, rng: random.Random, abandon: bool, stats: dict) -> None:
    max_tokens = rng.randint(1, 6)
    body = {"model": model, "prompt": f"{rng.choice(PROMPTS)} ({rng.randint(0, 10**6)})", "max_tokens": max_tokens,
            "temperature": 0.8, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
            if r.status_code != 200:
                await r.aread()
                return
            events, done = await sse_events(r, drop_after_first=abandon)
            if abandon and events:
                stats["abandoned"] += 1
                return  # leaving the block drops the connection mid-stream
            reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
            usage = events[-1].get("usage") if events else None
            if (done and reasons == ["length"] and usage and usage["completion_tokens"] == max_tokens
                    and "error" not in events[-1]):
                stats["complete"] += 1
            else:
                stats["incomplete"].append(events[-2:] if events else "no events")
    except httpx.HTTPError as e:
        stats["errors"].append(repr(e))


async def _client(i: int, url: str, model: str, stop_at: float, stats: dict) -> None:
    rng = random.Random(i)
    k = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
        while time.monotonic() < stop_at:
            await _one(http, url, model, rng, abandon=((i + k) % 8 == 0), stats=stats)
            k += 1


async def _run(url: str, model: str) -> dict:
    stats = {"status": {}, "complete": 0, "abandoned": 0, "incomplete": [], "errors": []}
    stop_at = time.monotonic() + DURATION
    tasks = [asyncio.create_task(_client(i, url, model, stop_at, stats)) for i in range(CLIENTS)]
    done, pending = await asyncio.wait(tasks, timeout=DURATION + DRAIN_TIMEOUT)
    for t in pending:
        t.cancel()
    stats["hung_clients"] = len(pending)
    for t in done:
        if t.exception() is not None:
            stats["errors"].append(repr(t.exception()))
    return stats


def test_64_streaming_clients_for_30s_no_5xx_no_leaks(load_server, embedded_artifact):
    model = json.loads((embedded_artifact / "manifest.json").read_text())["name"]
    t0 = time.monotonic()
    stats = asyncio.run(_run(load_server.url, model))
    elapsed = time.monotonic() - t0
    print(f"load: {elapsed:.0f}s, statuses {stats['status']}, {stats['complete']} complete, "
          f"{stats['abandoned']} abandoned on purpose")
    assert stats["hung_clients"] == 0 and not stats["errors"], stats["errors"][:5]
    assert not any(code >= 500 for code in stats["status"]), stats["status"]
    assert set(stats["status"]) == {200}, stats["status"]
    assert not stats["incomplete"], stats["incomplete"][:3]
    # every response either completed in full or was dropped on purpose by its client
    assert stats["complete"] + stats["abandoned"] == stats["status"][200] and stats["complete"] > 0
    m = wait_for(lambda: (x := load_server.metrics())["infer:kv_cache_blocks_used"] == 0
                 and x["infer:num_requests_running"] == 0 and x["infer:num_requests_waiting"] == 0 and x, timeout=30)
    assert m, load_server.metrics()
    assert m["infer:kv_cache_usage_perc"] == 0
    assert m["infer:request_success_total"] >= stats["complete"]
