"""The server against hostile and careless clients: every bound a 400 naming the field and the allowed
range, one request's failure never another's, tokenization off the event loop, the OpenAPI schema
(its bounds the validators' own, fuzzed with schemathesis), and a 30 s soak of 64 streaming clients
with disconnects and hostile requests mixed in.

Two servers: the embedded model in bfloat16 (the one the bugs were found on) and a tiny random
Llama with the same tokenizer, fast enough to fuzz. Both artifacts are built without the tune stage,
so the kernels are the defaults whatever the build machine measures.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from conftest import need
from stream_helpers import sse_events
from test_server import launch_server, wait_for, wait_ready

MAX_BODY = 1_000_000
TINY_CONTEXT = 64
TINY_QUEUE = 16


@pytest.fixture(scope="session")
def bf16_artifact(tmp_path_factory, cache_dir):
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    out = tmp_path_factory.mktemp("artifacts") / "smollm2-bf16"
    build(compose_recipe([f"output_dir={out}", f"cache_dir={cache_dir}", "model.dtype=bfloat16", "tune.enabled=false"]))
    return out


@pytest.fixture(scope="module")
def servers(bf16_artifact, tiny_artifact, tmp_path_factory):
    """Launched together so that they load in parallel."""
    big = launch_server(bf16_artifact, tmp_path_factory.mktemp("hard"), "--max-num-seqs", "64",
                        "--kv-cache-memory", "128M", "--max-queue", "512", "--max-body", str(MAX_BODY))
    tiny = launch_server(tiny_artifact, tmp_path_factory.mktemp("tiny"), "--max-model-len", str(TINY_CONTEXT),
                         "--max-num-seqs", "16", "--max-queue", str(TINY_QUEUE), "--kv-cache-memory", "16M",
                         "--max-body", str(MAX_BODY))
    yield big, tiny
    tiny.stop()
    assert big.stop() == 0


@pytest.fixture(scope="module")
def big(servers):
    return wait_ready(servers[0])


@pytest.fixture(scope="module")
def tiny(servers):
    return wait_ready(servers[1])


def post(server, path: str, body=None, content: bytes | None = None, timeout: float = 120) -> httpx.Response:
    if content is not None:
        return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=timeout)
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def refused(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def greedy(server, prompt: str, max_tokens: int) -> str:
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_no_blocks_held(server) -> dict:
    m = wait_for(lambda: (x := server.metrics())["infer:kv_cache_blocks_used"] == 0
                 and x["infer:num_requests_running"] == 0 and x["infer:num_requests_waiting"] == 0 and x, timeout=60)
    assert m, server.metrics()
    assert m["infer:kv_cache_usage_perc"] == 0
    return m


# ==================================================================================== bounds
HUGE = 10**400  # a JSON integer no float holds


@pytest.mark.parametrize("payload,param,says", [
    ({"top_k": 2**63}, "top_k", "[1, 49152]"), ({"top_k": 49153}, "top_k", "[1, 49152]"),
    ({"top_k": -2}, "top_k", "-1"),
    ({"n": 65}, "n", "[1, 64]"), ({"n": 0}, "n", "[1, 64]"), ({"n": 2, "best_of": 3}, "best_of", "n"),
    ({"best_of": 65}, "best_of", "[1, 64]"), ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"), ({"seed": 2**64}, "seed", "18446744073709551615"),
    ({"seed": -(2**63) - 1}, "seed", "-9223372036854775808"), ({"seed": 1.5}, "seed", "integer"),
    ({"stop_token_ids": [49152]}, "stop_token_ids", "[0, 49151]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "[0, 49151]"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"), ({"temperature": HUGE}, "temperature", "[0, 100]"),
    ({"temperature": 101}, "temperature", "[0, 100]"), ({"temperature": -0.5}, "temperature", "[0, 100]"),
    ({"top_p": 0}, "top_p", "(0, 1]"), ({"top_p": 1.5}, "top_p", "(0, 1]"), ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "[0.01, 10]"),
    ({"repetition_penalty": 11}, "repetition_penalty", "[0.01, 10]"),
    ({"repetition_penalty": HUGE}, "repetition_penalty", "[0.01, 10]"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"stop": ["x"] * 17}, "stop", "at most 16"), ({"stop": "x" * 257}, "stop", "256"), ({"stop": [7]}, "stop", "256"),
    ({"max_tokens": HUGE}, "max_tokens", "context limit"), ({"max_tokens": 0}, "max_tokens", "[1,"),
    ({"prompt": ["hi"] * 300}, "prompt", "at most 256"), ({"prompt": [[5] * 10**5]}, "prompt", "context limit"),
    ({"prompt": [2**63]}, "prompt", "outside the vocabulary"), ({"prompt": "hi", "n": 64, "max_tokens": 1}, "n", "16"),
    ({"prompt": ["hi"] * 17}, "prompt", "16"), ({"prompt": "a" * 3000}, "prompt", "2048 characters"),
    ({"user": 5}, "user", "string"), ({"echo": "yes"}, "echo", "true or false"),
    ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options", "true or false"),
])
def test_each_bound_is_a_400_naming_the_field_and_the_range(tiny, payload, param, says):
    """On the tiny server: a context of 64 tokens (2048 characters) and --max-queue 16."""
    err = refused(post(tiny, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **payload}), 400, param)
    assert says in err["message"], err


@pytest.mark.parametrize("payload,param,says", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20]"), ({"n": 17}, "n", "16"),
    ({"messages": [{"role": "user", "content": "x"}] * 1025}, "messages", "at most 1024"),
    ({"messages": [{"role": "user", "content": "a" * 1500}] * 2}, "messages", "2048 characters"),
    ({"max_completion_tokens": 64}, "max_completion_tokens", "[1, 63]"), ({"top_k": 2**63}, "top_k", "[1, 49152]"),
    ({"store": "yes"}, "store", "true or false"), ({"tools": [{"type": "function"}]}, "tools", '"type": "function"'),
])
def test_chat_bounds_are_400s_naming_the_field(tiny, payload, param, says):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **payload}
    err = refused(post(tiny, "/v1/chat/completions", body), 400, param)
    assert says in err["message"], err


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}'), ("/tokenize", b'{"prompt": "\xed\xa0\x80"}'),
])
def test_lone_surrogates_are_a_400_not_a_500(tiny, path, raw):
    assert "surrogate" in refused(post(tiny, path, content=raw))["message"]


def test_tokenize_and_detokenize_are_bounded_too(tiny):
    refused(post(tiny, "/tokenize", {"prompt": "a" * 3000}), 400, "prompt")
    refused(post(tiny, "/tokenize", {"prompt": "hi", "frobnicate": 1}), 400, "frobnicate")
    refused(post(tiny, "/detokenize", {"tokens": [49152]}), 400, "tokens")
    refused(post(tiny, "/detokenize", {"tokens": [1] * 65537}), 400, "tokens")
    assert post(tiny, "/tokenize", {"prompt": "a" * 2048}).json()["count"] > 0  # the bound itself is fine


# ==================================================================================== isolation over HTTP
def test_top_k_2_pow_63_beside_a_streaming_request(big):
    """The reported bug: a 2**63 top_k at temperature 1 while another request streams. The hostile
    one gets its 400 before anything is queued; the stream finishes with exactly its greedy output."""
    prompt = "The capital of France is"
    expected = greedy(big, prompt, 24)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{big.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = []
        for line in lines:  # the stream is running
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                break
        hostile = http.post(f"{big.url}/v1/completions", json={"prompt": "hi", "top_k": 2**63, "temperature": 1})
        err = refused(hostile, 400, "top_k")
        assert "[1, 49152]" in err["message"]
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert done and "error" not in events[-1]
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert_no_blocks_held(big)


def test_hostile_requests_beside_normal_ones_each_class(big):
    """A hostile request of each class (parameter out of range, bad token ids, pathological stop
    strings, malformed JSON, an oversized body) sent while normal requests run: each hostile one
    is refused alone, each normal one finishes with exactly its greedy output."""
    prompts = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]
    expected = {p: greedy(big, p, 12) for p in prompts}
    hostile = [({"prompt": "hi", "temperature": 1, "top_k": 2**63}, None, 400),
               ({"prompt": [10**9, 5]}, None, 400), ({"prompt": [-1]}, None, 400),
               ({"prompt": "hi", "stop": ["y" * 300]}, None, 400), ({"prompt": "hi", "stop": ["y"] * 1000}, None, 400),
               (None, b'{"prompt": "hi", "temperature": NaN}', 400), (None, b'{"prompt": ', 400),
               (None, b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}', 413)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            async def normal(p):
                r = await http.post(f"{big.url}/v1/completions",
                                    json={"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

            async def bad(body, raw):
                await asyncio.sleep(0)
                if raw is not None:
                    r = await http.post(f"{big.url}/v1/completions", content=raw,
                                        headers={"Content-Type": "application/json"})
                else:
                    r = await http.post(f"{big.url}/v1/completions", json=body)
                return r.status_code, r.json()

            return await asyncio.gather(*[normal(p) for p in prompts * 2],
                                        *[bad(b, raw) for b, raw, _ in hostile])

    results = asyncio.run(main())
    normals, bads = results[:len(prompts) * 2], results[len(prompts) * 2:]
    assert normals == [(200, expected[p]) for p in prompts * 2]
    assert [status for status, _ in bads] == [status for _, _, status in hostile], bads
    assert all(body["error"]["message"] for _, body in bads)
    assert_no_blocks_held(big)


# ==================================================================================== off the event loop
class _BlockingTokenizer:
    """encode() blocks until released: a tokenization that takes as long as the test likes."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text, add_special_tokens=False):
        self.entered.set()
        assert self.release.wait(30), "never released"
        return [1, 2, 3]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x", "max_tokens": 62}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "max_tokens": 62}),
                                       ("/tokenize", {"prompt": "x"})])
