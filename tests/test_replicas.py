"""Replicas behind the router: the prefix-aware policy and its balance against load (no processes), then
one deployment of a tiny model: SIGKILL of a replica under load (every request ends within 30 s, a
broken stream with an SSE error event, the deployment whole again within 60 s) and a rolling upgrade
under load with no failed request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from infer.runtime.serving.router import BLOCK_CHARS, Router, prefix_chain, request_text
from test_server import free_port


def test_prefix_chain_is_a_chain_of_full_blocks():
    a = "x" * (BLOCK_CHARS * 3 + 10)
    b = "x" * (BLOCK_CHARS * 2) + "y" * (BLOCK_CHARS + 10)
    ca, cb = prefix_chain(a), prefix_chain(b)
    assert len(ca) == 3 and ca[:2] == cb[:2] and ca[2] != cb[2]
    assert prefix_chain("short") == []
    assert request_text({"messages": [{"role": "system", "content": "S"}]}) != request_text({"prompt": "S"})


def test_prefix_policy_sticks_to_the_replica_holding_the_prefix_unless_it_is_far_busier():
    r = Router(["http://a", "http://b"], "prefix", threshold=0.5, balance=2)
    for b in r.backends:
        b.healthy = True
    tenants = [prefix_chain(f"tenant {t} " * 400) for t in range(4)]
    first = {}
    for t, chain in enumerate(tenants):  # new prefixes spread out (least busy, then fewest cached blocks)
        b = r.choose(chain, set())
        b.remember(chain)
        first[t] = b.url
    assert sorted(first.values()) == ["http://a", "http://a", "http://b", "http://b"]
    for t, chain in enumerate(tenants):  # and come back to where they were sent
        assert r.choose(chain + prefix_chain("question " * 100), set()).url == first[t]
    home = r.backend(first[0])
    home.inflight = 3  # three more in flight than the other: past the balance, load wins
    assert r.choose(tenants[0], set()).url != first[0]
    home.inflight = 2
    assert r.choose(tenants[0], set()).url == first[0]
    home.healthy = False  # a replica that is down gets nothing
    assert r.choose(tenants[0], set()).url != first[0]
    assert r.choose(tenants[0], {"http://a", "http://b"}) is None


def test_round_robin_alternates_and_a_bad_policy_is_refused():
    r = Router(["http://a", "http://b"], "round_robin")
    for b in r.backends:
        b.healthy = True
    assert [r.choose([], set()).url for _ in range(4)] == ["http://a", "http://b"] * 2
    with pytest.raises(ValueError, match="choose one of prefix, round_robin"):
        Router(["http://a"], "cache")


def _status(url: str) -> dict:
    return httpx.get(f"{url}/router/status", timeout=5).json()


def _wait(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s")


async def _load(url: str, n: int, tokens: int, during=None) -> list[dict]:
    """``n`` requests at once, half streamed (each kind on both replicas); ``during()`` runs once the first stream has its first token."""
    first = asyncio.Event()

    async def one(c: httpx.AsyncClient, i: int) -> dict:
        body = {"prompt": f"request {i} " * 20, "max_tokens": tokens, "ignore_eos": True, "stream": i % 4 < 2}
        t0 = time.monotonic()
        try:
            if body["stream"]:
                got, err = 0, None
                async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            err = d.get("error", err)
                            got += "choices" in d
                            first.set()
                return {"stream": True, "status": r.status_code, "tokens": got, "error": err,
                        "seconds": time.monotonic() - t0}
            r = await c.post(f"{url}/v1/completions", json=body)
            return {"stream": False, "status": r.status_code, "error": r.json().get("error"),
                    "retry_after": r.headers.get("retry-after"), "seconds": time.monotonic() - t0}
        except httpx.HTTPError as e:
            return {"stream": body["stream"], "status": None, "error": repr(e), "seconds": time.monotonic() - t0}

    async with httpx.AsyncClient(timeout=60) as c:
        tasks = [asyncio.create_task(one(c, i)) for i in range(n)]
        if during is not None:
            await asyncio.wait_for(first.wait(), 30)
            await asyncio.to_thread(during)
        return await asyncio.gather(*tasks)


def _stop(procs: list[subprocess.Popen], log, log_path) -> None:
    """SIGTERM (they drain), SIGKILL past 40 s; then the first one's log, for a failure's report."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(40)
        except subprocess.TimeoutExpired:
            p.kill()
    log.close()
    print(log_path.read_text()[-3000:])


