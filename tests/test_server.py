"""The HTTP server (`infer-run ARTIFACT`), started for real on a free local port and driven with the
official `openai` client and raw httpx: every endpoint, streaming, each error, disconnects, overload, SIGTERM.

The helpers at the top are shared with test_load.py.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conftest import need


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    proc: subprocess.Popen
    url: str
    log_path: Path
    health_seen: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return parse_metrics(text)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} and {'name': value summed over labels} for every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        out[name] = out.get(name, 0.0) + value
    return out


def launch_server(artifact: Path, log_dir: Path, *args: str) -> RunningServer:
    """Starts ``infer-run`` on a free port without waiting for it (see ``wait_ready``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"server-{port}.log"
    exe = Path(sys.executable).parent / "infer-run"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen([str(exe), str(artifact), "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT)
    return RunningServer(proc, url, log_path)


def wait_ready(server: RunningServer, ready_timeout: float = 180) -> RunningServer:
    """Polls /health every 0.1 s, recording what it answered, until 200."""
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"infer-run exited with {server.proc.returncode}:\n{server.log()}")
        try:
            status = httpx.get(f"{server.url}/health", timeout=2).status_code
            server.health_seen.append(status)
            if status == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"infer-run not ready after {ready_timeout}s:\n{server.log()}")


def start_server(artifact: Path, log_dir: Path, *args: str, ready_timeout: float = 180) -> RunningServer:
    return wait_ready(launch_server(artifact, log_dir, *args), ready_timeout)


# ==================================================================================== fixtures
import json  # noqa: E402
import threading  # noqa: E402

import openai  # noqa: E402
import pytest  # noqa: E402

KEY = "test-key"
SECRET = "zebra-marmalade-7731"  # appears in a prompt; must never reach the log without --log-requests


@pytest.fixture(scope="module")
def servers(embedded_artifact, tmp_path_factory):
    """Both servers of this module, launched together so that they load in parallel."""
    main = launch_server(embedded_artifact, tmp_path_factory.mktemp("server"), "--api-key", KEY,
                         "--max-num-seqs", "8", "--kv-cache-memory", "64M", "--max-body", "1000000")
    small = launch_server(embedded_artifact, tmp_path_factory.mktemp("small"), "--max-num-seqs", "1",
                          "--max-queue", "2", "--kv-cache-memory", "64M", "--grace-period", "6", "--log-requests")
    yield main, small
    small.stop()
    assert main.stop() == 0


@pytest.fixture(scope="module")
def server(servers):
    return wait_ready(servers[0])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(embedded_artifact):
    return json.loads((embedded_artifact / "manifest.json").read_text())["name"]


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=auth(), timeout=10).json()["tokens"]


def wait_for(pred, timeout: float = 30, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    return pred()


# ==================================================================================== endpoints
def test_health_is_not_ready_until_loaded_then_models_lists_the_artifact(server, client, model, embedded_artifact):
    assert 503 in server.health_seen and server.health_seen[-1] == 200  # loading, then ready
    manifest = json.loads((embedded_artifact / "manifest.json").read_text())
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["version"] == manifest["version"]
    assert client.models.retrieve(model).id == model
    assert "ready on http://127.0.0.1" in server.log()


def test_completion_greedy_exact_usage_and_logprobs(server, client, model):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text.startswith(" Paris")
    assert r.usage.prompt_tokens == len(tokenize(server, prompt))
    assert r.usage.completion_tokens == 4 == len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    assert "".join(c.logprobs.tokens) == c.text
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(lp - max(top.values())) < 1e-4 for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs))


