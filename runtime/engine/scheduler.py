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
It comes back once the free blocks hold all of it beside all that the running sequences may still
grow to (their ``max_tokens``): let back in at the first free blocks, a victim was preempted again
as the others grew, its prompt recomputed each time (32 long prompts in a cache of 18 of their
prompts: 39 preemptions where 2 do).

Tenancy (``Fairness``, from ``infer-run --tenants``): a request's ``priority`` (lower first, as vLLM
takes it) orders the waiting line before anything else, then fair share between tenants: each
tenant's served tokens (prompt and output, divided by its weight) are counted, and the waiting
request of the tenant served least joins first (the virtual token counter of Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024); a tenant arriving after idling starts level with the
least-served active one, so idle time banks no credit, and one arriving at an idle engine starts level
with the most served, so tokens served while the others were idle are no debt. A tenant's
``max_running`` caps its running sequences. The preemption victim is the worst priority, newest first. Fair share only works when a
step cannot be filled by one tenant's long prompt: ``prompt_tokens_per_step`` caps the prompt
tokens a step computes (running chunks included), so one tenant's 1,024-token prompts are cut into
chunks and another's decodes and short prompts run beside them every step. ``decode_slowdown_max``
bounds what that costs the decodes: while a tenant served less than a prompt's tenant is decoding, that
prompt's chunks are cut to what keeps the step within that many times a decode-only step, by the costs
the engine measured (``StepCost``, learned from the steps it ran), so another tenant's flood of long
prompts raises a decoding user's time per output token at most that much, while the user's own prompts
are not cut. Fair share decides who
starts: a running prompt of a tenant served at least as much as a waiting request's tenant yields
the step's prompt budget to it. Once started, the running prompt with the fewest tokens left gets
the budget first (shortest remaining first), so a short prompt let in during another tenant's flood
reaches its first token in as many steps as it would alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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


MIN_PROMPT_CHUNK = 4  # prompt tokens a step still computes under decode_slowdown_max: prompts always advance


@dataclass
class StepCost:
    """What a step costs, learned from the steps the engine ran (moving averages): a decode-only step's
    seconds, and the seconds each prompt token adds to a step (its whole wall time: model, sampling,
    output). The first prompt steps, with no decode beside them, count their fixed cost as the
    tokens': an overestimate, so the budget they give starts small."""
    decode_s: float | None = None
    prompt_token_s: float | None = None
    alpha: float = 0.2

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        if not prompt_tokens:
            if decode_rows:
                self.decode_s = self._avg(self.decode_s, seconds)
            return
        rest = seconds - ((self.decode_s or 0.0) if decode_rows else 0.0)
        self.prompt_token_s = self._avg(self.prompt_token_s, max(0.0, rest) / prompt_tokens)

    def prompt_tokens_within(self, slowdown: float) -> int | None:
        """Prompt tokens a step with decodes may add and take at most ``slowdown`` x a decode-only step
        (None until both costs are known)."""
        if self.decode_s is None or not self.prompt_token_s:
            return None
        return max(MIN_PROMPT_CHUNK, int((slowdown - 1.0) * self.decode_s / self.prompt_token_s))