def test_tokenizing_does_not_block_health_or_other_requests(path, body):
    """In process, with a tokenizer that blocks until told: /health and /v1/models answer meanwhile.
    (max_tokens 62 of a 64-token context passes the early bound, then fails after tokenizing, so
    no engine is needed.)"""
    from infer.runtime.serving.app import build_app
    from infer.runtime.serving.metrics import ServerMetrics
    from infer.runtime.serving.protocol import ModelInfo
    from infer.runtime.serving.server import ServerConfig, State

    tok = _BlockingTokenizer()
    state = State(ServerConfig(), SimpleNamespace(manifest={"name": "m", "version": "1"}))
    state.metrics = ServerMetrics("m")
    state.info = ModelInfo("m", "1", 64, 100, tok)
    state.engine = SimpleNamespace(tokenizer=tok)
    state.ready = True
    app = build_app(state)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            slow = asyncio.create_task(http.post(path, json=body))
            assert await asyncio.to_thread(tok.entered.wait, 30)  # it is tokenizing now
            health = await asyncio.wait_for(http.get("/health"), 10)
            models = await asyncio.wait_for(http.get("/v1/models"), 10)
            tok.release.set()
            return health, models, await slow

    health, models, slow = asyncio.run(main())
    assert health.status_code == 200 and models.status_code == 200
    if path == "/tokenize":
        assert slow.json()["tokens"] == [1, 2, 3]
    else:
        refused(slow, 400, "max_tokens")  # 3 prompt tokens leave 61