def test_sigkill_under_load_then_rolling_upgrade(tiny_artifact, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    link = tmp_path / "current"
    link.symlink_to(tiny_artifact)
    exe = os.path.join(os.path.dirname(sys.executable), "infer-replicas")
    log = open(tmp_path / "replicas.log", "wb")
    proc = subprocess.Popen([exe, str(link), "--replicas", "2", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
                             "--grace-period", "20", "--kernels", "torch", "--kv-cache-memory", "16M",
                             "--max-model-len", "512"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200 and
              all(b["healthy"] for b in _status(url)["replicas"]), 120)
        pids = {}

        def kill_one():
            out = subprocess.run(["pgrep", "-f", "--", f"--port {port + 1} "], capture_output=True, text=True).stdout.split()
            pids["killed"] = int(out[0])
            pids["at"] = time.monotonic()
            os.kill(pids["killed"], signal.SIGKILL)

        results = asyncio.run(_load(url, 8, 300, during=kill_one))
        ended = time.monotonic() - pids["at"]
        print("after SIGKILL:", [(r["stream"], r["status"], r.get("tokens"), (r["error"] or {}).get("code")
                                  if isinstance(r["error"], dict) else r["error"]) for r in results])
        assert ended < 30  # every request ended within 30 s of the kill
        for r in results:
            assert r["status"] is not None, r  # none was left hanging or cut without a reply
            if r["error"] is not None:  # a retriable failure: a stream's SSE error event, or a 503 to retry
                assert (r["stream"] and r["error"]["code"] == "replica_failed") or \
                       (r["status"] == 503 and r["retry_after"]), r
        assert any(r["error"] is None for r in results)
        back = _wait(lambda: all(b["healthy"] for b in _status(url)["replicas"]), 60)
        print(f"back to 2 replicas {back + ended:.1f}s after the kill")

        def upgrade():
            proc.send_signal(signal.SIGHUP)

        before = {b["url"]: b for b in _status(url)["replicas"]}
        rolled = asyncio.run(_load(url, 8, 150, during=upgrade))
        assert all(r["status"] == 200 and r["error"] is None for r in rolled), rolled  # no failed request
        _wait(lambda: "upgrade done" in (tmp_path / "replicas.log").read_text(), 90)
        after = _status(url)["replicas"]
        assert all(b["healthy"] for b in after) and all(b["sent"] > before[b["url"]]["sent"] for b in after)
    finally:
        _stop([proc], log, tmp_path / "replicas.log")


def test_fields_a_router_adds_at_their_defaults_are_accepted():
    """vllm-router and SGLang's router add these to every body they forward (measured); other values stay refused."""
    from infer.runtime.serving.protocol import APIError, ModelInfo, parse_completion

    info = ModelInfo("m", "1", 64, 100, tokenizer=None)
    assert parse_completion({"prompt": [5], "no_stop_trim": False, "return_hidden_states": False}, info).prompts == [[5]]
    with pytest.raises(APIError, match="no_stop_trim"):
        parse_completion({"prompt": [5], "no_stop_trim": True}, info)


def _node(artifact, port: int, log_path) -> subprocess.Popen:
    """One infer-run as a machine of its own would run it (docs/replicas.md, multi-node, step 1)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "infer.runtime.cli", str(artifact), "--host", "127.0.0.1",
                                 "--port", str(port), "--kernels", "torch", "--kv-cache-memory", "16M",
                                 "--max-model-len", "512"], stdout=log, stderr=subprocess.STDOUT)


def _prefix_hits(node_url: str) -> float:
    text = httpx.get(f"{node_url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("infer:prefix_cache_hits"))


def test_two_nodes_behind_a_router_only_front(tiny_artifact, tmp_path):
    """docs/replicas.md's multi-node deployment on loopback: two infer-run "nodes" started on their own, the
    front machine's infer-replicas with no replica of its own (--replicas 0) and both as --worker. Prefixes
    stick to the node that holds them (its prefix cache hits), a node SIGKILLed is routed around with no
    failed request, and the same node started again by its service manager gets traffic again."""
    ports = [free_port() for _ in range(3)]
    nodes_urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    url = f"http://127.0.0.1:{ports[2]}"
    nodes = [_node(tiny_artifact, p, tmp_path / f"node{i}.log") for i, p in enumerate(ports[:2])]
    exe = os.path.join(os.path.dirname(sys.executable), "infer-replicas")
    log = open(tmp_path / "front.log", "wb")
    front = subprocess.Popen([exe, "--replicas", "0", "--port", str(ports[2]), "--log-dir", str(tmp_path / "logs"),
                              *(a for u in nodes_urls for a in ("--worker", u))], stdout=log, stderr=subprocess.STDOUT)

    def sent() -> dict:
        return {b["url"]: b["sent"] for b in _status(url)["replicas"]}

    def ask(tenant: int, question: str) -> set[str]:
        """One request of a tenant (its ~130-token system prompt, then a question); the nodes it was sent to (two
        when the first failed it and the router retried it on the other)."""
        before = sent()
        prompt = f"tenant {tenant} rules: " + "answer briefly and politely. " * 20 + question
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        return {u for u, n in sent().items() if n > before[u]}

    try:
        _wait(lambda: [b["url"] for b in _status(url)["replicas"] if b["healthy"]] == nodes_urls, 120)
        first = {t: ask(t, "What is a list?") for t in range(4)}
        assert all(len(n) == 1 for n in first.values()) and set.union(*first.values()) == set(nodes_urls), first
        # (new prefixes spread over both nodes)
        hits = {u: _prefix_hits(u) for u in nodes_urls}
        for t in range(4):  # each tenant's next request goes to the node holding its prefix, and hits there
            assert ask(t, "And a tuple?") == first[t]
        assert all(_prefix_hits(u) > hits[u] for u in nodes_urls), (hits, {u: _prefix_hits(u) for u in nodes_urls})

        nodes[1].kill()  # a node is lost: its tenants' requests are retried on the other, none fails
        nodes[1].wait()
        after = [ask(t, "And a set?") for t in range(4)]
        assert all(nodes_urls[0] in n for n in after), after  # (a first attempt on the dead node, if any, retried)
        _wait(lambda: not _status(url)["replicas"][1]["healthy"], 10)  # marked down (a failed attempt, a health check)
        assert ask(0, "And a set?") == ask(1, "And a set?") == {nodes_urls[0]}  # not tried again while down

        nodes[1] = _node(tiny_artifact, ports[1], tmp_path / "node1.log")  # its service manager restarts it
        back = _wait(lambda: _status(url)["replicas"][1]["healthy"], 120)
        print(f"node 1 back in the router {back:.1f}s after it was started again")
        assert set.union(*(ask(t, "And a dict?") for t in range(4, 8))) == set(nodes_urls)  # new tenants reach it
    finally:
        _stop([front, *nodes], log, tmp_path / "front.log")


def test_a_router_only_front_needs_workers():
    from infer.runtime.serving.replicas import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--replicas", "0"])
    args, _ = parse_args(["--replicas", "0", "--worker", "http://node2:8001"])
    assert args.artifact is None and args.worker == ["http://node2:8001"]
