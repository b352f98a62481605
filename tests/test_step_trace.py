"""The step timeline: ``LLMEngine.step_records``, ``infer-run --step-trace FILE`` (steps, event-loop
lag, stream delays) and its summariser ``python -m infer.bench.timeline``."""

from __future__ import annotations

import json
import time

import pytest

from infer.bench import serve, timeline
from test_server import start_server

STEP_FIELDS = {"type", "step", "t", "dur_ms", "schedule_ms", "model_ms", "sample_ms", "output_ms", "prefill_tokens",
               "prefill_seqs", "decode_rows", "batched_tokens", "waiting", "running"}


def _step(t, schedule, model, sample, output, prefill_tokens=0, prefill_seqs=0, decode_rows=0):
    return {"type": "step", "t": t, "dur_ms": schedule + model + sample + output, "schedule_ms": schedule,
            "model_ms": model, "sample_ms": sample, "output_ms": output, "prefill_tokens": prefill_tokens,
            "prefill_seqs": prefill_seqs, "decode_rows": decode_rows}


def test_summariser_against_hand_computed_values(tmp_path):
    records = [_step(100.00, 1, 6, 2, 1, decode_rows=4),  # decode, 10 ms
               _step(100.02, 2, 15, 2, 1, prefill_tokens=64, prefill_seqs=1),  # prefill, 20 ms
               _step(100.05, 1, 25, 3, 1, prefill_tokens=32, prefill_seqs=1, decode_rows=3),  # mixed, 30 ms
               _step(100.09, 1, 8, 0.5, 0.5, decode_rows=4),  # decode, 10 ms; ends at 100.10
               *({"type": "loop_lag", "t": 100.0, "lag_ms": v} for v in (0.1, 0.2, 5.0)),
               {"type": "loop_lag", "t": 99.0, "lag_ms": 900.0},  # before the first step (loading): left out
               *({"type": "stream_delay", "t": 100.0, "delay_ms": v, "outputs": 1} for v in (1.0, 3.0))]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"type": "step", "t": 1')  # cut short
    s = timeline.summarize(timeline.load(str(path)))
    assert s["steps"] == 4 and s["span_s"] == pytest.approx(0.1) and s["steps_per_s"] == pytest.approx(40)
    assert s["step_share"] == pytest.approx(0.7) and s["idle_share"] == pytest.approx(0.3)
    assert s["phase_share"] == pytest.approx({"schedule": 5 / 70, "model": 54 / 70, "sample": 7.5 / 70,
                                              "output": 3.5 / 70})
    assert (s["prefill_tokens"], s["decode_rows"]) == (96, 11)
    assert [s["step_ms"][k]["count"] for k in ("decode", "prefill", "mixed", "all")] == [2, 1, 1, 4]
    assert (s["step_ms"]["decode"]["p50"], s["step_ms"]["mixed"]["p99"]) == (10, 30)
    assert s["step_ms"]["all"]["p50"] == pytest.approx(15) and s["step_ms"]["all"]["p99"] == pytest.approx(29.7)
    assert s["loop_lag_ms"]["p50"] == pytest.approx(0.2) and s["loop_lag_ms"]["p99"] == pytest.approx(4.904)
    assert s["stream_delay_ms"]["p50"] == pytest.approx(2) and s["stream_delay_ms"]["p99"] == pytest.approx(2.98)


def test_engine_records_each_step(embedded_llm):
    from infer.runtime import SamplingParams

    engine = embedded_llm.engine
    before = engine.step_records[-1].step if engine.step_records else engine.stats["steps"]
    prompts = ["The capital of France is", "One two three four five six seven eight", "Hello"]
    outs = embedded_llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    recs = [r for r in engine.step_records if r.step > before]
    assert [r.step for r in recs] == list(range(before + 1, before + 1 + len(recs)))
    assert sum(r.prefill_tokens for r in recs) == sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
    assert sum(r.prefill_seqs for r in recs) == 3  # one chunk each: the prompts fit one step
    assert sum(r.decode_rows for r in recs) == sum(len(o.token_ids) for o in outs) - 3 == 15  # the first from prefill
    assert all(r.batched_tokens == r.prefill_tokens + r.decode_rows for r in recs)
    assert all(min(r.schedule_ms, r.model_ms, r.sample_ms, r.output_ms) >= 0 for r in recs)
    assert recs[0].kind == "prefill" and recs[-1].kind == "decode"
    assert (recs[-1].waiting, recs[-1].running) == (0, 0)
    assert set(recs[0].as_dict()) == STEP_FIELDS


