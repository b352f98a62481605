"""One request cannot hurt another, in process: a hostile request beside normal ones, for each class
of bad input, fails alone (refused when added, or finished with finish_reason "error"), while the
normal ones finish with exactly the greedy tokens they get alone and no KV block stays held.

A hostile value that gets past validation is simulated by changing a request's parameters or
tokens after it was added, or by making the forward pass, the sampler or the detokenizer fail on
its row through monkeypatch.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

import infer.runtime.engine.engine as engine_module
from infer.runtime import LLMEngine, SamplingParams
from infer.runtime.engine import sampling_params as bounds

NORMAL = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,"]
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_engine(embedded_artifact):
    return LLMEngine(embedded_artifact, kv_cache_memory=64 << 20, max_num_seqs=16)


@pytest.fixture
def engine(shared_engine):
    """The module's engine; whatever a failing test left in it is aborted, so failures do not cascade."""
    yield shared_engine
    for rid in list(shared_engine.requests):
        shared_engine.abort_request(rid)


def run_to_end(engine) -> dict:
    """Steps until every request finished; the final output of each, by request id."""
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    raise AssertionError("the engine did not finish within 1000 steps")


@pytest.fixture(scope="module")
def reference(shared_engine) -> dict[str, list[int]]:
    """Each normal prompt's greedy tokens, run alone."""
    out = {}
    for i, prompt in enumerate(NORMAL):
        shared_engine.add_request(f"alone-{i}", prompt, SamplingParams(**GREEDY))
        out[f"normal-{i}"] = run_to_end(shared_engine)[f"alone-{i}"].token_ids
    return out


def add_normals(engine) -> None:
    for i, prompt in enumerate(NORMAL):
        engine.add_request(f"normal-{i}", prompt, SamplingParams(**GREEDY))


def assert_normals_exact(final: dict, reference: dict) -> None:
    for rid, tokens in reference.items():
        out = final[rid]
        assert out.finish_reason == "length" and out.error is None, (rid, out.finish_reason, out.error)
        assert out.token_ids == tokens, rid


def assert_clean(engine) -> None:
    """Nothing left queued or running, every KV block back in the pool."""
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.num_blocks


# ---------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 0), ("top_k", -2), ("temperature", math.inf), ("temperature", math.nan),
    ("temperature", 101.0), ("top_p", math.nan), ("top_p", 0.0), ("min_p", -0.1), ("min_p", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("repetition_penalty", 11.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -math.inf), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("seed", 1.5), ("max_tokens", 2**31), ("max_tokens", True), ("logprobs", 21), ("prompt_logprobs", -1),
    ("stop", ["x"] * 17), ("stop", ["x" * 257]), ("stop", [""]), ("stop", [5]), ("stop_token_ids", [2**63]),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(65))), ("ignore_eos", "yes"),
])
def test_a_parameter_out_of_its_range_is_refused_naming_the_field(engine, field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})
    params = SamplingParams()
    setattr(params, field, value)  # past the constructor: the engine checks again when the request is added
    with pytest.raises(ValueError, match=f"^{field}="):
        engine.add_request("hostile", "hi", params)
    assert_clean(engine)


@pytest.mark.parametrize("field,value", [("top_k", 49153), ("stop_token_ids", [49152])])
def test_token_bounds_are_the_vocabulary_once_the_engine_knows_it(engine, field, value):
    assert engine.model.config.vocab_size == 49152
    params = SamplingParams(**{field: value})  # fine for some model; not for this one
    with pytest.raises(ValueError, match=f"^{field}=.*49152"):
        engine.add_request("hostile", "hi", params)
    assert_clean(engine)


def test_the_bounds_themselves_are_accepted(engine):
    edge = SamplingParams(temperature=100.0, top_p=1e-9, top_k=engine.model.config.vocab_size, min_p=1.0,
                          repetition_penalty=0.01, presence_penalty=-2, frequency_penalty=2, seed=2**64 - 1,
                          stop=["y" * 256] * 16, stop_token_ids=list(range(64)), logprobs=20, max_tokens=2)
    engine.add_request("edge", "hi", edge)
    assert run_to_end(engine)["edge"].finish_reason in ("length", "stop")
    assert_clean(engine)


def test_a_tiny_temperature_is_greedy_not_nan(engine, reference):
    engine.add_request("tiny", NORMAL[0], SamplingParams(**{**GREEDY, "temperature": 1e-40}))
    assert run_to_end(engine)["tiny"].token_ids == reference["normal-0"]


def test_top_k_2_pow_63_slipped_past_validation_does_not_fail_the_batch(engine, reference):
    """The reported bug: top_k=2**63 at temperature 1 beside other requests. The sampler clamps top_k to
    the vocabulary, so even a value that escaped validation works, and the others are untouched."""
    add_normals(engine)
    seq = engine.add_request("hostile", "hi", SamplingParams(temperature=1.0, top_k=5, max_tokens=10, ignore_eos=True))
    seq.params.top_k = 2**63
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "length" and len(final["hostile"].token_ids) == 10
    assert_normals_exact(final, reference)
    assert_clean(engine)


