"""The sampler on known logits: each parameter, seeded determinism, distribution sanity, on both draws (torch's ops
and the C++ kernel, kernels/sample_rows.py); the kernel's choices against a float64 inverse CDF."""

from __future__ import annotations

import math

import pytest
import torch

from infer.kernels import isa, sample_rows
from infer.runtime.engine.sampler import apply_penalties, sample
from infer.runtime.engine.sampling_params import SamplingParams
from infer.runtime.engine.sequence import Sequence

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _kernel():
    module = sample_rows.load()
    assert module is not None, "kernels/csrc/sample_rows.cpp did not build (see the warning above)"
    return module.draw_rows


# below AVX2 no C++ kernel runs, the sampler's included (kernels/resolver.py)
@pytest.fixture(params=["torch", "cpp"] if isa.at_least("avx2") else ["torch"])
def draw(request):
    """The sampler's draw: None (torch's softmax, cumsum, searchsorted) or the C++ kernel the plan hands it."""
    return None if request.param == "torch" else _kernel()


def seqs(n, prompt=(0,), outputs=(), **params):
    out = []
    for _ in range(n):
        s = Sequence("r", list(prompt), SamplingParams(**params))
        s.token_ids += list(outputs)
        out.append(s)
    return out


def frequencies(n: int, draw=None, **params) -> torch.Tensor:
    batch = seqs(n, **params)
    ids = sample(LOGITS.repeat(n, 1), batch, draw).token_ids
    return torch.bincount(torch.tensor(ids), minlength=len(LOGITS)).float() / n