def test_chat_uses_the_artifact_template_and_streaming_matches(server, client, model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant" and "Paris" in text
    template = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}, headers=auth()).json()
    assert r.usage.prompt_tokens == template["count"]
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    u = chunks[-1].usage
    assert chunks[-1].choices == [] and (u.prompt_tokens, u.completion_tokens, u.total_tokens) == \
        (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    assert u.prompt_tokens_details.cached_tokens > 0  # the same chat prompt again: a prefix-cache hit
    assert all(ch.usage is None for ch in chunks[:-1])


def test_n_seed_stop_and_engine_extras(server, client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=3, temperature=1.0, n=2, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # concurrently: the same batch, still the same answers
        a, b = pool.map(lambda _: client.completions.create(**kw), range(2))
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 6 and a.usage.prompt_tokens == len(tokenize(server, "Once upon a time"))
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  top_p=0.9, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text and "Paris" in r.choices[0].text
    # streamed with a stop string: nothing past it leaks out
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stop=["."], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_logprobs_scores_the_prompt_like_lm_eval(server, client, model):
    ids = tokenize(server, "The capital of France is Paris")
    # what lm-eval's local-completions sends for loglikelihood requests
    r = client.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True,
                                  seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith("The capital of France is Paris")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    # max_tokens=0 with echo: scoring only
    r0 = client.completions.create(model=model, prompt=[ids], max_tokens=0, logprobs=0, echo=True)
    assert r0.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert r0.usage.completion_tokens == 0 and r0.choices[0].text == "The capital of France is Paris"
    info = httpx.get(f"{server.url}/tokenizer_info", headers=auth()).json()
    assert info["eos_token"] and info["chat_template"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=auth()).json()["prompt"] == \
        "The capital of France is Paris"


def test_lm_eval_local_completions_evaluates_the_server(server, model, tmp_path, monkeypatch):
    need("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "capitals.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in [
        {"q": "The capital of France is", "choices": [" Paris", " Berlin"], "label": 0},
        {"q": "The capital of Germany is", "choices": [" Madrid", " Berlin"], "label": 1},
    ]) + "\n")
    (tmp_path / "capitals.yaml").write_text(
        "task: capitals_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: label\n"
        "doc_to_choice: '{{choices}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    res = simple_evaluate(model="local-completions",
                          model_args=f"base_url={server.url}/v1/completions,model={model},auth_token={KEY},"
                                     "tokenizer_backend=remote,max_retries=1,batch_size=4",
                          tasks=["capitals_tiny"],
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    assert res["results"]["capitals_tiny"]["acc,none"] == 1.0


def test_tokenize_detokenize_and_version(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}, headers=auth()).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=auth()).json()["prompt"] == \
        "hello world"
    assert httpx.get(f"{server.url}/version").status_code == 200


def test_metrics_names_follow_vllm_with_the_infer_prefix(server):
    m = server.metrics()
    for name in ["infer:num_requests_running", "infer:num_requests_waiting", "infer:kv_cache_usage_perc",
                 "infer:prefix_cache_queries_total", "infer:prefix_cache_hits_total",
                 "infer:time_to_first_token_seconds_bucket", "infer:time_per_output_token_seconds_bucket",
                 "infer:inter_token_latency_seconds_bucket", "infer:e2e_request_latency_seconds_bucket",
                 "infer:request_queue_time_seconds_bucket", "infer:prompt_tokens_total",
                 "infer:generation_tokens_total", "infer:request_success_total", "infer:kv_cache_blocks_used"]:
        assert name in m, name
    assert m["infer:generation_tokens_total"] > 0 and m["infer:request_success_total"] > 0
    assert m["infer:prefix_cache_hits_total"] > 0  # the same prompts were sent more than once
    assert httpx.get(f"{server.url}/metrics").headers["content-type"].startswith("text/plain")


# ==================================================================================== errors
def _err(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert body["message"] and body["type"]
    if param is not None:
        assert body["param"] == param, body
    return body


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "hi", "top_p": 3}, "top_p"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_completion_parameters_are_400_naming_the_field(server, model, payload, param):
    _err(httpx.post(f"{server.url}/v1/completions", json={"model": model, **payload}, headers=auth()), 400, param)


