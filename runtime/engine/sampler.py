"""Next-token choice for a whole batch at once, each row with its own parameters.

Order: logit_bias, allowed_token_ids and grammar masks (structured output), penalties, then greedy rows take the argmax; the others are scaled by
temperature, cut by top-k, top-p and min-p, and sampled by inverse CDF, which needs one uniform number per
row: a seeded row draws it from its own generator, so its output does not depend on what else
is in the batch. On the CPU the filters and the draw are the plan's kernel (kernels/sample_rows.py: no sort, no
normalised copy, no cumulative-sum array) where it built, else torch's sort, softmax, cumsum and searchsorted:
the same distribution.

Rows are independent: a row whose logits are not finite (a kernel or model fault on that
sequence) gets no token and is reported in ``SampleResult.errors``, so only its request fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from .sequence import Sequence
from .speculative import accepted_prefix, sampled_prefix
from .structured import apply_masks


class RowError(NamedTuple):
    """Why a row has no token, and whether its request's own parameters did it (nothing they allow is left: the
    client's to fix) rather than the model (non-finite logits)."""
    why: str
    by_request: bool


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict] | None  # per row: {"token_id", "logprob", "top": [(id, logprob), ...]} or None
    errors: dict[int, RowError] = field(default_factory=dict)  # rows with no token (their token_ids entries are junk)


def _values(seqs: list[Sequence], attr: str, default: float) -> list[float]:
    return [getattr(s.params, attr) if getattr(s.params, attr) is not None else default for s in seqs]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def apply_constraints(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logit_bias, allowed_token_ids and each constrained row's grammar mask (tokens it forbids get
    -inf); a copy when any applies, so the raw logits stay for logprobs and a retry."""
    biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
    allowed = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
    constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
    if not (biased or allowed or constrained):
        return logits
    logits = logits.clone()
    device = logits.device
    for i in biased:
        bias = seqs[i].params.logit_bias
        logits[i, torch.tensor(list(bias), device=device)] += torch.tensor(list(bias.values()), device=device)
    for i in allowed:
        banned = torch.ones(logits.shape[1], dtype=torch.bool, device=device)
        banned[torch.tensor(seqs[i].params.allowed_token_ids, device=device)] = False
        logits[i].masked_fill_(banned, float("-inf"))
    if constrained:
        for i in constrained:  # already filled while the forward ran, unless the step took another path
            seqs[i].constraint.fill(len(seqs[i]))
        # a greedy row (no penalties to move its argmax) whose best token the grammar allows needs no mask:
        # it picks that token either way, and a mask over the whole vocabulary costs more than the check
        plain = [i for i in constrained if seqs[i].params.argmax_decides]
        if plain:
            best = row_max(logits[plain])[1].tolist()
            allowed = {i for i, t in zip(plain, best) if seqs[i].constraint.allows(t)}
            constrained = [i for i in constrained if i not in allowed]
        if constrained:
            apply_masks(logits, constrained, [seqs[i].constraint for i in constrained])
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rep, pres, freq = (_values(seqs, a, d) for a, d in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                                         ("frequency_penalty", 0.0)))
    if all(r == 1.0 for r in rep) and not any(pres) and not any(freq):
        return logits
    vocab, device = logits.shape[1], logits.device
    # (row, token) pairs built on the host, then one scatter each on the logits' device
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for row, s in enumerate(seqs):
        out = [t for t in s.output_token_ids if 0 <= t < vocab]
        out_rows += [row] * len(out)
        out_ids += out
        prompt = [t for t in s.token_ids[:s.num_prompt_tokens] if 0 <= t < vocab]
        seen_rows += [row] * len(prompt)
        seen_ids += prompt
    index = lambda rows, ids: (torch.tensor(rows, dtype=torch.long, device=device),  # noqa: E731
                               torch.tensor(ids, dtype=torch.long, device=device))
    out_counts = torch.zeros_like(logits).index_put_(index(out_rows, out_ids),
                                                     torch.ones(len(out_ids), device=device), accumulate=True)
    seen = torch.zeros_like(logits, dtype=torch.bool).index_put_(index(seen_rows, seen_ids),
                                                                torch.ones(len(seen_ids), dtype=torch.bool,
                                                                           device=device))
    seen |= out_counts > 0
    r = _column(rep, device)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - _column(freq, device)[:, None] * out_counts - \
        _column(pres, device)[:, None] * (out_counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks (rows are non-greedy).

    Which filters apply is decided from the parameters on the host, so nothing here waits on the device."""
    device = logits.device
    temp = _values(seqs, "temperature", 1.0)
    if any(t != 1.0 for t in temp):
        logits = logits / _column(temp, device)[:, None]
    vocab = logits.shape[1]
    top_k = [min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs]
    top_p = _values(seqs, "top_p", 1.0)
    min_p = _values(seqs, "min_p", 0.0)
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= torch.tensor(top_k, device=device)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (probs.cumsum(-1) - probs) >= _column(top_p, device)[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < _column(min_p, device)[:, None] * probs.max(-1, keepdim=True).values,
                                    float("-inf"))
    return logits


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """One uniform number per row, drawn on the CPU; a seeded row draws it from its own generator
    (a CPU generator: a seed gives the same numbers whatever the device; the tokens can differ between the CPU's
    kernel and torch's route only where a draw falls within float32 rounding of a boundary)."""
    u = torch.rand(len(seqs))
    for i, s in enumerate(seqs):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator)
    return u


def draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Inverse-CDF sampling: one cumulative sum and one uniform per row, no per-token noise."""
    cdf = probs.cumsum(-1)
    target = _uniforms(seqs).to(probs.device, non_blocking=True)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def kernel_params(seqs: list[Sequence], vocab: int) -> tuple[torch.Tensor, ...]:
    """Each row's parameters as the draw kernel takes them (kernels/csrc/sample_rows.h), CPU tensors: 1 / temperature
    (0 for a greedy row: a decode burst takes its argmax), top-k (clamped to the vocabulary: at or above it, off),
    top-p and min-p (None: off)."""
    inv_temperature = [0.0 if s.params.greedy else 1.0 / t for s, t in zip(seqs, _values(seqs, "temperature", 1.0))]
    return (torch.tensor(inv_temperature, dtype=torch.float32),
            torch.tensor([min(s.params.top_k, vocab) for s in seqs], dtype=torch.long),
            _column(_values(seqs, "top_p", 1.0), torch.device("cpu")),
            _column(_values(seqs, "min_p", 0.0), torch.device("cpu")))


def _draw_on_kernel(draw_kernel: Callable, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
    """``draw``'s choice made by the C++ kernel from the raw logits and each row's temperature, top-k, top-p and
    min-p (it cuts them as filter_logits does, without a sort or a copy), and which rows had no distribution."""
    inv_temperature, top_k, top_p, min_p = kernel_params(seqs, logits.shape[1])
    return draw_kernel(logits, inv_temperature, _uniforms(seqs), top_k, top_p, min_p)


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value and the index of its first occurrence (a NaN counts as the largest), as
    ``logits.max(-1)``. On the CPU through numpy's argmax: a 49,152-token row in ~4 us and 16 rows in ~53, where
    torch's max over the last dimension took ~44 us and ~1 ms (torch 2.13, Zen 5), every step."""
    if not _numpy_route(logits):
        return logits.max(-1)
    best, chosen = _host_row_max(logits.numpy())
    return torch.from_numpy(best), torch.from_numpy(chosen)


def _numpy_route(logits: torch.Tensor) -> bool:
    """Whether the logits are read through numpy (float32 on the CPU) rather than by torch ops."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def _host_row_max(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """row_max on a [B, vocab] array: each row's first largest value (NaN the largest) and its index."""
    chosen = values.argmax(-1)
    return values[np.arange(values.shape[0]), chosen], chosen


