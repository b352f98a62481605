"""Decode bursts (LLMEngine._burst): plain greedy decodes, and sampled ones whose only parameters are temperature,
top-k, top-p and min-p, run several steps back to back in one engine step. Against the same engine stepping one
token at a time: the same tokens (seeded draws included), texts and finish reasons, with stop tokens and stop strings
landing inside a burst; streamed deltas that add up to the text; no burst where any request in the batch needs more
of the sampler, or a request waits; a row whose logits turn non-finite fails its own request alone."""

from __future__ import annotations

import random

import pytest

from infer.runtime import LLM, SamplingParams
from infer.runtime.engine import engine as engine_module


@pytest.fixture(autouse=True)
def no_time_cap(monkeypatch):
    """Bursts as long as decode_burst allows, whatever this machine's step time: the time cap (BURST_SECONDS at the
    measured step time) would make how many steps a burst runs depend on the load; test_the_time_cap_bounds_a_burst
    covers it."""
    monkeypatch.setattr(engine_module, "BURST_SECONDS", 3600.0)


@pytest.fixture(scope="module")
def llm(embedded_artifact):
    """bfloat16, so every decode step runs on the one-call C++ step (bursts need it)."""
    return LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=32 << 20, tuning="off")


def run(llm, requests: list[tuple[str, SamplingParams]], burst: int):
    """Steps the engine to the end with ``decode_burst=burst``: (final output, streamed delta texts and token ids) by
    request, and how many forward steps ran in how many engine steps (a burst is one engine step of several)."""
    engine = llm.engine
    engine.config.decode_burst = burst
    forward_steps = engine.stats["steps"]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    done, deltas, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            text, ids = deltas.setdefault(out.request_id, ([], []))
            text.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            if out.finished:
                done[out.request_id] = out
    return done, deltas, (engine.stats["steps"] - forward_steps, step)


def prompts(llm, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    topics = ["the sea", "a hash map", "prime numbers", "recursion", "the moon", "Python", "a red bicycle"]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {rng.choice(topics)}."}])
            for _ in range(n)]


def test_bursts_give_single_steps_tokens_texts_and_stops(llm, fresh_seed):
    texts = prompts(llm, 4, fresh_seed)
    probe, _, _ = run(llm, [(texts[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))], burst=1)
    stop_token = probe["r0"].token_ids[5]  # a token the first request chooses mid-burst
    requests = [(texts[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])),
                (texts[1], SamplingParams(max_tokens=3, temperature=0)),
                (texts[2], SamplingParams(max_tokens=40, temperature=0, stop=[" the", " a "])),
                (texts[3], SamplingParams(max_tokens=30, temperature=0))]
    served = llm.engine.scheduler.served  # tokens charged to tenants (fair share)

    def computed(outs) -> int:  # each step's tokens: the prompt's uncached ones, then one a decode step
        return sum(len(o.prompt_token_ids) - o.num_cached_tokens + len(o.token_ids) - 1 for o in outs.values())

    for burst_size in (1, 8):
        before = sum(served.values())
        outs, deltas, steps = run(llm, requests, burst=burst_size)
        assert sum(served.values()) - before == pytest.approx(computed(outs))  # a burst charges the tokens it made
        if burst_size == 1:
            single, single_deltas, single_steps = outs, deltas, steps
    burst, burst_deltas, burst_steps = outs, deltas, steps
    for rid, want in single.items():
        got = burst[rid]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        assert "".join(burst_deltas[rid][0]) == got.text and burst_deltas[rid][1] == got.token_ids
        assert "".join(single_deltas[rid][0]) == want.text
    assert single["r0"].finish_reason == "stop" and single["r0"].token_ids[-1] == stop_token
    assert len(single["r0"].token_ids) <= 6  # it stopped inside what would be one burst
    assert single["r1"].finish_reason == "length" and len(single["r1"].token_ids) == 3
    # bursts ran: the same forward steps in fewer engine steps
    assert single_steps[0] == single_steps[1] and burst_steps[1] < burst_steps[0], (single_steps, burst_steps)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks  # nothing leaked