# ==================================================================================== OpenAPI
def _schema(server) -> dict:
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _body(schema: dict, path: str) -> dict:
    """The JSON Schema of a POST route's request body."""
    return schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_openapi_documents_every_route_and_request_body(tiny):
    from infer.runtime.serving.protocol import CHAT_FIELDS, COMPLETION_FIELDS

    schema = _schema(tiny)
    assert schema["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health", "/metrics",
            "/v1/models", "/v1/models/{model_id}", "/tokenizer_info", "/version"} <= set(schema["paths"])
    for path, fields in [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)]:
        body = _body(schema, path)
        assert set(body["properties"]) == fields and body["additionalProperties"] is False
        assert "400" in schema["paths"][path]["post"]["responses"]
    props = _body(schema, "/v1/completions")["properties"]
    assert props["top_k"]["maximum"] == 49152 and props["max_tokens"]["maximum"] == TINY_CONTEXT - 1
    assert props["n"]["maximum"] == TINY_QUEUE  # --max-queue 16 bounds the fan-out


def _edges(name: str, prop: dict):
    """(value, accepted) at and just past each numeric bound the schema states for a field."""
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    hi = prop.get("maximum")
    step = 1 if prop["type"] == "integer" else 0.5
    if lo is not None:
        yield (lo, "exclusiveMinimum" not in prop)
        yield (lo - step, False)
    if hi is not None:
        yield (hi, True)
        yield (hi + step, False)


