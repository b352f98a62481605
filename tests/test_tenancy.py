"""Tenancy: priority and fair share inside the scheduler, the per-step prompt budget, per-tenant running
caps, token-bucket rate limits per API key (429 with Retry-After), and the tenants file's checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from infer.runtime.engine.block_manager import BlockManager
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.engine.scheduler import Fairness, Scheduler
from infer.runtime.engine.sequence import Sequence
from infer.runtime.serving.guard import Guard
from infer.runtime.serving.tenants import Tenants, TokenBucket
from test_scheduler import run_step


def seq(tag: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, tenant: str = "") -> Sequence:
    return Sequence(tag, [hash(tag) % 1000 + 3] * prompt_len, SamplingParams(max_tokens=max_tokens),
                    priority=priority, tenant=tenant)


def first_steps(sched: Scheduler, seqs: list[Sequence], limit: int = 2000) -> dict[str, int]:
    """Step until all finish; the step each request was first scheduled in."""
    first: dict[str, int] = {}
    for step in range(limit):
        if not sched.has_unfinished():
            break
        for s in run_step(sched).seqs:
            first.setdefault(s.request_id, step)
    assert not sched.has_unfinished()
    return first


def test_lower_priority_value_runs_first_then_arrival_order():
    sched = Scheduler(BlockManager(64, 8), max_num_seqs=1, max_num_batched_tokens=64)
    seqs = [seq("a", 5), seq("b", 5, priority=1), seq("c", 5, priority=-1), seq("d", 5), seq("e", 5, priority=-1)]
    for s in seqs:
        sched.add(s)
    first = first_steps(sched, seqs)
    assert sorted(first, key=first.get) == ["c", "e", "a", "d", "b"]


def test_preemption_takes_the_worst_priority_first():
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    low = seq("low", 8, max_tokens=20, priority=5)
    high = seq("high", 8, max_tokens=20, priority=0)
    sched.add(low)
    run_step(sched)  # low runs first (alone)
    sched.add(high)
    preempted = []
    for _ in range(30):
        preempted += [s.request_id for s in run_step(sched).preempted]
    assert preempted and set(preempted) == {"low"}  # the KV cache holds one of them: high keeps running


def test_fair_share_between_tenants_follows_their_weights():
    """A flood from one tenant does not hold back another that arrives later, and over a busy period each
    tenant's computed tokens follow its weight (2:1)."""
    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=2, max_num_batched_tokens=64,
                      fairness=Fairness({"a": 2.0, "b": 1.0}, prompt_tokens_per_step=64))
    flood = [seq(f"a{i}", 30, tenant="a") for i in range(30)]
    for s in flood:
        sched.add(s)
    for _ in range(5):
        run_step(sched)
    late = [seq(f"b{i}", 30, tenant="b") for i in range(30)]
    for s in late:
        sched.add(s)
    tokens = {"a": 0, "b": 0}
    for _ in range(60):  # both tenants backlogged throughout
        batch = run_step(sched)
        for s, n in zip(batch.seqs, batch.num_tokens):
            tokens[s.tenant] += n
    assert any(s.status.name != "WAITING" for s in late[:2])
    ratio = tokens["a"] / tokens["b"]
    print("tokens per tenant", tokens, "ratio", ratio)
    assert 1.6 < ratio < 2.5, tokens
    first = first_steps(sched, flood + late)
    assert min(first.get(s.request_id, 0) for s in late) == 0  # b ran in the busy period, not after the flood


def test_idle_tenant_banks_no_credit():
    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=1, max_num_batched_tokens=64, fairness=Fairness())
    for i in range(3):  # a is served alone for a while
        sched.add(seq(f"a{i}", 20, tenant="a"))
    first_steps(sched, [])
    for i in range(3):
        sched.add(seq(f"b{i}", 20, tenant="b"))
    sched.add(seq("a-late", 20, tenant="a"))
    assert sched.served["b"] >= 0 and sched.served["a"] > 0
    sched.served.pop("c", None)
    sched.add(seq("c0", 20, tenant="c"))  # c arrives while a and b wait: level with the least served (b)
    assert sched.served["c"] == min(sched.served["a"], sched.served["b"])


def test_prompt_budget_cuts_long_prompts_so_decodes_run_every_step():
    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=8, max_num_batched_tokens=1024,
                      fairness=Fairness(prompt_tokens_per_step=64))
    decoder = seq("short", 4, max_tokens=30, tenant="b")
    sched.add(decoder)
    run_step(sched)
    for i in range(3):
        sched.add(seq(f"long{i}", 500, tenant="a"))
    steps = 0
    while not decoder.is_finished:
        batch = run_step(sched)
        steps += 1
        prompt = sum(n for s, n in zip(batch.seqs, batch.num_tokens) if n > 1)
        assert prompt <= 64, batch.num_tokens
        assert decoder in batch.seqs or decoder.is_finished
    assert steps < 40


