"""Speculative decoding with n-gram prompt lookup: drafts from the sequence's own tokens, verified in
one forward pass over the paged cache.

Drafting: the last ``n`` tokens (``ngram_max`` down to ``ngram_min``) are looked up in the prompt and
output so far; the tokens that followed their most recent earlier occurrence are the draft. No
model runs: input-grounded answers (quoting, extracting, editing the prompt's text) repeat long runs
of it, open chat rarely does, and where nothing matches the step is a plain decode. A match of 4 tokens
is right more often than a match of 2, so acceptance is kept per match length (below). Down to 1 token
(``ngram_min=1``) drafts more often but, on the grounded set, gained less than it cost (1.54x against
1.73x off, the same rounds).

Verification: the draft tokens are appended to the sequence and computed in the same step as its
last token, as a chunk over its cache; the logits of every one of those rows come back. A step
emits 1 to k+1 tokens (the sampler's ``verify_draft`` chooses them):
- greedy requests keep the target's output exactly (``accepted_prefix``): draft tokens are accepted
  while each equals the target's argmax at its position, and the target's own token at the first
  mismatch (or after the last draft token) is emitted too;
- sampled requests keep the target's distribution exactly (``sampled_prefix``, speculative sampling
  as in Leviathan et al. 2023 and Chen et al. 2023, with a draft that puts all its mass on one token
  per position): each draft token is accepted with the target's probability of it (after
  temperature, top-k, top-p, min-p); at the first rejection a token is drawn from the target's
  distribution without the rejected token, renormalized; after a fully accepted draft, one more from
  the last row. The uniforms come from the request's own generator when it is seeded, so a seeded
  request is reproducible with speculation on (its tokens differ from speculation off, as any other
  use of the random stream would make them; its distribution does not).
Rejected tokens' KV slots are simply overwritten later; their blocks past the sequence's end are
given back, and the prefix cache only ever hashes verified tokens.

The rule (``eligible``, ``SpecState``): a sequence drafts when it decodes without penalties,
grammar, logit_bias, logprobs or a per-request opt-out; when at most ``max_batch`` sequences are running
or waiting (past that, verifying costs more than a draft saves, and requests in line are work that verify
rows would only delay: under vLLM's client with 32 requests at once, drafting while running sequences were
few but others waited cost 0.78x the output tok/s); and while its drafts pay: from ``probe_tokens`` drafted
tokens on, with an accepted share below the verify cost c (the break-even, below) it stops drafting for good.

How many tokens it drafts (``draft_length``): with ``adaptive`` (the default), the k of at most
``num_tokens`` that maximizes the tokens a verifying step is expected to emit per unit of its cost.
Each draft token is taken as accepted with probability a, independently, so a k-token draft emits
(1 - a^(k+1)) / (1 - a) tokens on average, and a step verifying k tokens costs 1 + c k decode steps.
a is the sequence's own for drafts from matches of this one's length (``SpecState.sources``: an n-gram's n, the
draft model one source): accepted / (accepted + rejections) over those verified drafts (a rejection ends a
draft; tokens after it were never judged), with two tokens at the sequence's pooled share as the prior (the
pooled share: all its drafts, with one accepted and one rejected token as its prior), so a short answer
learns from all its drafts and a long one tells its sources apart. Without
``adaptive``, k = ``num_tokens``. A draft of k tokens emits 1 + accepted tokens for 1 + c k, so drafting
pays while the accepted share exceeds c.

c is a verify row's cost relative to a whole one-row decode step, and it depends on the host: where the
linears are bound by memory (bfloat16 on AVX-512 BF16) an extra row costs a few percent of a step (c 0.04
on Zen 5), where they are bound by arithmetic (bfloat16 emulated on AVX2) 0.4. ``VerifyCost`` measures
it from the engine's own decode-only steps (the slope of a step's time against its rows, over a one-row
step's time), starting from ``PRIOR_VERIFY_COST`` until it has timed steps of two sizes; ``verify_cost``
set to a number fixes it instead.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

import torch

METHODS = ("off", "ngram", "draft")  # draft: a draft artifact's greedy tokens (runtime/engine/draft_model.py)
MAX_NUM_TOKENS = 16  # the most draft tokens a step may verify
PRIOR_VERIFY_COST = 0.4  # c before the engine has measured it: the highest measured (bfloat16 emulated on AVX2)


@dataclass
class SpeculativeConfig:
    method: str = "off"  # off | ngram | draft
    num_tokens: int = 8  # the most draft tokens a step verifies (k): a step emits up to k + 1
    ngram_max: int = 4
    ngram_min: int = 2
    max_batch: int = 4  # no drafting while more sequences than this are running or waiting
    probe_tokens: int = 12  # drafted tokens before a sequence's acceptance is judged against c
    adaptive: bool = True  # k per step from the sequence's acceptance (draft_length); False: always num_tokens
    verify_cost: float | None = None  # c: None measures it (VerifyCost); a number in (0, 1] fixes it

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"num_speculative_tokens={self.num_tokens}: must be in [1, {MAX_NUM_TOKENS}]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes [{self.ngram_min}, {self.ngram_max}]: need 1 <= min <= max")
        if self.verify_cost is not None and not 0 < self.verify_cost <= 1:
            raise ValueError(f"speculative verify_cost={self.verify_cost}: a verify row's cost in decode steps, "
                             f"in (0, 1]")


@dataclass
class SpecState:
    """One sequence's drafting: its pending draft and how well its drafts have done."""
    draft: list[int] = field(default_factory=list)  # unverified tokens at the end of token_ids
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verified drafts that ended in a rejected token
    off: bool = False
    source: int = 0  # where the pending draft came from: the n of its n-gram match (0: a draft model)
    sources: dict[int, list[int]] = field(default_factory=dict)  # source -> [accepted, rejected], as above

    def record(self, drafted: int, accepted: int) -> None:
        """The pending draft's verdict: ``accepted`` of its ``drafted`` tokens kept (the rest rejected)."""
        rejected = int(accepted < drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += rejected
        counts = self.sources.setdefault(self.source, [0, 0])
        counts[0] += accepted
        counts[1] += rejected


class VerifyCost:
    """c, a verify row's cost in one-row decode steps, from the engine's own decode-only steps (``observe``):
    each step's time is averaged by its rows (a moving average, so it follows the host), and c is the slope of
    a least-squares line through those averages over the line's one-row time. Until steps of two sizes have
    been timed ``settle`` times each it is the prior; a ``fixed`` value is never measured."""

    def __init__(self, fixed: float | None = None, settle: int = 4, weight: float = 0.1):
        self.fixed, self.settle, self.weight = fixed, settle, weight
        self.times: dict[int, list] = {}  # rows -> [average seconds, steps seen]
        self.value = fixed if fixed is not None else PRIOR_VERIFY_COST
        self.one_row: float | None = None  # a one-row step's seconds (a draft model's cost is weighed against it)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows (decodes and verify rows) took ``seconds``."""
        if not 1 <= rows <= 1 + MAX_NUM_TOKENS * 4 or seconds <= 0:
            return
        t = self.times.setdefault(rows, [seconds, 0])
        t[1] += 1
        t[0] += (seconds - t[0]) * max(self.weight, 1 / t[1])
        if rows == 1:
            self.one_row = t[0]
        points = [(r, avg) for r, (avg, n) in self.times.items() if n >= self.settle]
        if len(points) < 2:
            return
        mr = sum(r for r, _ in points) / len(points)
        mt = sum(t for _, t in points) / len(points)
        slope = sum((r - mr) * (t - mt) for r, t in points) / sum((r - mr) ** 2 for r, _ in points)
        one_row = mt + slope * (1 - mr)
        if one_row > 0:
            self.one_row = one_row
            if self.fixed is None:
                self.value = min(1.0, max(0.01, slope / one_row))


def draft_length(state: SpecState, config: SpeculativeConfig, cost: float, source: int = 0) -> int:
    """The number of tokens to draft this step (the module docstring's rule; 0 where no k pays, once probed),
    c = ``cost``, the draft to come from ``source``."""
    if not config.adaptive:
        return config.num_tokens
    pooled = (state.accepted + 1) / (state.accepted + state.rejected + 2)
    accepted, rejected = state.sources.get(source, (0, 0))
    a = (accepted + 2 * pooled) / (accepted + rejected + 2)
    best_k, best = 0, 1.0  # 0: a plain decode, one token for one step's cost, pays best
    for k in range(1, config.num_tokens + 1):
        emitted = sum(a ** i for i in range(k + 1))
        value = emitted / (1 + cost * k)
        if value > best:
            best_k, best = k, value
    if best_k == 0 and state.drafted < config.probe_tokens:
        return 1  # still probing: the prior alone does not rule drafting out
    return best_k


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    start, _ = match_ngram(tokens, n_max, n_min)
    return tokens[start:start + k] if start >= 0 else []


def match_ngram(tokens: list[int], n_max: int, n_min: int) -> tuple[int, int]:
    """(where the continuation starts, n) of the most recent earlier occurrence of the longest suffix n-gram
    (``n_max`` down to ``n_min``) that has a continuation; (-1, 0) where none has."""
    if len(tokens) <= n_min:
        return -1, 0
    data = array("i", tokens).tobytes()
    width = array("i").itemsize
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = data[-n * width:]
        end = len(data) - width  # an occurrence must end before the sequence's own last token
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:  # aligned to a token
                start = at // width + n
                if start < len(tokens):
                    return start, n
                break
            end = at + len(pattern) - 1
    return -1, 0


def eligible(seq) -> bool:
    """Whether a sequence (engine/sequence.py, which holds a SpecState: so not imported here) may draft."""
    p = seq.params
    return (not p.penalized and seq.constraint is None and p.logprobs is None and p.prompt_logprobs is None
            and not p.logit_bias and p.allowed_token_ids is None and p.speculative)


def draft_budget(state: SpecState, config: SpeculativeConfig, cost: float, room: int, source: int = 0) -> int:
    """How many tokens a sequence drafts this step from ``source`` (0: none), by the rule above with c = ``cost``:
    none once its accepted share has been judged under c (which turns it off for good), else ``draft_length``,
    at most ``room``."""
    if state.off or room < 1:
        return 0
    if state.drafted >= config.probe_tokens and state.accepted < cost * state.drafted:
        state.off = True
        return 0
    return min(draft_length(state, config, cost, source), room)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.cost = VerifyCost(config.verify_cost)  # the engine times its steps into it

    def keep_only(self, running) -> None:
        """Nothing to give back: n-gram drafts keep no state beyond the sequence's own."""

    def draft_many(self, wanted: list) -> None:
        """Drafts for each (sequence, room) of ``wanted`` (``draft``, one after another)."""
        for seq, room in wanted:
            self.draft(seq, room)

    def draft(self, seq, room: int) -> list[int]:
        """Appends a draft of at most ``room`` tokens to a decoding sequence; returns it."""
        c, state, tokens = self.config, seq.spec, seq.token_ids
        if state.off:
            return []
        start, n = match_ngram(tokens, c.ngram_max, c.ngram_min)
        k = draft_budget(state, c, self.cost.value, room, source=n) if start >= 0 else 0
        if k < 1:
            return []
        state.draft, state.source = tokens[start:start + k], n
        tokens.extend(state.draft)
        return state.draft


def accepted_prefix(draft: list[int], target: list[int]) -> list[int]:
    """Greedy acceptance: the draft's leading tokens that match the target's choices, then the target's
    own token at the first mismatch (``target`` has one more entry than ``draft``)."""
    out = []
    for d, t in zip(draft, target):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def sampled_prefix(draft: list[int], probs: torch.Tensor, uniform: Callable[[], float]) -> list[int]:
    """Speculative sampling of a one-token-per-position draft: ``probs`` [len(draft) + 1, vocab] is the
    target's filtered distribution at each row, ``uniform()`` one U[0, 1) number. Each draft token d is
    accepted with probability p(d) (the draft's own probability of d is 1, so min(1, p/q) = p(d)); at the
    first rejection the token comes from max(0, p - q) renormalized, which is p without d."""
    out = []
    for row, d in enumerate(draft):
        p = probs[row]
        if uniform() < p[d].item():
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(inverse_cdf(residual, uniform()))
        return out
    out.append(inverse_cdf(probs[len(draft)], uniform()))
    return out


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The token whose cumulative weight first exceeds u times the total (weights need not sum to 1)."""
    cdf = weights.double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=cdf.dtype), right=True)
               .clamp_(max=weights.numel() - 1))
