"""The C++ kernels check every index they are handed: a bad block id, context length, slot, shape
or dtype raises a clear error instead of reading or writing outside the KV cache.

The bad calls run in a child process (this file, run as a script), one after another, each
printing its outcome at once: a kernel that reads out of bounds then crashes the child, not the
test run; the test names the call that did it, and a fresh child goes on with the next call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.kernels import cpu_attention

S, H, KVH, D, BS, NB = 3, 4, 2, 32, 4, 8  # sequences, heads, KV heads, head_dim, block size, blocks


def _decode_inputs():
    q = torch.randn(S, H, D)
    k, v = torch.randn(NB, BS, KVH, D), torch.randn(NB, BS, KVH, D)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]])
    lens = torch.tensor([5, 12, 1])
    return q, k, v, tables, lens


def _with(tensor, index, value):
    out = tensor.clone()
    out[index] = value
    return out


def decode_cases():
    """name -> (a call with one bad input, the message it must raise)."""
    q, k, v, tables, lens = _decode_inputs()
    f = cpu_attention.paged_decode_attention
    return {
        "block id = blocks": (lambda: f(q, k, v, _with(tables, (1, 2), NB), lens, 1.0),
                              r"block id 8 at block_tables\[1\]\[2\] is outside the cache's 8 blocks"),
        "block id -1": (lambda: f(q, k, v, _with(tables, (0, 1), -1), lens, 1.0), r"block id -1 at block_tables\[0\]\[1\]"),
        "block id 2**40": (lambda: f(q, k, v, _with(tables, (2, 0), 2**40), lens, 1.0), r"block id 1099511627776"),
        "context 0": (lambda: f(q, k, v, tables, _with(lens, 2, 0), 1.0), r"context length 0 of sequence 2 is outside 1..12"),
        "context -3": (lambda: f(q, k, v, tables, _with(lens, 0, -3), 1.0), r"context length -3 of sequence 0"),
        "context > table": (lambda: f(q, k, v, tables, _with(lens, 1, 13), 1.0),
                            r"context length 13 of sequence 1 is outside 1..12 \(its block table's 3 blocks of 4"),
        "table rows": (lambda: f(q, k, v, tables[:2], lens, 1.0), r"block_tables must be \[seqs, max_blocks\]"),
        "lens count": (lambda: f(q, k, v, tables, lens[:2], 1.0), r"context_lens \[seqs\] for 3 sequences"),
        "table 1-d": (lambda: f(q, k, v, tables.flatten(), lens, 1.0), r"block_tables must be \[seqs, max_blocks\]"),
        "v dtype": (lambda: f(q, k, v.double(), tables, lens, 1.0),
                    r"the caches must share a dtype, q.s or int8.*got q Float, k_cache Float, v_cache Double"),
        "int32 tables": (lambda: f(q, k, v, tables.int(), lens, 1.0), r"int64 tables"),
        "heads": (lambda: f(torch.randn(S, 3, D), k, v, tables, lens, 1.0), r"head layout mismatch"),
        "no kv heads": (lambda: f(q, k[:, :, :0], v[:, :, :0], tables, lens, 1.0), r"head layout mismatch"),
        "head_dim": (lambda: f(torch.randn(S, H, 16), k, v, tables, lens, 1.0), r"head layout mismatch"),
    }


def store_cases():
    k, v = torch.randn(NB, BS, KVH, D), torch.randn(NB, BS, KVH, D)
    new = torch.randn(2, KVH, D)
    slots = torch.tensor([3, 17])
    f = cpu_attention.store_kv_
    return {
        "slot = capacity": (lambda: f(k, v, _with(slots, 1, NB * BS), new, new), r"slot 32 outside the cache of 32"),
        "slot -1": (lambda: f(k, v, _with(slots, 0, -1), new, new), r"slot -1 outside the cache"),
        "slot 2**40": (lambda: f(k, v, _with(slots, 0, 2**40), new, new), r"slot 1099511627776 outside"),
        "slots count": (lambda: f(k, v, slots[:1], new, new), r"one row per slot"),
        "slots 2-d": (lambda: f(k, v, slots.view(2, 1), new, new), r"slots must be a contiguous \[T\] int64"),
        "v cache dtype": (lambda: f(k, v.half(), slots, new, new), r"of one shape and dtype"),
        "k dtype": (lambda: f(k, v, slots, new.double(), new), r"of the cache's dtype"),
        "int32 slots": (lambda: f(k, v, slots.int(), new, new), r"int64"),
    }


def chunk_cases(module=None):
    """chunk_attention (AMX, AVX-512 BF16): each call fails its checks before any cache or row is read."""
    bf = torch.bfloat16
    q = torch.randn(20, 4, 32).to(bf)
    out = torch.empty_like(q)
    k, v = torch.randn(6, 16, 2, 32).to(bf), torch.randn(6, 16, 2, 32).to(bf)
    starts, lengths, cached = torch.tensor([0, 10]), torch.tensor([10, 10]), torch.tensor([5, 20])
    tables = torch.tensor([[0, 1], [2, 3]])
    def f(*args):
        return module.chunk_attention(*args)

    def call(**bad):
        a = {"q": q, "k": k, "v": v, "out": out, "starts": starts, "lengths": lengths, "cached": cached,
             "tables": tables} | bad
        return lambda: f(a["q"], a["k"], a["v"], a["out"], a["starts"], a["lengths"], a["cached"], a["tables"], 1.0)

    return {
        "block id = blocks": (call(tables=_with(tables, (1, 1), 6)), r"block id 6 at tables\[1\]\[1\] is outside the cache's 6"),
        "block id -1": (call(tables=_with(tables, (0, 0), -1)), r"block id -1 at tables\[0\]\[0\]"),
        "rows past q": (call(starts=_with(starts, 1, 15)), r"chunk 1 \(start 15, length 10, cached 20\) does not fit"),
        "context past table": (call(cached=_with(cached, 1, 30)), r"chunk 1 .* does not fit .* block table of 2 blocks"),
        "length 0": (call(lengths=_with(lengths, 0, 0)), r"chunk 0 .* does not fit"),
        "table rows": (call(tables=tables[:1]), r"tables \[chunks, width\] for 2 chunks"),
        "lengths count": (call(lengths=lengths[:1]), r"must be \[chunks\]"),
        "v dtype": (call(v=v.float()), r"bfloat16 only"),
        "no kv heads": (call(k=k[:, :, :0], v=v[:, :, :0]), r"multiple of kv_heads"),
    }


def _amx_module():
    """The AMX chunk kernel's module, built even where the CPU has no AMX (its checks run before any
    AMX instruction); None where it cannot be built or the CPU lacks AVX-512 (the flags it needs)."""
    from infer.kernels.extension import AMX_FLAGS, build, cpu_flags

    if not torch.cpu._is_amx_tile_supported() and "avx512f" not in cpu_flags().split():
        return None
    return build("infer_amx_attention", "amx_attention.cpp", AMX_FLAGS)


def _bf16_module():
    """The class's chunk kernel's module (kernels/csrc/bf16_attention.cpp), or None below AVX2 + FMA."""
    from infer.kernels import bf16_attention

    return bf16_attention.load()


CHUNK_MODULES = {"chunk": _amx_module, "chunk_bf16": _bf16_module}


def _cases(group: str) -> dict:
    return {"decode": decode_cases, "store": store_cases}.get(group, chunk_cases)()


def _child(group: str, start: int) -> None:
    cases = (decode_cases() if group == "decode" else store_cases() if group == "store" else
             chunk_cases(CHUNK_MODULES[group]()))
    for name, (call, _) in list(cases.items())[start:]:
        try:
            call()
            outcome = {"case": name, "raised": None}
        except Exception as e:  # noqa: BLE001 - the type and message are what is checked
            outcome = {"case": name, "raised": type(e).__name__, "message": str(e).splitlines()[0]}
        print(json.dumps(outcome), flush=True)


@pytest.fixture(scope="module")
def outcomes():
    """{group: {case: outcome}}: a child per group, run once; after a crash, a new one from the next case."""
    results = {}

    def run(group):
        if group in results:
            return results[group]
        names, seen = list(_cases(group)), {}
        while len(seen) < len(names):
            child = subprocess.run([sys.executable, __file__, group, str(len(seen))], capture_output=True, text=True,
                                   timeout=600, check=False)  # a crash is an outcome here, not an error
            seen |= {o["case"]: o for o in (json.loads(x) for x in child.stdout.splitlines() if x.startswith("{"))}
            if child.returncode != 0 and len(seen) < len(names):  # this case took the process down
                seen[names[len(seen)]] = {"crashed": child.returncode, "stderr": child.stderr[-1500:]}
        results[group] = seen
        return seen

    return run


def _check(outcomes, group, case, pattern):
    import re

    o = outcomes(group)[case]
    assert "crashed" not in o, (f"{case}: the kernel crashed the process (exit {o['crashed']}) instead of "
                                f"raising\n{o['stderr']}")
    assert o["raised"] == "RuntimeError", f"{case}: expected a RuntimeError, the call returned ({o})"
    assert re.search(pattern, o["message"]), o["message"]


@pytest.mark.parametrize("case", list(decode_cases()))
def test_paged_decode_attention_refuses_bad_indices(outcomes, case):
    _check(outcomes, "decode", case, decode_cases()[case][1])


@pytest.mark.parametrize("case", list(store_cases()))
def test_store_kv_refuses_bad_slots(outcomes, case):
    _check(outcomes, "store", case, store_cases()[case][1])


@pytest.mark.parametrize("case", list(chunk_cases()))
def test_amx_chunk_attention_refuses_bad_indices(outcomes, case):
    if _amx_module() is None:
        pytest.skip("the AMX chunk kernel cannot be built here (no AVX-512 or no compiler): nothing to check")
    _check(outcomes, "chunk", case, chunk_cases()[case][1])


@pytest.mark.parametrize("case", list(chunk_cases()))
def test_avx512_bf16_chunk_attention_refuses_bad_indices(outcomes, case):
    if _bf16_module() is None:
        pytest.skip("this CPU has no AVX2 + FMA: the kernel is never loaded here, nothing to check")
    _check(outcomes, "chunk_bf16", case, chunk_cases()[case][1])


def test_table_entries_past_the_context_are_never_read():
    """Padding (any value) past a sequence's context is allowed: only the blocks it reaches are checked."""
    q, k, v, tables, lens = _decode_inputs()
    padded = tables.clone()
    padded[0, 2] = -1  # sequence 0 has 5 tokens: blocks 0 and 1 only
    padded[2, 1:] = 10**9  # sequence 2 has 1 token
    assert torch.equal(cpu_attention.paged_decode_attention(q, k, v, padded, lens, D ** -0.5),
                       cpu_attention.paged_decode_attention(q, k, v, tables, lens, D ** -0.5))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _child(sys.argv[1], int(sys.argv[2]))