def test_schema_bounds_are_the_validators_bounds(tiny):
    """Walk the schema's own numbers: at each bound the server accepts, one step past it refuses
    naming the field. The schema and the 400s come from the same constants; this proves it."""
    schema = _schema(tiny)
    checked = []
    for path, base in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "logprobs": True})]:
        props = _body(schema, path)["properties"]
        for name, prop in props.items():
            if prop.get("type") not in ("integer", "number"):
                continue
            chat = path == "/v1/chat/completions"
            for value, ok in _edges(name, prop):
                body = {k: v for k, v in base.items()
                        if not (chat and name == "max_completion_tokens" and k == "max_tokens")}
                body[name] = value
                if name == "best_of":
                    body["n"] = value  # best_of must equal n
                if name == "max_tokens" and value == 0 and not chat:
                    body["echo"] = True  # 0 scores the prompt, with echo only
                r = post(tiny, path, body)
                if ok and chat and name in ("max_tokens", "max_completion_tokens") and r.status_code == 400:
                    # the chat template's own tokens take part of the context: refused after tokenizing
                    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
                elif ok:
                    assert r.status_code == 200, (path, name, value, r.text[:300])
                else:  # best_of moves n with it: whichever is checked first is named
                    assert refused(r, 400)["param"] in ({name} if name != "best_of" else {"n", "best_of"}), r.text
                checked.append((path, name, value))
    names = {n for _, n, _ in checked}
    assert {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "seed", "n", "best_of", "logprobs", "prompt_logprobs", "top_logprobs", "max_tokens",
            "max_completion_tokens"} <= names, names
    props = _body(schema, "/v1/completions")["properties"]
    stop = props["stop"]["anyOf"][1]
    longest = "z" * stop["items"]["maxLength"]
    assert post(tiny, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": [longest] * stop["maxItems"]}
                ).status_code == 200
    refused(post(tiny, "/v1/completions", {"prompt": "hi", "stop": [longest] * (stop["maxItems"] + 1)}), 400, "stop")
    refused(post(tiny, "/v1/completions", {"prompt": "hi", "stop": longest + "z"}), 400, "stop")
    ids = props["stop_token_ids"]
    top_id = ids["items"]["maximum"]
    assert post(tiny, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [top_id] * ids["maxItems"]}
                ).status_code == 200
    refused(post(tiny, "/v1/completions", {"prompt": "hi", "stop_token_ids": [top_id + 1]}), 400, "stop_token_ids")
    refused(post(tiny, "/v1/completions", {"prompt": "hi", "stop_token_ids": [0] * (ids["maxItems"] + 1)}), 400,
            "stop_token_ids")


