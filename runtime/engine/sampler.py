"""Next-token choice for a whole batch at once, each row with its own parameters.

Order: penalties on the raw logits, then greedy rows take the argmax; the others are scaled by
temperature, cut by top-k, top-p and min-p, and sampled by inverse CDF, which needs one uniform number per
row: a seeded row draws it from its own generator, so its output does not depend on what else
is in the batch.

Rows are independent: a row whose logits are not finite (a kernel or model fault on that
sequence) gets no token and is reported in ``SampleResult.errors``, so only its request fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict] | None  # per row: {"token_id", "logprob", "top": [(id, logprob), ...]} or None
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it has no token (its token_ids entry is junk)


def _column(seqs: list[Sequence], attr: str, default: float) -> torch.Tensor:
    return torch.tensor([getattr(s.params, attr) if getattr(s.params, attr) is not None else default for s in seqs],
                        dtype=torch.float32)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rep = _column(seqs, "repetition_penalty", 1.0)
    pres = _column(seqs, "presence_penalty", 0.0)
    freq = _column(seqs, "frequency_penalty", 0.0)
    if not ((rep != 1.0).any() or (pres != 0.0).any() or (freq != 0.0).any()):
        return logits
    vocab = logits.shape[1]
    out_counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, s in enumerate(seqs):
        out = torch.tensor(s.output_token_ids, dtype=torch.long)
        out = out[out < vocab]
        out_counts[row].index_add_(0, out, torch.ones(len(out)))
        prompt = torch.tensor(s.token_ids[:s.num_prompt_tokens], dtype=torch.long)
        seen[row, prompt[prompt < vocab]] = True
    seen |= out_counts > 0
    r = rep[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks (rows are non-greedy)."""
    temp = _column(seqs, "temperature", 1.0)
    if (temp != 1.0).any():
        logits = logits / temp[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs])
    top_p = _column(seqs, "top_p", 1.0)
    min_p = _column(seqs, "min_p", 0.0)
    if (top_k < vocab).any() or (top_p < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        drop = rank >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """One uniform number per row; a seeded row draws it from its own generator."""
    u = torch.rand(len(seqs))
    for i, s in enumerate(seqs):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator)
    return u


def draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Inverse-CDF sampling: one cumulative sum and one uniform per row, no per-token noise."""
    cdf = probs.cumsum(-1)
    target = _uniforms(seqs)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: [B, vocab] float32, one row per sequence that produces a token this step."""
    raw = logits
    logits = apply_penalties(logits, seqs)
    best, chosen = logits.max(-1)
    broken = ~torch.isfinite(best)  # NaN or infinity somewhere in the row: no token can be trusted
    errors = {i: "the model's logits for this sequence are not finite (NaN or infinity)"
              for i in broken.nonzero().flatten().tolist()}
    greedy = torch.tensor([s.params.greedy for s in seqs]) | broken
    if not greedy.all():
        rows = (~greedy).nonzero().flatten()
        subset = [seqs[i] for i in rows.tolist()]
        probs = filter_logits(logits[rows], subset).softmax(-1)
        chosen[rows] = draw(probs, subset)
        # a row with any NaN (from a parameter the filters cannot use) is NaN throughout after softmax
        for i in rows[~torch.isfinite(probs[:, 0])].tolist():
            errors[i] = "this sequence's sampling parameters gave no valid distribution to sample from"
    token_ids = chosen.tolist()
    want = [s.params.logprobs for s in seqs]
    if all(w is None for w in want):
        return SampleResult(token_ids, None, errors)
    logprobs_all = raw.log_softmax(-1)
    logprobs = [None if w is None or i in errors else token_logprobs(logprobs_all[i], token_ids[i], w)
                for i, w in enumerate(want)]
    return SampleResult(token_ids, logprobs, errors)


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int) -> dict:
    top = logprobs.topk(top_n) if top_n else None
    return {
        "token_id": token_id,
        "logprob": logprobs[token_id].item(),
        "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
    }