def test_decode_slowdown_max_cuts_prompt_chunks_to_the_measured_step_costs():
    """With decode_slowdown_max, while a sequence decodes a step's prompt tokens are what fits
    (slowdown - 1) x a decode-only step at the measured cost a prompt token adds; with nothing decoding,
    or before both costs are known, prompt_tokens_per_step alone; prompts always advance."""
    from infer.runtime.engine.scheduler import MIN_PROMPT_CHUNK, StepCost

    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=8, max_num_batched_tokens=1024,
                      fairness=Fairness(prompt_tokens_per_step=256, decode_slowdown_max=2.0))
    decoder = seq("short", 4, max_tokens=30, tenant="b")
    sched.add(decoder)
    run_step(sched)
    sched.add(seq("long", 900, tenant="a"))
    batch = run_step(sched)  # costs not yet known: the plain budget
    assert max(batch.num_tokens) == 256, batch.num_tokens
    sched.observe(0.010, 0, 1)  # a decode-only step: 10 ms
    sched.observe(0.010 + 64 * 0.0005, 64, 1)  # 64 prompt tokens beside a decode added 32 ms: 0.5 ms a token
    assert sched.step_cost.prompt_tokens_within(2.0) == 20  # 10 ms of slack / 0.5 ms
    batch = run_step(sched)
    assert sorted(batch.num_tokens) == [1, 20], batch.num_tokens
    sched.observe(0.010, 0, 1)
    sched.step_cost.prompt_token_s = 0.01  # a slow host: 10 ms a token, the budget floors at the minimum
    assert sorted(run_step(sched).num_tokens) == [1, MIN_PROMPT_CHUNK]
    while not decoder.is_finished:  # once b is done, a's prompt takes the plain budget again
        run_step(sched)
    assert max(run_step(sched).num_tokens) == 256
    # the other way round: the less-served tenant's own prompt is not cut while the flood's tenant decodes
    sched2 = Scheduler(BlockManager(4096, 8), max_num_seqs=8, max_num_batched_tokens=1024,
                       fairness=Fairness(prompt_tokens_per_step=256, decode_slowdown_max=2.0))
    sched2.step_cost = sched.step_cost  # the costs learned above: 20 prompt tokens fit beside a decode
    flood = seq("flood", 300, max_tokens=50, tenant="a")
    sched2.add(flood)
    while flood.num_computed_tokens < flood.num_prompt_tokens:
        run_step(sched2)
    probe = seq("probe", 90, tenant="b")
    sched2.add(probe)
    assert sorted(run_step(sched2).num_tokens) == [1, 90]  # b's whole prompt beside a's decode
    cost = StepCost()
    cost.observe(0.05, 100, 0)  # prompt-only step: all of it counted as the tokens' (an overestimate)
    assert cost.prompt_tokens_within(2.0) is None and cost.prompt_token_s == pytest.approx(0.0005)
    with pytest.raises(ValueError, match="decode_slowdown_max"):
        Fairness(decode_slowdown_max=0.5)


def test_max_running_caps_a_tenant():
    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=16, max_num_batched_tokens=1024,
                      fairness=Fairness(max_running={"a": 2}, prompt_tokens_per_step=0))
    for i in range(6):
        sched.add(seq(f"a{i}", 4, max_tokens=10, tenant="a"))
    sched.add(seq("b0", 4, max_tokens=10, tenant="b"))
    for _ in range(12):
        run_step(sched)
        assert sum(s.tenant == "a" for s in sched.running) <= 2
    assert not any(s.request_id == "b0" for s in sched.waiting)


def test_token_bucket_refills_at_its_rate():
    b = TokenBucket(rate=2.0, burst=3)
    b.at = 0.0
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0
    assert b.take(0.6) == pytest.approx(0.4)