def test_seeded_sampled_rows_burst_to_the_single_steps_tokens(llm, fresh_seed):
    """Sampled rows burst on the sampler's draw kernel with the uniforms single steps would draw: seeded requests give
    the same tokens either way, also when another row's stop token ends a burst early (each seeded generator moves by
    the steps the burst ran, no more)."""
    assert llm.engine.plan.draw_kernel is not None, "the sampler's C++ draw did not build"
    texts = prompts(llm, 4, fresh_seed)
    probe, _, _ = run(llm, [(texts[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))], burst=1)
    stop_token = probe["r0"].token_ids[5]
    requests = [(texts[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])),
                (texts[1], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=fresh_seed, ignore_eos=True)),
                (texts[2], SamplingParams(max_tokens=30, temperature=1.0, seed=fresh_seed + 1, ignore_eos=True)),
                (texts[3], SamplingParams(max_tokens=30, temperature=0.7, top_k=20, min_p=0.05, seed=fresh_seed + 2,
                                          ignore_eos=True))]
    single, _, single_steps = run(llm, requests, burst=1)
    burst, burst_deltas, burst_steps = run(llm, requests, burst=8)
    for rid, want in single.items():
        got = burst[rid]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        assert burst_deltas[rid][1] == got.token_ids
    assert single["r0"].finish_reason == "stop" and len(single["r0"].token_ids) <= 6  # ended a burst early
    assert len(set(single["r2"].token_ids)) > 5  # really sampled
    assert single_steps[0] == single_steps[1] and burst_steps[1] < burst_steps[0], (single_steps, burst_steps)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_no_burst_where_a_request_needs_more_of_the_sampler_or_one_waits(llm, fresh_seed):
    texts = prompts(llm, 3, fresh_seed)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for other in (SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True, presence_penalty=0.5),
                  SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
                  SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
                  SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias={11: 5.0})):
        single, _, _ = run(llm, [(texts[0], greedy), (texts[1], other)], burst=1)
        burst, _, (forward_steps, engine_steps) = run(llm, [(texts[0], greedy), (texts[1], other)], burst=8)
        assert forward_steps == engine_steps, other  # one forward step an engine step throughout
        assert [o.token_ids for o in burst.values()] == [o.token_ids for o in single.values()]
    # a request waiting to join (the batch is full): the one running steps a token at a time
    engine = llm.engine
    engine.config.decode_burst = 8
    engine.add_request("a", texts[0], greedy)
    engine.step()  # its prompt
    engine.scheduler.max_num_seqs, keep = 1, engine.scheduler.max_num_seqs
    try:
        engine.add_request("b", texts[1], greedy)  # waits: the batch is full
        before = engine.stats["steps"]
        engine.step()
        assert engine.scheduler.waiting and engine.stats["steps"] == before + 1  # no burst while it waits
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.scheduler.max_num_seqs = keep


def test_non_finite_logits_inside_a_burst_fail_that_request_alone(llm, fresh_seed):
    """The first request's cached values turn NaN while both decode (a corrupted cache: every logit of its row is
    NaN from then on): the burst stops before that step, the step runs alone, the sampler fails that request and the
    other goes on to the tokens it gets without the fault."""
    texts = prompts(llm, 2, fresh_seed)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    clean, _, _ = run(llm, [(texts[0], params), (texts[1], params)], burst=8)
    engine = llm.engine
    engine.config.decode_burst = 8
    engine.add_request("bad", texts[0], params)
    engine.add_request("good", texts[1], params)
    outs = {o.request_id: o for o in engine.step()}  # both prompts: a token each
    assert set(outs) == {"bad", "good"} and not any(o.finished for o in outs.values())
    bad = next(s for s in engine.scheduler.running if s.request_id == "bad")
    last, bs = bad.num_computed_tokens - 1, engine.config.block_size  # its last cached token (its own block)
    values = engine.runner.kv_cache[0, 1, bad.block_table[last // bs], last % bs]  # layer 0's values there
    kept = values.clone()
    values.fill_(float("nan"))
    forward_steps, engine_steps = engine.stats["steps"], 0
    try:
        while engine.has_unfinished_requests():
            engine_steps += 1
            for o in engine.step():
                outs[o.request_id] = o
    finally:
        values.copy_(kept)  # its block may stay in the prefix cache
    assert outs["bad"].finish_reason == "error" and "not finite" in outs["bad"].error
    assert outs["good"].finish_reason == "length" and outs["good"].token_ids == clean["r1"].token_ids
    assert engine_steps < engine.stats["steps"] - forward_steps  # the rest of "good" ran in bursts
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_the_time_cap_bounds_a_burst(llm, fresh_seed, monkeypatch):
    """A burst runs at most BURST_SECONDS at the measured decode step time: with none to spare, every step runs alone;
    with room for three steps, bursts of at most three."""
    texts = prompts(llm, 1, fresh_seed)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    run(llm, [(texts[0], params)], burst=1)  # the scheduler has measured decode steps
    step_s = llm.engine.scheduler.step_cost.decode_s
    assert step_s
    monkeypatch.setattr(engine_module, "BURST_SECONDS", 0.0)
    _, _, (forward_steps, engine_steps) = run(llm, [(texts[0], params)], burst=8)
    assert forward_steps == engine_steps
    monkeypatch.setattr(engine_module, "BURST_SECONDS", 3.5 * step_s)
    llm.engine.scheduler.step_cost.decode_s = step_s
    engine = llm.engine
    engine.config.decode_burst = 8
    engine.add_request("capped", texts[0], params)
    most = 0
    while engine.has_unfinished_requests():
        before = engine.stats["steps"]
        engine.scheduler.step_cost.decode_s = step_s  # as measured: the cap is 3 steps
        engine.step()
        most = max(most, engine.stats["steps"] - before)
    assert most == 3


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_a_bad_decode_burst_is_refused_by_name(embedded_artifact, bad):
    with pytest.raises(ValueError, match="decode_burst"):
        LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=16 << 20, decode_burst=bad)
