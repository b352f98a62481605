"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step, running sequences go first, oldest first (a decode costs one token of the budget;
an unfinished prompt takes what is left), then waiting ones join in arrival order while the
token budget, the sequence cap and free blocks allow, and while the step's prompt tokens are
under ``prefill_batch_tokens``: a burst of long prompts is prefilled one after another, so the
first user gets a first token after one prompt's compute rather than all of them (the last one
waits as long either way), while short prompts still share a step (a step streams the weights
once, whatever its rows). One whose prompt starts with blocks
another prompt is computing right now waits for them to land in the prefix cache rather than
compute them twice (a burst of requests sharing a system prompt prefills it once). A long prompt
is cut into chunks that
share steps with running decodes instead of stalling them. When blocks run out, the newest
running sequence is preempted: its blocks are freed and it is recomputed later, losing nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens of each sequence computed this step
    preempted: list[Sequence]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefill_batch_tokens: int = 0):
        """``prefill_batch_tokens``: waiting prompts stop joining a step once its prompt tokens reach
        this many (the first always joins); 0: only the token budget limits them."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if prefill_batch_tokens < 0:
            raise ValueError("prefill_batch_tokens must be >= 0 (0: no limit beyond the token budget)")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_batch_tokens = prefill_batch_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = Status.FINISHED

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.drop_draft()
        self.bm.free_sequence(seq)
        seq.status = Status.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        prompt_tokens = 0  # tokens of the step that are not one decode each

        # running sequences first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens and seq.spec.draft:  # a draft that does not fit is dropped
                seq.drop_draft(max(0, n - 1))
                n = seq.num_uncomputed_tokens
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            self.bm.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            prompt_tokens += n if n > 1 else 0
            i += 1

        # then waiting sequences, in arrival order (preempted ones were put back at the front)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            if self.prefill_batch_tokens and prompt_tokens >= self.prefill_batch_tokens:
                break
            seq = self.waiting[0]
            if not seq.block_table and self.bm.match_prefix(seq) is None:
                deferred.append(self.waiting.popleft())  # its prefix lands in the cache within steps
                continue
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill and seqs:
                    break  # without chunking a prompt waits for a step with room for all of it
                n = budget if self.enable_chunked_prefill else n
            if not self.bm.can_allocate(seq, n):
                if not self.running and not seqs:
                    # nothing will ever free blocks for it: fail loudly rather than hang
                    self.bm.free_sequence(seq)
                    raise RuntimeError(f"KV cache too small for a request of {len(seq)} tokens; "
                                       f"raise --kv-cache-memory")
                self.bm.free_sequence(seq)  # give back prefix blocks; it is matched again next step
                seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            self.bm.allocate(seq, n)
            self.bm.mark_in_flight(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            prompt_tokens += n
        self.waiting.extendleft(reversed(deferred))  # keep their place in line
        return ScheduledBatch(seqs, counts, preempted)
