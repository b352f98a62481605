"""One request's state as the engine sees it: its tokens, its KV blocks, how far it got."""

from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count

import torch

from .sampling_params import SamplingParams
from .speculative import SpecState

_ids = count()


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 priority: int = 0, tenant: str = ""):
        self.seq_id = next(_ids)
        self.priority = priority  # lower runs first (as vLLM's priority scheduling)
        self.tenant = tenant  # whose share of the engine it draws on (the API key's tenant; "" when none)
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.num_slid_blocks = 0  # leading blocks a sliding window gave back (block_manager.GIVEN_BACK)
        self.in_flight_hashes: list[bytes] = []  # prefix-cache keys of prompt blocks it is computing (others may wait)
        self.finish_reason: str | None = None
        self.output_logprobs: list[dict] = []
        self.prompt_logprobs: list[dict | None] = [None] if params.prompt_logprobs is not None else []
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.constraint = None  # structured.Constraint, made by the engine when params.structured is set
        self.spec = SpecState()  # speculative decoding: the pending draft and its acceptance so far
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def drop_draft(self, keep: int = 0) -> None:
        """Takes back the pending draft's tokens past its first ``keep`` (they were never verified)."""
        extra = len(self.spec.draft) - keep
        if extra > 0:
            del self.token_ids[len(self.token_ids) - extra:]
            self.spec.draft = self.spec.draft[:keep]

    def runs_as_decode(self, n: int) -> bool:
        """Whether this step's ``n`` tokens run as decode rows, each over the context up to its own position:
        one token after computed context (a generated token, or a one-token prompt tail after a prefix-cache
        hit), or a decode and its pending draft. The one definition the runner (which kernels run) and the
        step record (what a step did) share; a windowed model or a quantized KV cache runs every row so."""
        start = self.num_computed_tokens
        return start > 0 and (n == 1 or (n == 1 + len(self.spec.draft) and start + n == len(self.token_ids)))

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