@pytest.mark.parametrize("doc, words", [
    ({"tenants": {}}, "at least one tenant"),
    ({"tenants": {"a": {"weight": 1}}}, "API key"),
    ({"tenants": {"a": {"key": "k", "weight": 0}}}, "weight must be a number > 0"),
    ({"tenants": {"a": {"key": "k", "rate": "fast"}}}, "rate must be a number"),
    ({"tenants": {"a": {"key": "k", "max_running": 1.5}}}, "max_running must be an integer"),
    ({"tenants": {"a": {"key": "k"}, "b": {"key": "k"}}}, "its own key"),
    ({"tenants": {"a": {"key": "k", "wieght": 2}}}, "unknown setting 'wieght'"),
    ({"tenants": {"a": {"key": "k"}}, "prompt_tokens_per_step": -1}, "prompt_tokens_per_step"),
    ({"tenants": {"a": {"key": "k"}}, "decode_slowdown_max": 1}, "decode_slowdown_max must be a number > 1"),
    ({"tenants": {"a": {"key": "k"}}, "decode_slowdown_max": "2x"}, "decode_slowdown_max must be a number > 1"),
    ({"tenants": {"a": {"key_env": "INFER_TEST_UNSET_KEY"}}}, "INFER_TEST_UNSET_KEY"),
])
def test_bad_tenants_file_is_refused_naming_the_problem(doc, words, monkeypatch):
    monkeypatch.delenv("INFER_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match=words):
        Tenants.parse(doc, "tenants.yaml")


def test_tenants_file_loads_and_cli_refuses_a_bad_one(tmp_path):
    from infer.runtime.cli import main

    good = tmp_path / "tenants.yaml"
    good.write_text("prompt_tokens_per_step: 128\ntenants:\n  alice: {key: sk-a, weight: 2, rate: 5, max_running: 4}\n"
                    "  bob: {key: sk-b}\n")
    t = Tenants.load(good)
    f = t.fairness()
    assert (f.weights, f.max_running, f.prompt_tokens_per_step) == ({"alice": 2, "bob": 1.0}, {"alice": 4}, 128)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [alice]\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        Tenants.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        Tenants.load(tmp_path / "missing.yaml")


class _State:
    def __init__(self, tenants, api_key=None):
        self.config = type("C", (), {"api_key": api_key, "tenants": tenants, "max_body": 1 << 20})()
        self.metrics = None


async def _echo_tenant(scope, receive, send):
    body = scope.get("infer.tenant", "-").encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_rate_limit_answers_429_with_retry_after_per_key():
    tenants = Tenants.parse({"tenants": {"alice": {"key": "sk-a", "rate": 0.5, "burst": 2}, "bob": {"key": "sk-b"}}})
    app = Guard(_echo_tenant, _State(tenants))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            alice = {"Authorization": "Bearer sk-a"}
            got = [await c.post("/v1/completions", headers=alice) for _ in range(3)]
            assert [r.status_code for r in got] == [200, 200, 429]
            assert got[0].text == "alice"
            assert got[2].json()["error"]["code"] == "rate_limited"
            assert 1 <= int(got[2].headers["retry-after"]) <= 2
            bob = [await c.post("/v1/completions", headers={"Authorization": "Bearer sk-b"}) for _ in range(5)]
            assert {r.status_code for r in bob} == {200} and bob[0].text == "bob"  # one key's limit is its own
            assert (await c.post("/v1/completions", headers={"Authorization": "Bearer nope"})).status_code == 401
            assert (await c.get("/health")).status_code == 200  # open paths need no key

    asyncio.run(run())


def test_priority_is_parsed_and_bounded():
    from infer.runtime.serving.protocol import APIError, ModelInfo, parse_completion

    info = ModelInfo("m", "1", 64, 100, tokenizer=None)
    assert parse_completion({"prompt": [5, 6], "priority": -3}, info).priority == -3
    assert parse_completion({"prompt": [5, 6]}, info).priority == 0
    with pytest.raises(APIError, match="priority"):
        parse_completion({"prompt": [5, 6], "priority": 1.5}, info)


def test_a_running_long_prompt_yields_the_prompt_budget_to_a_less_served_tenant():
    sched = Scheduler(BlockManager(4096, 8), max_num_seqs=8, max_num_batched_tokens=1024,
                      fairness=Fairness(prompt_tokens_per_step=32))
    longs = [seq(f"long{i}", 600, tenant="a") for i in range(2)]
    for s in longs:
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    short = seq("short", 40, max_tokens=2, tenant="b")
    sched.add(short)
    steps = 0
    while not short.output_token_ids:
        run_step(sched)
        steps += 1
    assert steps == 2  # 40 prompt tokens at 32 a step, as alone: not after a's 600-token prompt, not in turns
    first_steps(sched, longs)  # and a's prompts still finish


def test_service_while_the_others_idled_is_no_debt():
    """b is served alone, then a floods an idle engine, then b sends one short request: b is not made to
    wait until a has caught up with what b used while a idled (it starts within a step, as level)."""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=128, max_num_batched_tokens=1024,
                      fairness=Fairness(prompt_tokens_per_step=64))
    first_steps(sched, [_add(sched, seq(f"b-alone{i}", 90, max_tokens=24, tenant="b")) for i in range(10)])
    assert sched.served["b"] >= 10 * 100
    flood = [_add(sched, seq(f"a{i}", 700, max_tokens=16, tenant="a")) for i in range(16)]
    run_step(sched)
    assert sched.served["a"] >= sched.served["b"]  # a came to an idle engine: level with b's history
    probe = _add(sched, seq("b-probe", 90, max_tokens=2, tenant="b"))
    steps = 0
    while not probe.output_token_ids:
        run_step(sched)
        steps += 1
    assert steps == 2  # 90 prompt tokens at 64 a step, as alone
    first_steps(sched, flood)


def _add(sched: Scheduler, s: Sequence) -> Sequence:
    sched.add(s)
    return s