@dataclass
class Fairness:
    """Tenancy inside the scheduler: tenants' weights and running caps, and the per-step prompt budget."""
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> weight (absent: 1)
    max_running: dict[str, int] = field(default_factory=dict)  # tenant -> most running sequences (absent: no cap)
    prompt_tokens_per_step: int = 256  # 0: no cap beyond the token budget
    decode_slowdown_max: float = 0.0  # > 1: while sequences decode, steps stay within this x a decode step; 0: off

    def __post_init__(self):
        if self.decode_slowdown_max and not self.decode_slowdown_max > 1:
            raise ValueError(f"decode_slowdown_max must be > 1 (or 0: off), got {self.decode_slowdown_max}")
        for name, w in self.weights.items():
            if not w > 0:
                raise ValueError(f"tenant {name!r}: weight must be > 0, got {w}")
        for name, m in self.max_running.items():
            if not (isinstance(m, int) and m >= 1):
                raise ValueError(f"tenant {name!r}: max_running must be an integer >= 1, got {m!r}")
        if self.prompt_tokens_per_step < 0:
            raise ValueError("prompt_tokens_per_step must be >= 0 (0: no cap)")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefill_batch_tokens: int = 0, fairness: Fairness | None = None):
        """``prefill_batch_tokens``: waiting prompts stop joining a step once its prompt tokens reach
        this many (the first always joins); 0: only the token budget limits them. ``fairness``: tenants'
        weights and caps (None: priority still orders the line; one tenant, no prompt cap)."""
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
        self.fairness = fairness or Fairness(prompt_tokens_per_step=0)
        self.served: dict[str, float] = {}  # tenant -> tokens computed for it / its weight
        self.step_cost = StepCost()  # what the engine's steps took (observe), for decode_slowdown_max

    def add(self, seq: Sequence) -> None:
        t = seq.tenant
        active = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        if t not in active:
            # back from idle: level with the least-served active tenant (idling banks no credit); into an idle
            # engine, level with the most served (what was served while others were idle is no debt)
            served = [self.served.get(a, 0.0) for a in active] or [max(self.served.values(), default=0.0)]
            self.served[t] = max(self.served.get(t, 0.0), min(served))
        self.waiting.append(seq)

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        """A step the engine ran: its wall time, prompt tokens and decode rows (StepCost)."""
        self.step_cost.observe(seconds, prompt_tokens, decode_rows)

    def _prompt_cap(self, seq: Sequence) -> int:
        """The step's prompt-token cap (0: none) for a chunk of ``seq``: ``prompt_tokens_per_step``, cut by
        ``decode_slowdown_max`` while another tenant served less than ``seq``'s is decoding (the decodes
        of the tenant kept waiting are protected from the one served more; its own prompts are not cut)."""
        cap = self.fairness.prompt_tokens_per_step
        if not self.fairness.decode_slowdown_max:
            return cap
        mine = self.served.get(seq.tenant, 0.0)
        if any(s.tenant != seq.tenant and s.num_computed_tokens >= s.num_prompt_tokens
               and self.served.get(s.tenant, 0.0) < mine for s in self.running):
            within = self.step_cost.prompt_tokens_within(self.fairness.decode_slowdown_max)
            if within is not None:
                cap = min(cap, within) if cap else within
        return cap

    def charge(self, seq: Sequence, n: int) -> None:
        """Counts ``n`` tokens of ``seq`` as served to its tenant (fair share; the engine adds a burst's)."""
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + n / self.fairness.weights.get(seq.tenant, 1.0)

    def _yield_to(self) -> tuple[int, float, str] | None:
        """(priority, served, tenant) of the waiting request that would join next, when it could join now,
        among tenants with no prompt in progress (one that has is being served: its running prompt takes
        the budget, so yielding would admit nothing)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        running_by_tenant: dict[str, int] = {}
        for s in self.running:
            running_by_tenant[s.tenant] = running_by_tenant.get(s.tenant, 0) + 1
        prompting = {s.tenant for s in self.running if s.num_computed_tokens < s.num_prompt_tokens}
        at = self._next_waiting(running_by_tenant, skip=prompting)
        if at is None:
            return None
        seq = self.waiting[at]
        if not seq.block_table and self.bm.match_prefix(seq) is None:
            return None  # it waits for a prefix being computed (perhaps by the prompt that would yield)
        if not self.bm.can_allocate(seq, min(seq.num_uncomputed_tokens, self._prompt_cap(seq))):
            return None  # no room for it now: yielding would only stall the running prompt
        return seq.priority, self.served.get(seq.tenant, 0.0), seq.tenant

    def _next_waiting(self, running_by_tenant: dict[str, int], skip: set[str] = frozenset()) -> int | None:
        """Index in ``waiting`` of the one to join next: lowest priority value, then least-served tenant
        (on a tie, the one running fewer), then its place in line; tenants at their ``max_running`` (and
        those in ``skip``) are passed over."""
        cap = self.fairness.max_running
        best, key = None, None
        for i, seq in enumerate(self.waiting):
            if seq.tenant in skip or seq.tenant in cap and running_by_tenant.get(seq.tenant, 0) >= cap[seq.tenant]:
                continue
            k = (seq.priority, self.served.get(seq.tenant, 0.0), running_by_tenant.get(seq.tenant, 0), i)
            if key is None or k < key:
                best, key = i, k
        return best

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = Status.FINISHED

    def reserve(self, seqs: list[Sequence], extra: int) -> bool:
        """Room for ``extra`` more tokens of each scheduled decode beyond this step's one (a decode burst,
        runtime/engine/engine.py): the blocks for all of them, or nothing at all (False) where the free blocks
        fall short; never preempts. The engine charges the tokens the burst made (``charge``)."""
        if sum(self.bm.blocks_needed(s, s.num_uncomputed_tokens + extra) for s in seqs) > self.bm.num_free_blocks:
            return False
        for s in seqs:
            self.bm.allocate(s, s.num_uncomputed_tokens + extra)
        return True

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = Status.FINISHED

    def _room_to_return(self, seq: Sequence) -> bool:
        """Whether a preempted sequence fits whole beside every running one at its longest (``max_tokens``)."""
        bs = self.bm.block_size
        growth = sum(max(0, -(-(len(r) + r.params.max_tokens - r.num_output_tokens) // bs) - len(r.block_table))
                     for r in self.running)
        return self.bm.blocks_needed(seq, seq.num_uncomputed_tokens) + growth <= self.bm.num_free_blocks

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
        cap = self.fairness.prompt_tokens_per_step
        # with a prompt budget, a running prompt of a tenant served as much as or more than another tenant's
        # waiting one that could start now yields the budget to it (else one tenant's long prompts would hold it chunk after chunk)
        yield_to = self._yield_to() if cap else None

        # running sequences first: by priority (with a prompt budget, then the fewest prompt tokens left: the
        # budget's chunks finish the prompt nearest its first token, so a short prompt that fair share let in
        # is not cut into turns with a long one), then oldest first
        self.running.sort(key=(lambda s: (s.priority, s.num_uncomputed_tokens if s.num_computed_tokens <
                                          s.num_prompt_tokens else 0)) if cap else (lambda s: s.priority))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if cap and n > 1 and not seq.spec.draft and seq.num_computed_tokens < seq.num_prompt_tokens:
                n = min(n, self._prompt_cap(seq) - prompt_tokens)  # a prompt chunk within the step's prompt budget
                if (yield_to is not None and seq.tenant != yield_to[2]
                        and (seq.priority, self.served.get(seq.tenant, 0.0)) >= yield_to[:2]):
                    n = 0
                if n <= 0:
                    i += 1  # its next chunk waits a step; decodes behind it still run
                    continue
            if n < seq.num_uncomputed_tokens and seq.spec.draft:  # a draft that does not fit is dropped
                seq.drop_draft(max(0, n - 1))
                n = seq.num_uncomputed_tokens
            while not self.bm.can_allocate(seq, n):
                victim = max(reversed(self.running[i:]), key=lambda s: s.priority)  # worst priority, newest
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
            self.charge(seq, n)
            i += 1

        # then waiting sequences: by priority, then fair share, then arrival (preempted ones were put back
        # at the front)
        deferred: list[Sequence] = []
        running_by_tenant: dict[str, int] = {}
        for s in self.running:
            running_by_tenant[s.tenant] = running_by_tenant.get(s.tenant, 0) + 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            if self.prefill_batch_tokens and prompt_tokens >= self.prefill_batch_tokens:
                break
            if cap and prompt_tokens >= cap:
                break
            at = self._next_waiting(running_by_tenant)
            if at is None:
                break  # every waiting tenant is at its running cap
            seq = self.waiting[at]
            if not seq.block_table and self.bm.match_prefix(seq) is None:
                del self.waiting[at]
                deferred.append(seq)  # its prefix lands in the cache within steps
                continue
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill and seqs:
                    break  # without chunking a prompt waits for a step with room for all of it
                n = budget if self.enable_chunked_prefill else n
            room = self._prompt_cap(seq) - prompt_tokens if cap and self.enable_chunked_prefill else n
            if n > room:
                if room <= 0:
                    break  # this step is as heavy as the decodes it protects allow
                n = room
            # a preempted one waits (and the line behind it) for room to finish, not only for its next chunk
            if not self.bm.can_allocate(seq, n) or (seq.num_preemptions and self.running
                                                    and not self._room_to_return(seq)):
                if not self.running and not seqs:
                    # nothing will ever free blocks for it: fail loudly rather than hang
                    self.bm.free_sequence(seq)
                    raise RuntimeError(f"KV cache too small for a request of {len(seq)} tokens; "
                                       f"raise --kv-cache-memory")
                self.bm.free_sequence(seq)  # give back prefix blocks; it is matched again next step
                seq.num_cached_tokens = 0
                break
            del self.waiting[at]
            self.bm.allocate(seq, n)
            self.bm.mark_in_flight(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running_by_tenant[seq.tenant] = running_by_tenant.get(seq.tenant, 0) + 1
            seqs.append(seq)
            counts.append(n)
            budget -= n
            prompt_tokens += n
            self.charge(seq, n)
        self.waiting.extendleft(reversed(deferred))  # keep their place in line
        return ScheduledBatch(seqs, counts, preempted)
