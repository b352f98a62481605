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


# ---------------------------------------------------------------------------- the model runner's decode graphs

def test_buckets_up_to_stops_at_the_bucket_that_holds_the_largest_batch():
    from infer.kernels.cuda_graphs import DEFAULT_BUCKETS, buckets_up_to

    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(5) == (1, 2, 4, 8)
    assert buckets_up_to(64) == DEFAULT_BUCKETS
    assert buckets_up_to(128) == DEFAULT_BUCKETS  # past the largest: every bucket, larger batches run eagerly


def test_graphs_are_planned_only_on_cuda_with_the_triton_kernels():
    from infer.runtime.engine.model_runner import graph_buckets_for

    cuda = torch.device("cuda")  # a device name only: nothing runs on it
    assert graph_buckets_for(cuda, "triton", True, 5) == (1, 2, 4, 8)
    assert graph_buckets_for(cuda, "triton", False, 5) is None  # --no-cuda-graphs
    assert graph_buckets_for(cuda, "torch", True, 5) is None  # index_copy_ cannot skip a padding slot
    assert graph_buckets_for(torch.device("cpu"), "triton", True, 5) is None


BLOCK = 4


@pytest.fixture(scope="module")
def triton_kernels():
    from infer.kernels.resolver import resolve

    return resolve("triton", dtype=torch.float32)


def runners(triton_kernels, buckets):
    """An eager runner and one that pads decode steps to ``buckets``, over one model and equal caches."""
    from runner_helpers import tiny_model

    from infer.runtime.engine.model_runner import ModelRunner

    model = tiny_model(triton_kernels)
    eager = ModelRunner(model, 40, BLOCK, triton_kernels)
    padded = ModelRunner(model, 40, BLOCK, triton_kernels, graph_buckets=buckets)
    cache = torch.randn_like(eager.kv_cache)
    eager.kv_cache.copy_(cache)
    padded.kv_cache.copy_(cache)
    calls = []
    step = padded.graphs.step
    padded.graphs.step = lambda x: calls.append(x.num_seqs) or step(x)
    return eager, padded, calls


def test_decode_inputs_are_made_for_decode_only_steps_alone(triton_kernels):
    from runner_helpers import batch

    eager, _, _ = runners(triton_kernels, BUCKETS)
    decodes = eager.prepare(batch([5, 9, 3], BLOCK, [True, True, True]))
    x = decodes.decode_inputs()
    assert x.num_seqs == 3 and x.input_ids is decodes.input_ids and x.slot_mapping is decodes.slots
    assert x.block_tables is decodes.decode_blocks and torch.equal(x.context_lens, torch.tensor([5, 9, 3]))
    assert eager.prepare(batch([5, 6], BLOCK, [True, False])).decode_inputs() is None  # a prompt chunk beside
    decodes.decode_kernel = False  # the tuning chose gather + SDPA: not the path the graphs capture
    assert decodes.decode_inputs() is None


@pytest.mark.parametrize("n", [1, 3, 5])
def test_the_runner_pads_a_decode_step_to_its_bucket_and_gets_the_eager_rows(triton_kernels, n):
    """The real model and triton kernels (interpreted): what a captured graph computes, run eagerly."""
    from runner_helpers import batch

    eager, padded, calls = runners(triton_kernels, BUCKETS)
    assert padded.graphs.buffers.max_blocks == 64 // BLOCK  # the widest table the model's positions need
    untouched = padded.kv_cache.clone()
    b = batch([5, 9, 3, 12, 7][:n], BLOCK, [True] * n)
    want = eager.forward(eager.prepare(b))
    got = padded.forward(padded.prepare(b))
    bucket = choose_bucket(n, BUCKETS)
    assert calls == [bucket]  # padded to the bucket
    assert got.shape == want.shape == (n, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)
    # only the batch's own slots changed: the padding rows (slot -1) wrote nowhere
    slots = padded.prepare(b).slots
    rows = padded.kv_cache.view(2, 2, -1, 2, 16)  # [layers, k/v, slots, kv_heads, d]
    others = torch.ones(rows.shape[2], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(rows[:, :, others], untouched.view(2, 2, -1, 2, 16)[:, :, others])
    assert not torch.equal(rows[:, :, slots], untouched.view(2, 2, -1, 2, 16)[:, :, slots])
    view = padded.graphs.buffers.view(bucket)
    assert (view.slot_mapping[n:] == PAD_SLOT).all() and (view.context_lens[n:] == PAD_CONTEXT_LEN).all()


def test_mixed_steps_and_batches_past_the_largest_bucket_run_eagerly(triton_kernels):
    from runner_helpers import batch

    eager, padded, calls = runners(triton_kernels, (1, 2))
    before = padded.graphs.buffers.full.input_ids.clone()
    for b in (batch([5, 6, 3], BLOCK, [True, False, True]), batch([5, 9, 3], BLOCK, [True, True, True])):
        want = eager.forward(eager.prepare(b))
        got = padded.forward(padded.prepare(b))
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the very same eager call
    assert calls == [] and torch.equal(padded.graphs.buffers.full.input_ids, before)


def test_graphs_need_the_triton_kernels():
    from runner_helpers import tiny_model

    from infer.kernels.resolver import resolve
    from infer.runtime.engine.model_runner import ModelRunner

    kernels = resolve("torch")
    with pytest.raises(ValueError, match="kernels=triton"):
        ModelRunner(tiny_model(kernels), 40, BLOCK, kernels, graph_buckets=BUCKETS)


def _compiled_cuda() -> bool:
    from infer.kernels.triton_ops import interpreting

    return torch.cuda.is_available() and not interpreting()


@pytest.mark.skipif(not _compiled_cuda(), reason="needs a CUDA device and TRITON_INTERPRET=0 (absent here): the "
                    "bucketing, padding and the runner's padded decode path are checked on the CPU above; "
                    "bench/device_check.py's engine section captures and replays them on a GPU")
def test_on_cuda_the_runner_captures_every_bucket_and_replays_the_eager_rows():
    from runner_helpers import batch, tiny_model

    from infer.kernels.resolver import resolve
    from infer.runtime.engine.model_runner import ModelRunner

    device = torch.device("cuda", torch.cuda.current_device())
    kernels = resolve("triton", dtype=torch.float32, device=device)
    model = tiny_model(kernels).to(device)
    eager = ModelRunner(model, 40, BLOCK, kernels)
    graphed = ModelRunner(model, 40, BLOCK, kernels, graph_buckets=BUCKETS)
    assert sorted(graphed.graphs.graphs) == list(BUCKETS)  # captured at construction
    cache = torch.randn_like(eager.kv_cache)
    eager.kv_cache.copy_(cache)
    graphed.kv_cache.copy_(cache)
    b = batch([5, 9, 3], BLOCK, [True] * 3)
    torch.testing.assert_close(graphed.forward(graphed.prepare(b)), eager.forward(eager.prepare(b)),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, rtol=1e-4, atol=1e-4)
