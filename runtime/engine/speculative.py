"""Speculative decoding with n-gram prompt lookup: drafts from the sequence's own tokens, verified in
one forward pass over the paged cache.

Drafting: the last ``n`` tokens (``ngram_max`` down to ``ngram_min``) are looked up in the prompt and
output so far; the tokens that followed their most recent earlier occurrence are the draft. No
model runs: input-grounded answers (quoting, extracting, editing the prompt's text) repeat long runs
of it, open chat rarely does, and then nothing is drafted and the step is a plain decode.

Verification: the draft tokens are appended to the sequence and computed in the same step as its
last token, as a chunk over its cache; the logits of every one of those rows come back. Greedy
acceptance keeps the target's output exactly: draft tokens are accepted while each equals the
target's argmax at its position, and the target's own token at the first mismatch (or after the
last draft token) is emitted too, so a step emits 1 to k+1 tokens. Rejected tokens' KV slots are
simply overwritten later; their blocks past the sequence's end are given back, and the prefix cache
only ever hashes verified tokens.

The rule (``eligible``, ``SpecState``): a sequence drafts when it decodes greedily without
penalties, grammar, logprobs or a per-request opt-out; when the step has at most ``max_batch``
running sequences (past that, verifying costs more than a draft saves); and while its acceptance
holds up: from ``probe_tokens`` drafted tokens on, with fewer than ``min_acceptance`` of them
accepted it stops drafting for good. Sampled requests (temperature > 0) do not draft yet.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

METHODS = ("off", "ngram")


@dataclass
class SpeculativeConfig:
    method: str = "off"  # off | ngram
    num_tokens: int = 4  # draft tokens per step (k): a step emits up to k + 1
    ngram_max: int = 4
    ngram_min: int = 2
    max_batch: int = 4  # no drafting in a step with more running sequences than this
    probe_tokens: int = 12  # drafted tokens before a sequence's acceptance is judged
    # break-even: a step verifying k drafts costs about 1 + c*k decode steps and emits 1 + accepted
    # tokens, so drafting pays while the accepted share exceeds c; c measured 0.4 on an AVX2 host
    # (docs/benchmarks/2026-12-03-epyc-zen3-avx2.md), so 0.5 keeps a margin
    min_acceptance: float = 0.5

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_tokens}: must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes [{self.ngram_min}, {self.ngram_max}]: need 1 <= min <= max")


@dataclass
class SpecState:
    """One sequence's drafting: its pending draft and how well its drafts have done."""
    draft: list[int] = field(default_factory=list)  # unverified tokens at the end of token_ids
    drafted: int = 0
    accepted: int = 0
    off: bool = False


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    if len(tokens) <= n_min:
        return []
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
                draft = tokens[start:start + k]
                if draft:
                    return draft
                break
            end = at + len(pattern) - 1
    return []


def eligible(seq) -> bool:
    """Whether a sequence (engine/sequence.py, which holds a SpecState: so not imported here) may draft."""
    p = seq.params
    return (p.argmax_decides and seq.constraint is None and p.logprobs is None and p.prompt_logprobs is None
            and not p.logit_bias and p.allowed_token_ids is None and p.speculative)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def draft(self, seq, room: int) -> list[int]:
        """Appends a draft of at most ``room`` tokens to a decoding sequence; returns it."""
        c, state = self.config, seq.spec
        if state.off or room < 1:
            return []
        if state.drafted >= c.probe_tokens and state.accepted < c.min_acceptance * state.drafted:
            state.off = True
            return []
        draft = propose_ngram(seq.token_ids, min(c.num_tokens, room), c.ngram_max, c.ngram_min)
        if draft:
            state.draft = draft
            seq.token_ids.extend(draft)
        return draft


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
