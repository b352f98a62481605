"""What a request asks of generation, checked up front so bad values fail with a clear error."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
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
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 (off) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 is off)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= 20):
                bad(name, "must be an integer in [0, 20]")