def test_a_parameter_the_sampler_cannot_use_fails_only_its_request(engine, reference):
    add_normals(engine)
    seq = engine.add_request("hostile", "hi", SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    seq.params.temperature = math.nan  # slipped past validation: logits / NaN
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "error" and "left no token to choose" in final["hostile"].error
    assert final["hostile"].error_by_request  # the request's own parameter: a 400 at the server, not a 500
    assert_normals_exact(final, reference)
    assert_clean(engine)


# ---------------------------------------------------------------------------------- sampler and kernels
def test_a_sampler_error_on_one_row_fails_only_that_request(engine, reference, monkeypatch):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    engine.add_request("seeded", NORMAL[1], seeded)
    seeded_alone = run_to_end(engine)["seeded"].token_ids
    real_sample = engine_module.sample
    calls = []

    def sample(logits, seqs, draw_kernel):
        calls.append(len(seqs))
        if any(s.request_id == "hostile" for s in seqs):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, seqs, draw_kernel)

    monkeypatch.setattr(engine_module, "sample", sample)
    add_normals(engine)
    engine.add_request("seeded", NORMAL[1], SamplingParams(**{**seeded.__dict__}))
    engine.add_request("hostile", "hi", SamplingParams(**GREEDY))
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "error" and "injected sampler fault" in final["hostile"].error
    assert_normals_exact(final, reference)
    assert final["seeded"].token_ids == seeded_alone  # its generator was rewound before the retry
    assert max(calls) == 5  # the whole batch was tried first
    assert_clean(engine)


def test_non_finite_logits_on_one_row_fail_only_that_request(engine, reference, monkeypatch):
    real_execute = engine.runner.execute

    def execute(batch):
        result = real_execute(batch)
        for row, seq in enumerate(result.sampled):
            if seq.request_id == "hostile":
                with torch.inference_mode():
                    result.logits[row, 100] = math.nan  # a kernel fault on this sequence's row
        return result

    monkeypatch.setattr(engine.runner, "execute", execute)
    add_normals(engine)
    engine.add_request("hostile", "hi", SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True))
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "error" and "not finite" in final["hostile"].error
    assert not final["hostile"].error_by_request  # the model's fault: a server error
    assert_normals_exact(final, reference)
    assert_clean(engine)


def test_a_forward_pass_fault_on_one_sequence_fails_only_that_request(engine, reference, monkeypatch):
    real_execute = engine.runner.execute
    seen = []

    def execute(batch):
        seen.append(len(batch.seqs))
        if any(s.request_id == "hostile" and s.num_output_tokens >= 2 for s in batch.seqs):
            raise RuntimeError("injected kernel fault")  # mid-generation, after it had produced tokens
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    add_normals(engine)
    engine.add_request("hostile", "Tell me a story.", SamplingParams(**GREEDY))
    final = run_to_end(engine)
    hostile = final["hostile"]
    assert hostile.finish_reason == "error" and "injected kernel fault" in hostile.error
    assert len(hostile.token_ids) == 2
    assert_normals_exact(final, reference)
    assert 4 in seen and 1 in seen  # the whole batch, then halves down to the culprit alone
    assert_clean(engine)


def test_a_fault_every_sequence_hits_fails_them_all_and_the_engine_goes_on(engine, reference, monkeypatch):
    """Not attributable (a real bug): everything in flight fails, cleanly, and later requests work."""
    def broken(batch):
        raise RuntimeError("every forward pass fails")

    monkeypatch.setattr(engine.runner, "execute", broken)
    add_normals(engine)
    final = run_to_end(engine)
    assert {o.finish_reason for o in final.values()} == {"error"} and len(final) == len(NORMAL)
    assert_clean(engine)
    monkeypatch.undo()
    add_normals(engine)
    assert_normals_exact(run_to_end(engine), reference)
    assert_clean(engine)