def test_step_record_counts_the_rows_the_runner_runs_as_decodes(embedded_llm):
    """One definition of a decode row: a one-token prompt tail after a prefix-cache hit is a decode row both in
    the step record and in the runner's inputs (the decode kernel runs it), and every step agrees."""
    from infer.runtime import SamplingParams

    engine, tokenizer = embedded_llm.engine, embedded_llm.engine.tokenizer
    bs = engine.config.block_size
    ids = tokenizer.encode("A prefix that fills whole blocks of the cache: " * 20)
    prefix = ids[:2 * bs]
    ran = []
    prepare = engine.runner.prepare

    def spy(batch):
        inputs = prepare(batch)
        ran.append(len(inputs.decode_rows))
        return inputs

    engine.runner.prepare = spy
    try:
        before = engine.step_records[-1].step if engine.step_records else engine.stats["steps"]
        embedded_llm.generate([prefix + ids[2 * bs:2 * bs + 3]], SamplingParams(max_tokens=1))  # caches the prefix
        tail = embedded_llm.generate([prefix + [ids[2 * bs]]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    finally:
        engine.runner.prepare = prepare
    assert engine.runner.plan.decode_rows_only is False
    assert tail.num_cached_tokens == 2 * bs  # the prompt's last token is all that is left to compute
    recs = [r for r in engine.step_records if r.step > before]
    assert [r.decode_rows for r in recs] == ran
    assert recs[1].prefill_tokens == 0 and recs[1].decode_rows == 1 and recs[1].kind == "decode"


def _trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line whole JSON


def test_served_step_trace_and_its_summary(embedded_artifact, tmp_path):
    """infer-run --step-trace while infer-bench serve sends prompts made to length with the
    artifact's tokenizer; long prompts are chunked (32-token steps), so steps mix prefill and decode."""
    trace = tmp_path / "trace.jsonl"
    server = start_server(embedded_artifact, tmp_path, "--step-trace", str(trace), "--kv-cache-memory", "64M",
                          "--max-num-seqs", "4", "--max-num-batched-tokens", "32")
    try:
        bench_json = tmp_path / "bench.json"
        rc = serve.main(["--url", server.url, "--tokenizer", str(embedded_artifact), "--requests", "4",
                         "--input-len", "24", "--output-len", "6", "--json", str(bench_json), "--quiet"])
        assert rc == 0
        metrics = server.metrics()
        deadline = time.monotonic() + 10  # written while the server runs: flushed within a second of idling
        while sum(r["decode_rows"] for r in _trace(trace) if r["type"] == "step") < 20:
            assert time.monotonic() < deadline, "the step trace was not flushed while the server idled"
            time.sleep(0.2)
    finally:
        assert server.stop() == 0

    requests = json.loads(bench_json.read_text())["requests"]
    assert [r["prompt_tokens"] for r in requests] == [24] * 4  # the text encodes to exactly 24 tokens there
    assert [r["output_tokens"] for r in requests] == [6] * 4

    records = _trace(trace)
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all(set(r) == STEP_FIELDS for r in steps)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    hits = metrics.get("infer:prefix_cache_hits_total", 0)
    assert sum(r["prefill_tokens"] for r in steps) == 4 * 24 - hits
    assert sum(r["decode_rows"] for r in steps) == 4 * 6 - 4
    assert all(r["batched_tokens"] <= 32 for r in steps)
    assert {timeline.step_kind(r) for r in steps} >= {"prefill", "mixed"}
    assert all(r["dur_ms"] == pytest.approx(r["schedule_ms"] + r["model_ms"] + r["sample_ms"] + r["output_ms"],
                                            abs=0.01) for r in steps)
    lags = [r for r in records if r["type"] == "loop_lag"]
    delays = [r for r in records if r["type"] == "stream_delay"]
    assert lags and all(r["lag_ms"] >= 0 for r in lags)
    assert len(delays) >= 4 and all(r["delay_ms"] >= 0 and r["outputs"] >= 1 for r in delays)

    summary_json = tmp_path / "summary.json"
    assert timeline.main([str(trace), "--json", str(summary_json)]) == 0
    s = json.loads(summary_json.read_text())
    assert s["steps"] == len(steps) and s["decode_rows"] == 20
    assert s["step_share"] + s["idle_share"] == pytest.approx(1)
    assert 0 < s["step_share"] <= 1
    assert sum(s["phase_share"].values()) == pytest.approx(1, abs=1e-3)
    assert 0 < s["loop_lag_ms"]["count"] < len(lags)  # those while the model loaded are left out
    assert s["stream_delay_ms"]["count"] == len(delays)
