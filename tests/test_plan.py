"""The plan (runtime/engine/plan.py) decides what runs; a step trace shows that what ran is what it said.

Spies wrap the kernels themselves (the one-call step's entry, the paged decode kernel, the chunk kernels,
torch SDPA by its call site), each labelled by which kernel it is, found independently of the plan; every
step's recorded calls must be the plan's ``route`` for that step's rows. Prompts alone, prompts after a
prefix-cache hit, decodes, mixed steps, a tuning table that sends some decode batches to SDPA, an int8
cache (prompt rows as decode rows), speculative verify rows and the torch kernels are each driven through."""

from __future__ import annotations

import random
import sys
from dataclasses import replace

import pytest
import torch

from conftest import AMX_MODES
from infer.kernels import amx_attention, bf16_attention, cpu_attention, step_layers
from infer.kernels.resolver import cpu_has_amx
from infer.runtime import LLM, SamplingParams
from infer.runtime.engine import attention as attention_module
from infer.runtime.engine.plan import LAYER_LOOP, ONE_CALL

FUSED = step_layers.load()


def _kernel_names() -> dict[int, str]:
    """id of each compiled attention entry point -> the name the plan uses for it."""
    names = {}
    module = cpu_attention.load()
    if module is not None:
        names[id(module.paged_decode_attention)] = "decode:cpp"
    module = bf16_attention.load()
    if module is not None:
        names[id(module.chunk_attention)] = f"chunks:{bf16_attention.name()}"
    module = amx_attention.load() if cpu_has_amx() else None
    if module is not None:
        names[id(module.chunk_attention)] = "chunks:amx"
    return names


class _Trace:
    """Wraps an engine's runner: records what each step ran against what its plan routed."""

    def __init__(self, engine, monkeypatch):
        self.engine, self.calls, self.steps = engine, set(), []
        runner, names = engine.runner, _kernel_names()

        def spy(fn, label):
            def call(*args, **kwargs):
                self.calls.add(label)
                return fn(*args, **kwargs)
            return call

        if runner.decode_kernel is not None:
            runner.decode_kernel = spy(runner.decode_kernel, names[id(runner.decode_kernel)])
        if runner.chunk_kernel is not None:
            runner.chunk_kernel = spy(runner.chunk_kernel, names[id(runner.chunk_kernel)])
        fused = engine.model.fused_step
        if fused is not None:
            fused.module = type("Spied", (), {"step_layers": staticmethod(spy(fused.module.step_layers, ONE_CALL))})
        sdpa = attention_module.attention

        def sdpa_spy(*args, **kwargs):  # torch SDPA, named by its caller: a decode's or a prompt chunk's
            caller = sys._getframe(1).f_code.co_qualname
            self.calls.add("decode:torch-sdpa" if caller == "PagedAttention.attend" else "chunks:torch-sdpa")
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(attention_module, "attention", sdpa_spy)
        forward = runner.forward

        def traced(inputs):
            self.calls = set()
            out = forward(inputs)
            route = runner.plan.route(len(inputs.chunk_starts), len(inputs.decode_rows))
            self.steps.append((len(inputs.chunk_starts), len(inputs.decode_rows), route, frozenset(self.calls)))
            return out

        runner.forward = traced

    def check(self) -> set[tuple[str, ...]]:
        """Every step ran its route; returns the routes seen."""
        for chunks, decodes, route, ran in self.steps:
            assert ran == set(route), f"step with {chunks} chunks, {decodes} decode rows: plan {route}, ran {ran}"
        return {route for _, _, route, _ in self.steps}


def _drive(llm, **params):
    """Fresh prompts in chunks beside decodes, then prompts after a cached prefix, then one alone.

    The first prompt fits one 96-token step with room to spare and the others do not, so the second step always
    decodes the first beside a chunk of the second (a mixed step), whatever lengths the seed draws."""
    from pydoc_data.topics import topics

    text = "".join(topics.values())
    starts = [random.randrange(len(text) - 3000) for _ in range(3)]
    lengths = [random.randint(40, 80), random.randint(120, 160), random.randint(120, 160)]
    prompts = [llm.tokenizer.encode(text[s:s + 3000])[:n] for s, n in zip(starts, lengths)]
    shared = prompts[0][:48]
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **params)
    for batch in (prompts, [shared + p[:24] for p in prompts[1:]], prompts[:1]):
        llm.generate(batch, sampling)


def _llm(artifact, **args):
    return LLM(artifact, dtype="bfloat16", kv_cache_memory=64 << 20, tuning="off", max_num_batched_tokens=96,
               prefill_batch_tokens=0, **args)