def test_bad_chat_requests_and_prompt_over_the_context_limit(server, client, model):
    for payload, param in [({"messages": "hi"}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                           ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
                           ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools")]:
        _err(httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, **payload}, headers=auth()), 400, param)
    limit = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, headers=auth()).json()["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[11] * (limit + 5), max_tokens=1)
    assert e.value.body["param"] == "prompt" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * (limit + 10)}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_api_key_is_required(server, model):
    url = f"{server.url}/v1/completions"
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    assert _err(httpx.post(url, json=body), 401)["type"] == "authentication_error"
    _err(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _err(httpx.get(f"{server.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_malformed_and_huge_bodies_are_4xx_never_5xx(server):
    url = f"{server.url}/v1/completions"
    h = {**auth(), "Content-Type": "application/json"}
    for raw in [b"{bad json", b"[1, 2]", b"\xff\xfe\x00garbage", b'{"prompt": "x", "temperature": NaN}', b"",
                b"[" * 100000 + b"]" * 100000, b'"just a string"']:
        r = httpx.post(url, content=raw, headers=h, timeout=30)
        assert 400 <= r.status_code < 500, (raw[:20], r.status_code, r.text)
        assert r.json()["error"]["message"]
    big = b'{"prompt": "' + b"a" * 2_000_000 + b'"}'
    _err(httpx.post(url, content=big, headers=h, timeout=30), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(40):
            yield b"a" * 100_000

    r = httpx.post(url, content=chunks(), headers=h, timeout=30)
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/no/such/path", headers=auth()).status_code == 404
    assert httpx.get(url, headers=auth()).status_code == 405
    assert httpx.get(f"{server.url}/health").status_code == 200  # still alive


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(server, model):
    before = server.metrics()
    body = {"model": model, "prompt": "Tell me a long story about a dragon.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: ") and '"text"' in line:
                    got += 1
                    if got == 2:
                        break
            during = server.metrics()
            assert during["infer:kv_cache_blocks_used"] > 0 and during["infer:num_requests_running"] >= 1
        # leaving the block closes the connection mid-stream
    after = wait_for(lambda: (m := server.metrics())["infer:kv_cache_blocks_used"] == 0 and m, timeout=30)
    assert after, server.metrics()
    assert after["infer:num_requests_running"] == 0
    assert after['infer:request_success_total{finished_reason="abort",model_name="%s"}' % model] == \
        before['infer:request_success_total{finished_reason="abort",model_name="%s"}' % model] + 1

    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=auth(), timeout=1.5)
    assert wait_for(lambda: server.metrics()["infer:kv_cache_blocks_used"] == 0
                    and server.metrics()["infer:num_requests_running"] == 0, timeout=30)


def test_prompts_and_outputs_are_not_logged_by_default(server, client, model):
    client.completions.create(model=model, prompt=f"My password is {SECRET}", max_tokens=1)
    assert SECRET not in server.log()


# ==================================================================================== overload, SIGTERM
@pytest.fixture(scope="module")
def small_server(servers):
    return wait_ready(servers[1])


def _open_stream(http: httpx.Client, url: str, model: str, max_tokens: int):
    body = {"model": model, "prompt": "Count: one, two,", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    cm = http.stream("POST", f"{url}/v1/completions", json=body)
    return cm, cm.__enter__()


def _read_to_end(resp_or_lines) -> tuple[list[dict], bool]:
    events, done = [], False
    lines = resp_or_lines.iter_lines() if hasattr(resp_or_lines, "iter_lines") else resp_or_lines
    for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events, done


def test_overload_answers_429_with_retry_after(small_server, model):
    url = small_server.url
    with httpx.Client(timeout=60) as http:
        first_cm, first = _open_stream(http, url, model, 300)
        first_lines = first.iter_lines()  # kept referenced: a closed iterator closes the stream
        for line in first_lines:
            if '"text"' in line:
                break  # it is running
        held = [_open_stream(http, url, model, 300) for _ in range(2)]  # two waiting: the queue is full
        assert all(r.status_code == 200 for _, r in held)
        state = small_server.metrics()
        assert state["infer:num_requests_running"] == 1 and state["infer:num_requests_waiting"] == 2, {k: v for k, v in state.items() if "{" not in k and "bucket" not in k}
        r = http.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=20)
        body = _err(r, 429)
        assert body["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        for cm, _ in [(first_cm, first), *held]:
            cm.__exit__(None, None, None)
    assert wait_for(lambda: (m := small_server.metrics())["infer:kv_cache_blocks_used"] == 0
                    and m["infer:num_requests_waiting"] == 0 and m["infer:num_requests_running"] == 0, timeout=30)
    assert small_server.metrics()["infer:request_rejected_total"] >= 1
    assert "Count: one, two," in small_server.log()  # --log-requests writes prompts


def test_sigterm_finishes_or_aborts_in_flight_then_exits_0(small_server, model):
    url = small_server.url
    results: dict[str, tuple] = {}
    with httpx.Client(timeout=120) as http:
        short_cm, short = _open_stream(http, url, model, 3)
        short_lines = short.iter_lines()
        first_line = next(short_lines)
        long_cm, long = _open_stream(http, url, model, 1000)  # waits behind the short one, then runs past the grace
        t0 = time.monotonic()
        small_server.proc.send_signal(signal.SIGTERM)

        def drain(name, resp):
            results[name] = _read_to_end(resp)

        threads = [threading.Thread(target=drain, args=("short", short_lines)),
                   threading.Thread(target=drain, args=("long", long))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        code = small_server.proc.wait(60)
        elapsed = time.monotonic() - t0
        short_cm.__exit__(None, None, None)
        long_cm.__exit__(None, None, None)
    assert code == 0, small_server.log()
    events, done = results["short"]
    events = [json.loads(first_line[6:])] + events
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    events, done = results["long"]
    assert done and events[-1]["choices"][0]["finish_reason"] == "abort"
    assert elapsed < 6 + 30
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_client_that_never_reads_does_not_stall_the_batch(server, client, model):
    import socket as _socket

    body = json.dumps({"model": model, "prompt": "Write a very long essay.", "max_tokens": 60, "stream": True,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = _socket.socket()
    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, 1024)  # a tiny window: the server's writes back up
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        assert wait_for(lambda: server.metrics()["infer:num_requests_running"] >= 1, timeout=60)
        steps = server.metrics()["infer:engine_steps_total"]
        r = client.completions.create(model=model, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3  # served while the other client reads nothing
        assert server.metrics()["infer:engine_steps_total"] >= steps + 3
    finally:
        sock.close()
    assert wait_for(lambda: server.metrics()["infer:kv_cache_blocks_used"] == 0, timeout=60)
