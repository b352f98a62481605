"""kernels/cuda_graphs.py on the CPU: buckets, padding and static buffers (the capture itself needs a
GPU: bench/device_check.py replays graphs against eager steps there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.kernels.cuda_graphs import (PAD_CONTEXT_LEN, PAD_SLOT, DecodeInputs, GraphRunner, StaticDecodeBuffers,
                                       choose_bucket, pad_decode_inputs)

BUCKETS = (1, 2, 4, 8)


def test_choose_bucket_is_the_smallest_that_fits():
    assert [choose_bucket(n, BUCKETS) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert choose_bucket(3, (8, 4, 2)) == 4  # order of the buckets does not matter
    for n in range(1, 65):
        b = choose_bucket(n)
        assert b >= n and not any(n <= other < b for other in (1, 2, 4, 8, 16, 24, 32, 48, 64))


class ToyDecodeStep:
    """A decode step with the real step's data flow in plain torch: embed the token, write its K/V
    into the paged cache at its slot (padding slots write nowhere), attend over the block table."""

    def __init__(self, vocab=50, kv_heads=2, heads=4, d=8, num_blocks=40, block_size=4):
        g = torch.Generator().manual_seed(torch.initial_seed())
        self.embed = torch.randn(vocab, heads * d, generator=g)
        self.wk = torch.randn(heads * d, kv_heads * d, generator=g) * 0.3
        self.wv = torch.randn(heads * d, kv_heads * d, generator=g) * 0.3
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
        self.heads, self.kv_heads, self.d, self.block_size = heads, kv_heads, d, block_size
        self.rows_seen = []

    def __call__(self, x: DecodeInputs) -> torch.Tensor:
        self.rows_seen.append(x.num_seqs)
        h = self.embed[x.input_ids] + x.positions[:, None].float() * 0.01
        k = (h @ self.wk).view(-1, self.kv_heads, self.d)
        v = (h @ self.wv).view(-1, self.kv_heads, self.d)
        keep = x.slot_mapping >= 0  # what the triton store kernel does with PAD_SLOT
        self.k_cache.view(-1, self.kv_heads, self.d).index_copy_(0, x.slot_mapping[keep], k[keep])
        self.v_cache.view(-1, self.kv_heads, self.d).index_copy_(0, x.slot_mapping[keep], v[keep])
        q = h.view(-1, self.heads, self.d)
        out = []
        for i in range(x.num_seqs):
            n = int(x.context_lens[i])
            blocks = x.block_tables[i, :-(-n // self.block_size)]
            keys = self.k_cache[blocks].reshape(-1, self.kv_heads, self.d)[:n].transpose(0, 1)[None]
            vals = self.v_cache[blocks].reshape(-1, self.kv_heads, self.d)[:n].transpose(0, 1)[None]
            out.append(F.scaled_dot_product_attention(q[i][None, :, None], keys, vals, enable_gqa=True)[0, :, 0])
        return torch.stack(out).reshape(x.num_seqs, -1)

    def cache(self):
        return self.k_cache.clone(), self.v_cache.clone()


def random_batch(n, num_blocks=40, block_size=4, width=3):
    g = torch.Generator().manual_seed(torch.initial_seed() + n)
    lens = torch.randint(1, width * block_size + 1, (n,), generator=g)
    blocks = torch.randperm(num_blocks, generator=g)[:n * width].view(n, width)
    slots = blocks.gather(1, ((lens - 1) // block_size)[:, None])[:, 0] * block_size + (lens - 1) % block_size
    return DecodeInputs(torch.randint(0, 50, (n,), generator=g), lens - 1, slots, blocks, lens)


def test_pad_decode_inputs_fills_padding_rows_harmlessly():
    batch = random_batch(3)
    padded = pad_decode_inputs(batch, 4, max_blocks=5)
    assert padded.block_tables.shape == (4, 5)
    assert torch.equal(padded.block_tables[:3, :3], batch.block_tables) and not padded.block_tables[:3, 3:].any()
    assert padded.slot_mapping[3] == PAD_SLOT and padded.context_lens[3] == PAD_CONTEXT_LEN
    assert padded.input_ids[3] == 0 and padded.positions[3] == 0 and not padded.block_tables[3].any()
    for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
        assert torch.equal(getattr(padded, name)[:3], getattr(batch, name))
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_inputs(batch, 2)


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_padded_step_rows_equal_the_unpadded_step(n):
    batch = random_batch(n)
    eager = ToyDecodeStep()
    want = eager(batch)
    want_cache = eager.cache()

    step = ToyDecodeStep()
    untouched = step.cache()
    runner = GraphRunner(step, max_blocks=4, device="cpu", buckets=BUCKETS)
    got = runner(batch)
    assert step.rows_seen == [choose_bucket(n, BUCKETS)]  # the step ran at the bucket's size
    assert got.shape == want.shape
    # a matmul over more rows may block differently: equal to float32 rounding, not bitwise
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    k, v = step.cache()
    torch.testing.assert_close(k, want_cache[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, want_cache[1], rtol=1e-5, atol=1e-6)
    # the padding rows wrote nowhere: every row but the batch's own slots is bitwise as it was
    others = torch.ones(k.shape[0] * k.shape[1], dtype=torch.bool)
    others[batch.slot_mapping] = False
    assert torch.equal(k.view(-1, *k.shape[2:])[others], untouched[0].view(-1, *k.shape[2:])[others])
    assert torch.equal(v.view(-1, *v.shape[2:])[others], untouched[1].view(-1, *v.shape[2:])[others])
    assert not runner.graphs  # no capture on the CPU


def test_a_batch_over_the_largest_bucket_runs_eagerly_unpadded():
    step = ToyDecodeStep(num_blocks=40)
    runner = GraphRunner(step, max_blocks=4, device="cpu", buckets=BUCKETS)
    batch = random_batch(9, num_blocks=40)
    before = [t.clone() for t in (runner.buffers.full.input_ids, runner.buffers.full.slot_mapping)]
    got = runner(batch)
    assert step.rows_seen == [9] and got.shape[0] == 9
    assert torch.equal(runner.buffers.full.input_ids, before[0])  # static buffers untouched
    assert torch.equal(runner.buffers.full.slot_mapping, before[1])
    ref = ToyDecodeStep(num_blocks=40)
    torch.testing.assert_close(got, ref(batch), rtol=0, atol=0)  # the very same call: bitwise


def test_static_buffers_are_reused_not_reallocated():
    seen = []

    def step(x: DecodeInputs):
        seen.append({f: getattr(x, f).data_ptr() for f in ("input_ids", "positions", "slot_mapping", "block_tables",
                                                            "context_lens")})
        return x.context_lens.float()[:, None]

    runner = GraphRunner(step, max_blocks=4, device="cpu", buckets=BUCKETS)
    full = runner.buffers.full
    ptrs = {f: getattr(full, f).data_ptr() for f in seen_fields()}
    for n in (3, 1, 7, 3, 8):
        out = runner(random_batch(n))
        assert out.shape == (n, 1)
    assert all(s == ptrs for s in seen)  # every bucket's step read views of the same buffers
    assert {f: getattr(runner.buffers.full, f).data_ptr() for f in seen_fields()} == ptrs
    # after a batch of 8 then one of 3, rows 3.. of the bucket are padding again, not stale rows
    runner(random_batch(8))
    runner(random_batch(3))
    view = runner.buffers.view(4)
    assert view.slot_mapping[3] == PAD_SLOT and view.context_lens[3] == PAD_CONTEXT_LEN
    assert not view.block_tables[3].any()


def seen_fields():
    return ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens")


def test_fill_pads_narrower_block_tables_and_refuses_what_does_not_fit():
    buffers = StaticDecodeBuffers(max_batch=4, max_blocks=5, device="cpu")
    wide = random_batch(2, width=5)
    buffers.fill(wide, 2)
    narrow = random_batch(2, width=2)
    view = buffers.fill(narrow, 2)
    assert torch.equal(view.block_tables[:, :2], narrow.block_tables)
    assert not view.block_tables[:, 2:].any()  # no stale blocks from the wider batch
    with pytest.raises(ValueError, match="does not fit"):
        buffers.fill(random_batch(3), 2)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.fill(random_batch(2, num_blocks=20, width=6), 2)