@pytest.mark.parametrize("amx", AMX_MODES)
def test_every_step_runs_the_kernels_its_plan_routes_it_to(embedded_artifact, monkeypatch, amx):
    llm = _llm(embedded_artifact, amx=amx)
    plan = llm.engine.plan
    print(plan.describe())
    trace = _Trace(llm.engine, monkeypatch)
    _drive(llm)
    routes = trace.check()
    if FUSED is None:  # below AVX2: the layer loop over the portable decode kernel and SDPA chunks
        assert plan.step == LAYER_LOOP and ("chunks:torch-sdpa",) in routes, routes
        return
    assert plan.step == ONE_CALL and plan.linears["qkv_proj"] == f"bfloat16 {'amx' if amx else 'blocks'}", plan
    assert plan.prefill_attention == ("amx" if amx else bf16_attention.name()), plan
    assert routes == {(ONE_CALL,)}, routes  # prompts, prompts after cached tokens, decodes, mixed: all in one call
    kinds = {(c > 0, d > 0) for c, d, _, _ in trace.steps}
    assert {(True, False), (False, True), (True, True)} <= kinds, kinds


def test_a_tuning_table_that_picks_sdpa_sends_those_decode_batches_to_the_layer_loop(embedded_artifact, monkeypatch):
    llm = _llm(embedded_artifact, amx=False)

    class SdpaFromTwo:  # a table that measured gather + SDPA faster from two decodes up
        buckets = [1, 2, 4]

        @staticmethod
        def decode_attention(rows):
            return "torch-sdpa" if rows >= 2 else "cpp"

    plan = replace(llm.engine.runner.plan, tuning=SdpaFromTwo())
    llm.engine.runner.plan = plan
    trace = _Trace(llm.engine, monkeypatch)
    _drive(llm)
    routes = trace.check()
    assert ("decode:torch-sdpa",) in routes, routes  # decode-only steps of two or three
    if FUSED is not None:
        assert (ONE_CALL,) in routes, routes  # one decode alone, and prompt-only steps
    for chunks, decodes, route, _ in trace.steps:
        assert ("decode:torch-sdpa" in route) == (decodes >= 2), (chunks, decodes, route)


def test_an_int8_cache_runs_prompt_rows_as_decode_rows(embedded_artifact, monkeypatch):
    llm = _llm(embedded_artifact, amx=False, kv_cache_dtype="int8")
    plan = llm.engine.plan
    assert plan.kv_cache == "int8" and plan.prompt_rows == "decode-rows" and plan.prefill_attention == "decode"
    trace = _Trace(llm.engine, monkeypatch)
    _drive(llm)
    routes = trace.check()
    assert all(chunks == 0 for chunks, _, _, _ in trace.steps)
    assert routes == ({(ONE_CALL,)} if FUSED is not None else {("decode:cpp",)}), routes


def test_speculative_verify_rows_run_as_decode_rows(embedded_artifact, monkeypatch):
    llm = _llm(embedded_artifact, amx=False, speculative="ngram", num_speculative_tokens=3)
    trace = _Trace(llm.engine, monkeypatch)
    # a prompt that repeats itself: the n-gram drafts find continuations to propose
    text = "the cat sat on the mat and the dog sat on the log. " * 8
    llm.generate([llm.tokenizer.encode(text)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    trace.check()
    assert llm.engine.stats["spec_drafted"] > 0, llm.engine.stats
    verify = [s for s in trace.steps if s[0] == 0 and s[1] > 1]  # one sequence, several decode rows: a verify step
    assert verify, trace.steps


def test_the_torch_kernels_route_everything_to_sdpa(embedded_artifact, monkeypatch):
    llm = _llm(embedded_artifact, kernels="torch")
    plan = llm.engine.plan
    assert (plan.backend, plan.step, plan.decode_attention, plan.prefill_attention) == \
        ("torch", LAYER_LOOP, "torch-sdpa", "torch-sdpa"), plan
    trace = _Trace(llm.engine, monkeypatch)
    _drive(llm)
    assert trace.check() >= {("chunks:torch-sdpa",), ("decode:torch-sdpa",), ("chunks:torch-sdpa", "decode:torch-sdpa")}


def test_version_and_the_load_log_print_the_plan(embedded_artifact, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="infer.engine"):
        llm = _llm(embedded_artifact, amx=False)
    described = llm.engine.plan.describe()
    assert f"plan: {described}" in caplog.text
    assert set(described) >= {"cpu_class", "kv_cache", "step", "linears", "decode_attention", "prefill_attention",
                              "prompt_rows", "verify_rows"}
    assert described["linears"]["lm_head"].startswith("bfloat16 ")


def test_prompt_rows_as_decode_rows_on_a_16_bit_cache(embedded_artifact, monkeypatch):
    """The like-for-like reference for the int8 cache: a bfloat16 cache whose prompt rows attend as decode rows
    (every step's rows decode rows); a wrong value is refused by name."""
    llm = _llm(embedded_artifact, amx=False, prompt_rows="decode-rows")
    plan = llm.engine.plan
    assert (plan.kv_cache, plan.prompt_rows, plan.prefill_attention) == ("bfloat16", "decode-rows", "decode"), plan
    trace = _Trace(llm.engine, monkeypatch)
    _drive(llm)
    trace.check()
    assert all(chunks == 0 for chunks, _, _, _ in trace.steps) and len(trace.steps) > 3
    with pytest.raises(ValueError, match="prompt_rows='chunks': choose one of auto, decode-rows"):
        _llm(embedded_artifact, amx=False, prompt_rows="chunks")