# ---------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt,match", [
    ([10**9], "outside the vocabulary"), ([-1], "outside the vocabulary"), ([True, 5], "list of token ids"),
    ([2**70], "outside the vocabulary"), ("", "prompt is empty"), ([], "prompt is empty"), (None, "prompt must be"),
])
def test_a_bad_prompt_is_refused_when_added(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("hostile", prompt, SamplingParams())
    assert_clean(engine)


def test_bad_prompt_token_ids_that_reach_the_model_fail_only_their_request(engine, reference):
    add_normals(engine)
    seq = engine.add_request("hostile", [5, 6, 7], SamplingParams(**GREEDY))
    seq.token_ids[1] = 10**9  # slipped past the vocabulary check: the embedding lookup raises
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "error" and "forward pass failed" in final["hostile"].error
    assert_normals_exact(final, reference)
    assert_clean(engine)


# ---------------------------------------------------------------------------------- stop strings
def test_pathological_stop_strings_within_bounds_cost_their_request_only(engine, reference):
    stops = (["a" * 256, "a" * 255 + "b", "\x00" * 256, ".*+?[](){}\\" * 23, "\U0001F600" * 256, "\ufffd" * 256]
             + [" " * (256 - i) for i in range(10)])
    assert len(stops) == bounds.MAX_STOP_STRINGS and max(map(len, stops)) == bounds.MAX_STOP_LENGTH
    add_normals(engine)
    engine.add_request("hostile", NORMAL[0], SamplingParams(**GREEDY, stop=stops))
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "length" and final["hostile"].token_ids == reference["normal-0"]
    assert_normals_exact(final, reference)
    assert_clean(engine)


def test_a_stop_string_fault_fails_only_its_request(engine, reference, monkeypatch):
    real_add_token = engine_module._Request.add_token

    def add_token(self, token_id):
        if self.seq.request_id == "hostile":
            raise UnicodeError("injected stop-string fault")
        return real_add_token(self, token_id)

    monkeypatch.setattr(engine_module._Request, "add_token", add_token)
    add_normals(engine)
    engine.add_request("hostile", "hi", SamplingParams(**GREEDY, stop=["zz"]))
    final = run_to_end(engine)
    assert final["hostile"].finish_reason == "error" and "injected stop-string fault" in final["hostile"].error
    assert_normals_exact(final, reference)
    assert_clean(engine)


# ---------------------------------------------------------------------------------- offline API
def test_llm_generate_reports_a_failed_request_in_its_output(embedded_llm, monkeypatch):
    good = SamplingParams(**GREEDY)
    alone = [o.token_ids for o in embedded_llm.generate([NORMAL[0], NORMAL[2]], good)]
    real_sample = engine_module.sample

    def sample(logits, seqs, draw_kernel):
        if any(s.prompt == "HOSTILE" for s in seqs):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, seqs, draw_kernel)

    monkeypatch.setattr(engine_module, "sample", sample)
    outs = embedded_llm.generate([NORMAL[0], "HOSTILE", NORMAL[2]], good)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "injected sampler fault" in outs[1].error and outs[0].error is None
    assert [outs[0].token_ids, outs[2].token_ids] == alone
    hostile = SamplingParams()
    hostile.top_k = 2**63
    with pytest.raises(ValueError, match="^top_k="):  # bad parameters: refused before anything is queued
        embedded_llm.generate([NORMAL[0], NORMAL[1]], [good, hostile])
    assert not embedded_llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------- the server's engine thread
def test_engine_loop_survives_a_fault_outside_any_request(engine, reference, monkeypatch):
    """A step that raises outside any request's work fails what is in flight with a 500 error
    object each, frees their blocks, and the loop serves the next request."""
    from infer.runtime.serving.engine_loop import EngineLoop
    from infer.runtime.serving.metrics import ServerMetrics
    from infer.runtime.serving.protocol import APIError

    real_schedule = engine.scheduler.schedule
    faults = []

    def schedule():
        if not faults:
            faults.append(1)
            raise RuntimeError("injected scheduler fault")
        return real_schedule()

    async def main():
        loop = asyncio.get_running_loop()
        runner = EngineLoop(engine, loop, ServerMetrics("m"))

        def submit(rid, prompt) -> asyncio.Queue:
            queue = asyncio.Queue()
            runner.add(rid, engine.tokenizer.encode(prompt), SamplingParams(**GREEDY), queue, loop.time())
            return queue

        async def last(queue):
            while True:
                item = await asyncio.wait_for(queue.get(), 120)
                if isinstance(item, Exception) or item[0].finished:
                    return item

        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        queues = [submit("a", NORMAL[0]), submit("b", NORMAL[1])]  # both in the first step, which fails
        runner.start()
        try:
            failed = [await last(q) for q in queues]
            monkeypatch.undo()
            assert_clean(engine)
            after = await last(submit("c", NORMAL[2]))
            return failed, after
        finally:
            runner.stop()

    failed, (after, _, _) = asyncio.run(main())  # (output, Finished, when handed over)
    assert all(isinstance(e, APIError) and e.status == 500 and "injected scheduler fault" in e.message for e in failed)
    assert after.token_ids == reference["normal-2"]
    assert_clean(engine)


# ---------------------------------------------------------------------------------- the KV cache
def test_stale_memory_in_a_new_kv_cache_cannot_reach_a_request(embedded_artifact, monkeypatch):
    """torch.empty hands out stale memory, which can hold NaN; attention over padded or past-the-end
    slots weights them by 0, and 0 x NaN is NaN. Here every torch.empty while the engine starts returns
    NaN (the worst stale memory): the cache it serves from must still be clean, and answers unchanged."""
    real_empty = torch.empty

    def stale_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", stale_empty)
    engine = LLMEngine(embedded_artifact, kv_cache_memory=16 << 20)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert not torch.isnan(engine.runner.kv_cache).any()
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    outs = []
    for i in range(2):  # the second one hits the prefix cache: its chunk attends to cached blocks, padded
        engine.add_request(f"r{i}", prompt, SamplingParams(**GREEDY))
        outs.append(run_to_end(engine)[f"r{i}"])
    assert outs[1].num_cached_tokens > 0
    assert [o.error for o in outs] == [None, None] and outs[0].token_ids == outs[1].token_ids