def _greedy_on_host(raw: torch.Tensor, logits: torch.Tensor, constrained: bool) -> tuple[list, list, list]:
    """``sample``'s token ids and broken / invalid flags when every row is greedy and the logits are float32 on the
    CPU: the same choices (numpy's argmax, as row_max) computed in numpy on the logits' own memory. The general
    path's seven small torch ops (a gather, comparisons, a stack, ...) took ~0.3 ms of a batch-1 step on a Zen 5,
    their code and data just pushed out of the caches by the step's stream of weights."""
    best, chosen = _host_row_max(logits.numpy())
    broken = ~np.isfinite(_host_row_max(raw.numpy())[0] if constrained else best)
    invalid = (best == -np.inf) & ~broken if constrained else np.zeros_like(broken)
    return chosen.tolist(), broken.tolist(), invalid.tolist()


def sample(logits: torch.Tensor, seqs: list[Sequence], draw_kernel: Callable | None = None) -> SampleResult:
    """logits: [B, vocab] float32, one row per sequence that produces a token this step, on any device.
    ``draw_kernel``: the plan's (kernels/sample_rows.py's ``draw_rows``), or None: torch's ops draw.

    Everything runs on the logits' device; the chosen ids and the per-row fault flags come back to the
    host in one copy (logprobs, when asked for, read more)."""
    raw = logits
    logits = apply_constraints(logits, seqs)
    constrained = logits is not raw
    logits = apply_penalties(logits, seqs)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not sampled and _numpy_route(logits):
        token_ids, broken_rows, invalid_rows = _greedy_on_host(raw, logits, constrained)
    else:
        best, chosen = row_max(logits)
        # NaN or infinity somewhere in the row: no token can be trusted
        broken = ~torch.isfinite(row_max(raw)[0] if constrained else best)
        # no valid distribution after the filters (or the masks left no token at all)
        invalid = (best == float("-inf")) & ~broken if constrained else torch.zeros_like(broken)
        if sampled:
            # every row sampled (a server's default temperature): a slice, a view of the logits, not a copy of them
            whole = len(sampled) == len(seqs)
            rows = slice(None) if whole else torch.tensor(sampled, device=logits.device)
            subset = seqs if whole else [seqs[i] for i in sampled]
            if draw_kernel is not None and _numpy_route(logits):
                chosen[rows], no_distribution = _draw_on_kernel(draw_kernel, logits[rows], subset)
                invalid[rows] |= no_distribution
            else:
                probs = filter_logits(logits[rows], subset).softmax(-1)
                chosen[rows] = draw(probs, subset)
                # a row with any NaN (from a parameter the filters cannot use) is NaN throughout after softmax
                invalid[rows] |= ~torch.isfinite(probs[:, 0])
        token_ids, broken_rows, invalid_rows = torch.stack([chosen, broken.long(), invalid.long()]).tolist()
    errors = {}
    for i in range(len(seqs)):
        if broken_rows[i]:
            errors[i] = RowError("the model's logits for this sequence are not finite (NaN or infinity)", False)
        elif invalid_rows[i]:
            errors[i] = RowError("this sequence's sampling parameters (logit_bias, allowed_token_ids, its grammar or "
                                 "the filters) left no token to choose: loosen them so they allow at least one token "
                                 "at every step", True)
    want = [s.params.logprobs for s in seqs]
    if all(w is None for w in want):
        return SampleResult(token_ids, None, errors)
    logprobs_all = raw.log_softmax(-1)
    logprobs = [None if w is None or i in errors else token_logprobs(logprobs_all[i], token_ids[i], w)
                for i, w in enumerate(want)]
    return SampleResult(token_ids, logprobs, errors)


def verify_draft(logits: torch.Tensor, seq: Sequence) -> list[int]:
    """The tokens a sequence emits from its draft's rows (``logits`` [1 + len(draft), vocab]): greedy
    acceptance for a greedy request, speculative sampling for a sampled one (runtime/engine/speculative.py;
    a drafting request has no penalties, bias or grammar, so only the filters apply)."""
    draft = seq.spec.draft
    if seq.params.greedy:
        return accepted_prefix(draft, row_max(logits)[1].tolist())
    probs = filter_logits(logits, [seq] * logits.shape[0]).softmax(-1)
    return sampled_prefix(draft, probs, lambda: _uniforms([seq]).item())


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int) -> dict:
    top = logprobs.topk(top_n) if top_n else None
    return {
        "token_id": token_id,
        "logprob": logprobs[token_id].item(),
        "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
    }