def test_greedy_is_argmax_and_batch_mixes_parameters():
    batch = seqs(1, temperature=0) + seqs(1, temperature=1.0, top_k=1)
    assert sample(LOGITS.repeat(2, 1), batch).token_ids == [0, 0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax_at_temperature(temperature, draw):
    torch.manual_seed(0)
    freq = frequencies(20000, draw, temperature=temperature)
    expected = (LOGITS / temperature).softmax(-1)
    # 20000 draws: the standard error of each frequency is below 0.0036; allow 4 sigma
    assert (freq - expected).abs().max() < 0.015


def test_top_k_top_p_min_p_cut_the_tail(draw):
    torch.manual_seed(1)
    assert set(frequencies(3000, draw, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    probs = LOGITS.softmax(-1)  # 0.57, 0.21, 0.13, 0.08, ...: top_p=0.75 keeps {0, 1}; 0.8 keeps {0, 1, 2}
    assert set(frequencies(3000, draw, top_p=0.75).nonzero().flatten().tolist()) == {0, 1}
    assert set(frequencies(3000, draw, top_p=0.8).nonzero().flatten().tolist()) == {0, 1, 2}
    assert probs[:2].sum() < 0.8
    kept = set(frequencies(3000, draw, min_p=0.2).nonzero().flatten().tolist())
    assert kept == {i for i in range(6) if probs[i] >= 0.2 * probs[0]}
    restricted = frequencies(20000, draw, top_k=3)
    expected = LOGITS[:3].softmax(-1)
    assert (restricted[:3] - expected).abs().max() < 0.015


def test_penalties_exact_values():
    rep = apply_penalties(LOGITS[None].clone(), seqs(1, prompt=(0,), outputs=(4,), repetition_penalty=2.0))[0]
    assert rep[0] == pytest.approx(1.0) and rep[4] == pytest.approx(-2.0) and rep[1] == pytest.approx(1.0)
    pf = apply_penalties(LOGITS[None].clone(), seqs(1, prompt=(1,), outputs=(2, 2, 3), presence_penalty=0.5,
                                                    frequency_penalty=0.25))[0]
    assert pf[2] == pytest.approx(0.5 - 0.5 - 0.5) and pf[3] == pytest.approx(0.0 - 0.5 - 0.25)
    assert pf[1] == pytest.approx(1.0)  # presence/frequency count generated tokens only


def test_seeded_rows_do_not_depend_on_the_batch(draw):
    logits = torch.randn(4, 1000)
    s = seqs(1, temperature=1.0, seed=7)
    alone = [sample(logits[2:3], s, draw).token_ids[0] for _ in range(5)]
    batch = seqs(2, temperature=0.7) + seqs(1, temperature=1.0, seed=7) + seqs(1, temperature=0)
    in_batch = [sample(logits, batch, draw).token_ids[2] for _ in range(5)]
    assert in_batch == alone
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_logprobs_of_chosen_and_top_tokens():
    res = sample(LOGITS[None], seqs(1, temperature=0, logprobs=3))
    lp = res.logprobs[0]
    expected = LOGITS.log_softmax(-1)
    assert lp["token_id"] == 0 and lp["logprob"] == pytest.approx(expected[0].item())
    assert [t for t, _ in lp["top"]] == [0, 1, 2]
    assert math.isclose(sum(math.exp(v) for _, v in lp["top"]), expected[:3].exp().sum().item(), rel_tol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_row_max_is_torchs_max_over_the_last_dimension(rows):
    # the sampler's CPU argmax (numpy's) against torch's: values and first indices, NaN and infinities included
    from infer.runtime.engine.sampler import row_max

    seed = torch.initial_seed()
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 49152, generator=gen)
    x[0, torch.randint(0, 49152, (2,), generator=gen)] = x[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        x[1, 100], x[1, 50] = float("nan"), float("nan")
        x[2] = float("-inf")
    want_values, want_index = x.max(-1)
    got_values, got_index = row_max(x)
    assert torch.equal(got_index, want_index)
    assert torch.equal(got_values.nan_to_num(), want_values.nan_to_num())
    assert torch.equal(got_values.isnan(), want_values.isnan())


def test_all_greedy_rows_on_the_host_choose_as_the_general_path(fresh_seed):
    # float32 on the CPU takes the numpy route (_greedy_on_host); float64 the torch ops every other batch takes
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(6, 1000, generator=gen)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("-inf")
    x[4, 10] = x[4, 20] = x[4].max() + 1  # a tie: the first occurrence
    batch = seqs(6, temperature=0)
    host, general = sample(x, batch), sample(x.double(), batch)
    assert sorted(host.errors) == sorted(general.errors) == [1, 2, 3]
    assert [e.by_request for e in host.errors.values()] == [e.by_request for e in general.errors.values()]
    assert [t for i, t in enumerate(host.token_ids) if i not in host.errors] == \
        [t for i, t in enumerate(general.token_ids) if i not in general.errors] == \
        [x[0].argmax().item(), 10, x[5].argmax().item()]


def test_a_batch_of_sampled_rows_draws_as_the_same_rows_beside_a_greedy_one(fresh_seed, draw):
    # every row sampled takes the logits whole; with a greedy row too, the sampled ones go as a subset: same draws
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(5, 1000, generator=gen)
    x[2, 5] = float("nan")

    def batch(greedy_too: bool):
        rows = [Sequence("r", [0], SamplingParams(temperature=0.8, top_p=0.9, seed=fresh_seed + i)) for i in range(5)]
        return rows + ([Sequence("r", [0], SamplingParams(temperature=0))] if greedy_too else [])

    alone = sample(x, batch(False), draw)
    mixed = sample(torch.cat([x, x[:1]]), batch(True), draw)
    assert alone.token_ids[:2] + alone.token_ids[3:] == mixed.token_ids[:2] + mixed.token_ids[3:5]
    assert sorted(alone.errors) == sorted(mixed.errors) == [2]  # the NaN row fails alone, in both
    assert mixed.token_ids[5] == x[0].argmax().item()


def _reference_weights(x: torch.Tensor, inv_t, top_k, top_p, min_p) -> torch.Tensor:
    """float64 weights exp(s (x - max)) cut as filter_logits cuts them, by sorting: top-k keeps the k largest (and
    their ties), top-p the sorted prefix whose mass first reaches top_p of what top-k kept, min-p e >= min_p."""
    e = ((x.double() - x.double().max(-1, keepdim=True).values) * torch.tensor(inv_t).double()[:, None]).exp()
    keep = e > 0
    for i in range(x.shape[0]):
        if 0 < top_k[i] < x.shape[1]:
            keep[i] &= e[i] >= e[i].topk(top_k[i]).values[-1]
        if top_p[i] < 1:
            ranked = torch.where(keep[i], e[i], 0).sort(descending=True).values
            mass = ranked.cumsum(0)
            keep[i] &= e[i] >= ranked[int((mass < top_p[i] * mass[-1]).sum())]
        keep[i] &= e[i] >= min_p[i]
    return torch.where(keep, e, 0)


def _midway_top_p(x: torch.Tensor, inv_t: float, top_k: int, near: int) -> float:
    """A top-p that keeps exactly the r + 1 largest weights (after top-k), halfway between two cumulative masses,
    for the r within 20 ranks of ``near`` where the weights part most (a float32 weight rounds by ~1e-7: where
    two are closer, float32 and float64 may rank them apart, and so cut them apart)."""
    ranked = _reference_weights(x[None], [inv_t], [top_k], [1.0], [0.0])[0].sort(descending=True).values
    window = torch.arange(max(near - 20, 0), near + 21)
    r = int(window[(ranked[window] / ranked[window + 1]).argmax()])
    mass = ranked.cumsum(0) / ranked.sum()
    return float(mass[r] + mass[r + 1]) / 2 if r > 0 else float(mass[0]) / 2


@pytest.mark.skipif(not isa.at_least("avx2"), reason="below AVX2 no C++ kernel runs (kernels/resolver.py)")
@pytest.mark.parametrize("vocab", [1000, 49152 + 5])  # a tail past the last whole vector
def test_the_draw_kernel_picks_what_a_float64_inverse_cdf_picks(fresh_seed, vocab):
    """Each row's draw over a grid of uniforms against searchsorted on float64 weights cut by sorting: every
    filter, alone and together, masked tokens, a flat row (the radix select's deepest levels), ties."""
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(8, vocab, generator=gen) * 3
    x[1, torch.randint(0, vocab, (vocab // 2,), generator=gen)] = float("-inf")  # masked tokens: never drawn
    x[2, :vocab - 3] = float("-inf")  # three tokens left
    x[6, :5] = x[6].max() + 1  # five tokens tie for the top: top-k 3 keeps all five
    inv_t = (torch.rand(8, generator=gen) * 2 + 0.25).tolist()
    inv_t[3] = 0.02  # flat: weights in [0.67, 1], thousands in each of the radix select's first bins
    top_k = [-1, 50, -1, -1, -1, 200, 3, 7]
    rank = torch.randint(21, 60, (1,), generator=gen).item()
    top_p = [1.0, 1.0, _midway_top_p(x[2], inv_t[2], -1, 1), _midway_top_p(x[3], inv_t[3], -1, vocab // 3),
             1.0, _midway_top_p(x[5], inv_t[5], 200, rank), 1.0, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.05, 0.01, 0.0, 0.0]
    print("seed", fresh_seed, "top-p rank", rank)
    weights = _reference_weights(x, inv_t, top_k, top_p, min_p)
    assert (weights[6] > 0).sum() == 5 and (weights[7] > 0).sum() == 7
    cdf = weights.cumsum(-1)
    # the kernel's total sums each vector lane then the lanes, its running sum adds one block of lanes at a time: each
    # is float32 over about vocab / lanes + lanes terms, so the two can part by twice that many roundings of the total
    # (AVX2's 8 lanes over 49,157 tokens parted by 1.0e-5 of it on one seed); at least 1e-5
    lanes = 16 if isa.at_least("avx512") else 8
    slack = max(1e-5, 2 * (vocab / lanes + lanes) * 2.0 ** -24)
    for u in torch.linspace(0, 1 - 2**-24, 257).tolist():
        ids, invalid = _kernel()(x, torch.tensor(inv_t), torch.full((8,), u), torch.tensor(top_k),
                                 torch.tensor(top_p), torch.tensor(min_p))
        assert not invalid.any()
        target = u * cdf[:, -1:]
        want = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=vocab - 1)
        for i in range(8):
            k, w = ids[i].item(), want[i].item()
            assert weights[i, k] > 0, f"row {i} drew token {k}, which its filters cut (u={u})"
            if k != w:  # only within float32 rounding of the boundary between the two tokens
                edge = cdf[i, min(k, w)].item()
                assert abs(edge - target[i].item()) < slack * cdf[i, -1].item(), (i, u, k, w)
    # a column-major copy of the same logits (not unit stride along the vocabulary) draws the same tokens
    u = torch.rand(8, generator=gen)
    args = (torch.tensor(inv_t), u, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    assert torch.equal(_kernel()(x.t().contiguous().t(), *args)[0], _kernel()(x, *args)[0])
    # rows with no distribution are flagged: a NaN, no finite logit, a +inf logit, a temperature of zero's scale
    bad = torch.randn(4, vocab, generator=gen)
    bad[0, 7], bad[1], bad[2, 3] = float("nan"), float("-inf"), float("inf")
    _, invalid = _kernel()(bad, torch.tensor([1.0, 1.0, 1.0, float("inf")]), torch.rand(4, generator=gen),
                           torch.tensor([-1, 5, -1, -1]), torch.tensor([1.0, 0.9, 1.0, 1.0]), torch.zeros(4))
    assert invalid.tolist() == [True, True, True, True]