FUZZ_EXAMPLES = {"POST": 34, "GET": 3}  # per operation and mode (positive, negative): under 300 cases in all


def test_schemathesis_fuzzing_finds_no_5xx(tiny, fresh_seed):
    """Schemathesis generates requests from /openapi.json, valid and invalid (for the request
    bodies): no answer is a 5xx, no stream carries a server error, and afterwards the server is
    healthy, answers as before, and holds no KV block. INFER_TEST_SEED replays the same cases."""
    schemathesis = need("schemathesis")
    import requests
    from hypothesis import HealthCheck, Phase, given, seed, settings

    expected = greedy(tiny, "The capital of France is", 8)
    schema = schemathesis.openapi.from_url(f"{tiny.url}/openapi.json")
    stats = {"cases": 0, "status": {}}
    failures = []
    session = requests.Session()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        has_body = op.method.upper() == "POST"  # a path parameter is any string: nothing invalid to make of it
        modes = [schemathesis.GenerationMode.POSITIVE] + [schemathesis.GenerationMode.NEGATIVE] * has_body
        for mode in modes:
            @seed(fresh_seed)
            @settings(max_examples=FUZZ_EXAMPLES[op.method.upper()], deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                stats["cases"] += 1
                r = case.call(base_url=tiny.url, session=session, timeout=60)
                stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
                if r.status_code >= 500 or b'"server_error"' in r.content:
                    failures.append((op.label, mode.value, r.status_code, case.body, r.content[:300]))

            fuzz()
    elapsed = time.monotonic() - t0
    print(f"schemathesis: {stats['cases']} cases in {elapsed:.0f}s, statuses {stats['status']}")
    assert stats["cases"] >= 150 and not failures, failures[:5]
    assert httpx.get(f"{tiny.url}/health").status_code == 200
    assert greedy(tiny, "The capital of France is", 8) == expected
    assert_no_blocks_held(tiny)


# ==================================================================================== soak
CLIENTS = 64
DURATION = 30.0
DRAIN_TIMEOUT = 150.0
SOAK_PROMPTS = ["Once upon a time", "The capital of France is", "List three colours:", "def fibonacci(n):",
                "Write a haiku about the sea.", "1, 2, 3, 4,", "The weather today is", "My favourite book is"]
SOAK_TOKENS = 6


def _hostile(rng: random.Random) -> tuple[dict | None, bytes | None, int]:
    """One hostile request: (json body or None, raw body or None, the status it must get)."""
    kind = rng.randrange(8)
    if kind == 0:
        return {"prompt": "hi", "temperature": 1, "top_k": 2**63, "stream": True}, None, 400
    if kind == 1:
        return {"prompt": "hi", "stop": ["x" * 200] * 2000}, None, 400  # a huge stop list
    if kind == 2:
        return {"prompt": "hi", rng.choice(["temperature", "top_p", "repetition_penalty"]): -1}, None, 400
    if kind == 3:
        return {"prompt": [49152 + rng.randrange(10**6)]}, None, 400
    if kind == 4:
        return None, b'{"prompt": "hi", "max_tokens": ' + str(10**400).encode() + b"}", 400
    if kind == 5:
        return None, rng.choice([b"{bad json", b'{"prompt": "x", "seed": NaN}', b"[1, 2]",
                                 b'{"prompt": "\\ud800"}']), 400
    if kind == 6:
        return None, b'{"prompt": "' + b"a" * (MAX_BODY + 1) + b'"}', 413  # oversized
    return {"prompt": ["hi"] * 300, "n": 64}, None, 400


async def _soak_one(http, url, rng, expected, stats):
    action = rng.random()
    if action < 0.25:
        body, raw, status = _hostile(rng)
        stats["hostile"] += 1
        if raw is not None:
            r = await http.post(f"{url}/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        else:
            r = await http.post(f"{url}/v1/completions", json=body)
        stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
        if r.status_code != status or "error" not in r.json():
            stats["wrong"].append((body or raw[:60], r.status_code, r.text[:200]))
        return
    disconnect = action < 0.40
    prompt = rng.choice(SOAK_PROMPTS)
    body = {"prompt": prompt, "max_tokens": SOAK_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    stats["requests"] += 1
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
        if r.status_code != 200:
            stats["wrong"].append((prompt, r.status_code, (await r.aread())[:200]))
            return
        events, done = await sse_events(r, drop_after_first=disconnect)
        if disconnect and events:
            stats["disconnects"] += 1
            return  # leaving the block drops the connection mid-stream
        text = "".join(c["text"] for e in events for c in e.get("choices", []))
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        usage = events[-1].get("usage") if events else None
        if done and reasons == ["length"] and usage and usage["completion_tokens"] == SOAK_TOKENS \
                and text == expected[prompt]:
            stats["complete"] += 1
        else:
            stats["wrong"].append((prompt, text, expected[prompt], events[-2:]))


async def _soak(url, expected):
    stats = {"requests": 0, "complete": 0, "disconnects": 0, "hostile": 0, "status": {}, "wrong": [], "errors": []}
    stop_at = time.monotonic() + DURATION

    async def client(i):
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as http:
            while time.monotonic() < stop_at:
                try:
                    await _soak_one(http, url, rng, expected, stats)
                except httpx.HTTPError as e:
                    stats["errors"].append(repr(e))

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    done, pending = await asyncio.wait(tasks, timeout=DURATION + DRAIN_TIMEOUT)
    for t in pending:
        t.cancel()
    stats["hung_clients"] = len(pending)
    stats["errors"] += [repr(t.exception()) for t in done if t.exception() is not None]
    return stats


@pytest.mark.slow
def test_soak_64_streaming_clients_with_disconnects_and_hostile_requests(big):
    expected = {p: greedy(big, p, SOAK_TOKENS) for p in SOAK_PROMPTS}
    before = big.metrics()
    stats = asyncio.run(_soak(big.url, expected))
    m = assert_no_blocks_held(big)
    five = sum(n for code, n in stats["status"].items() if code >= 500)
    print(f"soak: {stats['requests']} normal requests, {stats['complete']} complete with their greedy output, "
          f"{stats['disconnects']} disconnects, {stats['hostile']} hostile, statuses {stats['status']}, "
          f"{five} 5xx, {int(m['infer:kv_cache_blocks_used'])} blocks held after")
    assert stats["hung_clients"] == 0 and not stats["errors"], stats["errors"][:5]
    assert five == 0 and not stats["wrong"], stats["wrong"][:5]
    assert stats["complete"] + stats["disconnects"] == stats["requests"] and stats["complete"] > 0
    assert stats["hostile"] > 0 and stats["disconnects"] > 0
    aborted = 'infer:request_success_total{finished_reason="abort",model_name="smollm2-135m-instruct"}'
    assert m[aborted] > before[aborted]  # the disconnects reached the engine as aborts
    assert httpx.get(f"{big.url}/health").status_code == 200
    assert {p: greedy(big, p, SOAK_TOKENS) for p in SOAK_PROMPTS} == expected


@pytest.mark.parametrize("option,value,bound", [("--max-num-seqs", "0", "below 1"), ("--max-tokens", "-3", "below 1"),
                                                ("--prefill-batch-tokens", "-1", "below 0"),
                                                ("--port", "65536", "above 65535"), ("--port", "0", "below 1"),
                                                ("--max-num-batched-tokens", "many", "not an integer")])
def test_infer_run_refuses_out_of_range_counts_before_loading_anything(option, value, bound, capsys):
    from infer.runtime.cli import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["no-such-artifact", option, value])  # refused at parse time: the artifact is never opened
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and bound in err, err
    assert parse_args(["a", "--prefill-batch-tokens", "0"]).prefill_batch_tokens == 0  # 0: a documented setting
