"""Block manager and prefix cache: reference counts, no leaks, hits, LRU eviction."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from infer.runtime.engine.block_manager import BlockManager
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.engine.sequence import Sequence

BS = 4


def seq_of(tokens, **params) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(**params))


def admit(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler does for a new sequence: reuse cached blocks, allocate and compute the rest."""
    bm.match_prefix(seq)
    n = seq.num_uncomputed_tokens
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)
        assert len(s.block_table) * BS >= s.num_computed_tokens
        for b in s.block_table:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 10**6)),
                min_size=1, max_size=200),
       st.integers(8, 40))
def test_random_operations_never_leak_or_miscount(ops, num_blocks):
    bm = BlockManager(num_blocks, BS)
    rng = random.Random(num_blocks)
    live: list[Sequence] = []
    for op, x in ops:
        if op == "add":
            # tokens from a tiny alphabet and shared stems, so prefixes repeat and the cache gets hits
            seq = seq_of([x % 3] * (x % 5) + [rng.randrange(3) for _ in range(1 + x % 13)])
            if bm.can_allocate(seq, len(seq)) and bm.blocks_needed(seq, len(seq)) <= bm.num_free_blocks:
                admit(bm, seq)
                live.append(seq)
        elif op == "append" and live:
            seq = live[x % len(live)]
            seq.token_ids.append(x % 3)
            if bm.can_allocate(seq, 1):
                bm.allocate(seq, 1)
                seq.num_computed_tokens += 1
                bm.register_full_blocks(seq)
            else:
                seq.token_ids.pop()
        elif op == "fork" and live:
            parent = live[x % len(live)]
            child = seq_of(parent.token_ids)
            bm.fork(parent, child)
            child.num_computed_tokens = min(child.num_computed_tokens, len(child))
            live.append(child)
        elif op == "free" and live:
            bm.free_sequence(live.pop(x % len(live)))
        check_invariants(bm, live)
    for seq in live:
        bm.free_sequence(seq)
    assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hits_reuse_leading_blocks_and_count():
    bm = BlockManager(16, BS)
    a = seq_of(range(10))  # 2 full blocks + 2 tokens
    admit(bm, a)
    b = seq_of(list(range(8)) + [99, 98, 97])
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq_of(range(8))  # fully cached prompt: the last block is recomputed so its last token has logits
    assert bm.match_prefix(c) == 4
    assert bm.prefix_queries == 9 + 10 + 7 and bm.prefix_hits == 0 + 8 + 4  # len - 1 tokens each
    d = seq_of(range(10), prompt_logprobs=1)  # prompt logprobs need every position computed
    assert bm.match_prefix(d) == 0


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(6, BS)
    old, new = seq_of([1] * 9), seq_of([2] * 9)
    admit(bm, old)
    bm.free_sequence(old)
    admit(bm, new)
    bm.free_sequence(new)
    assert len(bm.cached) == 4 and bm.num_free_blocks == 6
    again = seq_of([1] * 9)
    assert bm.match_prefix(again) == 8  # still cached after being freed
    bm.free_sequence(again)
    # blocks without reusable content go first; then a new block evicts the least recently freed one
    for token in (7, 8, 9):
        admit(bm, seq_of([token] * 3))
    assert bm.match_prefix(seq_of([1] * 9)) == 8
    assert bm.match_prefix(seq_of([2] * 9)) == 4  # its tail block was the one evicted
