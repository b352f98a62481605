"""What a request asks of generation, checked up front so bad values fail with a clear error.

The bounds are defined here once. ``SamplingParams.validate`` holds every request to them (the
engine checks again when a request is added, with the vocabulary size), and the HTTP server's
request parsing and its OpenAPI schema (``serving/protocol.py``) are built from the same objects,
so the three cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .structured import StructuredOutput

INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Range:
    """An allowed numeric range: [lo, hi], or (lo, hi] with ``lo_open``. Only finite numbers fit."""
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False

    def __contains__(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        if isinstance(v, float) and not math.isfinite(v):  # an int of any size compares exactly with the bounds
            return False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def __str__(self) -> str:
        def num(x):
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(x)

        kind = "an integer" if self.integer else "a number"
        return f"{kind} in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}]"

    def json_schema(self) -> dict:
        """The same range as JSON Schema (the server's OpenAPI document)."""
        return {"type": "integer" if self.integer else "number",
                "exclusiveMinimum" if self.lo_open else "minimum": self.lo, "maximum": self.hi}


# ranges the sampler computes correctly, in float32, whatever else is in the batch
TEMPERATURE = Range(0.0, 100.0)  # below GREEDY_BELOW runs greedy: logits / tiny would overflow
GREEDY_BELOW = 1e-5
TOP_P = Range(0.0, 1.0, lo_open=True)
MIN_P = Range(0.0, 1.0)
REPETITION_PENALTY = Range(0.01, 10.0)  # 1 is off
PRESENCE_PENALTY = Range(-2.0, 2.0)
FREQUENCY_PENALTY = Range(-2.0, 2.0)
# integers the engine represents: top_k is -1 (off) or 1..vocab; a seed is what torch.Generator takes
TOP_K = Range(-1, INT32_MAX, integer=True)
SEED = Range(-(1 << 63), (1 << 64) - 1, integer=True)
MAX_TOKENS = Range(1, INT32_MAX, integer=True)
LOGPROBS = Range(0, 20, integer=True)
TOKEN_ID = Range(0, INT32_MAX, integer=True)  # below the vocabulary size where it is known
# stop conditions: each is checked against the text on every token, so their size is bounded
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_STOP_TOKEN_IDS = 64
LOGIT_BIAS = Range(-100.0, 100.0)  # OpenAI's bound: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias

FLOAT_BOUNDS = {"temperature": TEMPERATURE, "top_p": TOP_P, "min_p": MIN_P, "repetition_penalty": REPETITION_PENALTY,
                "presence_penalty": PRESENCE_PENALTY, "frequency_penalty": FREQUENCY_PENALTY}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (anything below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (HF semantics)
    presence_penalty: float = 0.0  # OpenAI semantics: on tokens already generated
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each generated token (0: the chosen token's only)
    prompt_logprobs: int | None = None  # the same for each prompt token (disables prefix-cache hits)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    structured: StructuredOutput | None = None  # a schema, regex, choice or grammar the output must match
    speculative: bool = True  # False: never draft for this request (where the engine speculates)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Builds from user data; an unknown name is an error, not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether repetition, presence or frequency penalties move the logits (they depend on the output so far)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def argmax_decides(self) -> bool:
        """Greedy with no penalty to move the argmax: the raw (biased, masked) logits' argmax is the token."""
        return self.greedy and not self.penalized

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first field out of its range. With ``vocab_size`` (the engine
        passes it when a request is added) token ids and top_k are held below it too."""
        def bad(name, why):
            raise ValueError(f"{name}={_short(getattr(self, name))}: {why}")

        def check(name, rng: Range, extra=""):
            if getattr(self, name) not in rng:
                bad(name, f"must be {rng}{extra}")

        check("max_tokens", MAX_TOKENS)
        for name, rng in FLOAT_BOUNDS.items():
            check(name, rng, {"temperature": " (0 is greedy)", "repetition_penalty": " (1 is off)"}.get(name, ""))
        top_k_max = vocab_size or TOP_K.hi
        if self.top_k not in TOP_K or self.top_k == 0 or self.top_k > top_k_max:
            bad("top_k", f"must be -1 (off) or an integer in [1, {top_k_max}]"
                         + (" (the vocabulary size)" if vocab_size else ""))
        if self.seed is not None:
            check("seed", SEED, " (what torch.Generator takes)")
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LENGTH for s in self.stop):
            bad("stop", f"must be non-empty strings of at most {MAX_STOP_LENGTH} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        id_max = vocab_size - 1 if vocab_size else TOKEN_ID.hi
        if any(t not in TOKEN_ID or t > id_max for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {id_max}]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check(name, LOGPROBS)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"must be a map of at most {MAX_LOGIT_BIAS} token ids to numbers")
            if any(t not in TOKEN_ID or t > id_max for t in self.logit_bias):
                bad("logit_bias", f"keys must be token ids in [0, {id_max}]")
            if any(b not in LOGIT_BIAS for b in self.logit_bias.values()):
                bad("logit_bias", f"values must be {LOGIT_BIAS}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(t not in TOKEN_ID or t > id_max for t in self.allowed_token_ids):
                bad("allowed_token_ids", f"must be token ids in [0, {id_max}]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput")


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
