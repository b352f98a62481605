"""Drafts from a draft artifact: a smaller model with the target's tokenizer, run greedily on its own KV cache.

The target verifies these drafts exactly as it verifies n-gram ones (runtime/engine/speculative.py): greedy
requests keep their tokens, sampled ones their distribution (a greedy draft puts all its mass on one token a
position, which is what ``sampled_prefix`` assumes). The draft model keeps, per drafting sequence, a mirror of
the sequence in its own paged cache: each step it first computes the tokens it has not seen (the prompt at
first; then what the target kept of its last draft and the target's own token), then drafts k tokens, one
decode step each, the mirrors of every drafting sequence stepped together (one batch a draft token). What
the target rejected is never computed again: the mirror's computed length goes back to the tokens both
share, and their slots are overwritten. A sequence that stops running (finished, aborted, preempted) gives
its mirror's blocks back.

The draft artifact is verified like any artifact, and its tokenizer must be the target's (the same
vocabulary, added tokens included): a draft's token ids mean nothing to a target with another vocabulary.
It runs in the target's dtype on the same kernels. What it costs: k draft forward passes a verifying step, each a
small model's decode step; it pays where the draft model is several times cheaper than the target and agrees
with it often (the adaptive k weighs the acceptance as for n-gram drafts).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..artifact import TOKENIZER, Artifact, verify_artifact
from .block_manager import BlockManager
from .model_runner import ModelRunner, kv_bytes_per_block
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .speculative import SpeculativeConfig, VerifyCost, draft_budget

log = logging.getLogger("infer.engine")


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, draft: str | Path, target: Artifact, dtype: torch.dtype | None,
                 kernels, block_size: int, kv_cache_memory: int, device: torch.device | str = "cpu"):
        """``draft``: the draft artifact's directory; ``target``: the target's verified artifact; ``kernels``: a
        function of (dtype, head_dim) giving the KernelSet (the target's resolver settings); ``kv_cache_memory``:
        bytes of the draft model's own cache; ``device``: the target's, where the draft model runs too."""
        from ..model import ModelConfig, load_model

        self.config = config
        self.cost = VerifyCost(config.verify_cost)  # the engine times its steps into it
        self.token_seconds: float | None = None  # the time a drafted token costs, averaged (draft_cost)
        self.calls_timed = 0
        t0 = time.perf_counter()
        self.artifact = verify_artifact(draft)
        if _vocabulary(self.artifact) != _vocabulary(target):
            raise ValueError(f"draft artifact {self.artifact.path}: its tokenizer's vocabulary is not the target's "
                             f"({target.path}): a draft's token ids must mean what the target's mean; use a draft "
                             f"built from a model of the target's family with the same tokenizer")
        mcfg = ModelConfig.from_hf(self.artifact.config)
        self.model = load_model(self.artifact.path, dtype, lambda d: kernels(d, mcfg.head_dim),
                                hf_config=self.artifact.config, files=self.artifact.weight_files(), device=device)
        per_block = kv_bytes_per_block(self.model, block_size, self.model.dtype)
        blocks = kv_cache_memory // per_block
        if blocks < 2:
            raise ValueError(f"speculative_draft_memory={kv_cache_memory} bytes holds {blocks} draft KV blocks of "
                             f"{per_block} bytes: give the draft model's cache more memory")
        self.runner = ModelRunner(self.model, blocks, block_size, self.model.kernels)
        self.blocks = BlockManager(blocks, block_size, enable_prefix_caching=False)  # mirrors share nothing
        self.max_len = min(mcfg.max_position_embeddings, blocks * block_size)
        self.vocab = ModelConfig.from_hf(target.config).vocab_size
        self.mirrors: dict[int, Sequence] = {}  # target seq_id -> the draft model's copy of it
        log.info("speculative drafts from %s (%s, %d KV blocks), loaded in %.1fs", self.artifact.path,
                 self.model.dtype, blocks, time.perf_counter() - t0)

    def keep_only(self, running: list[Sequence]) -> None:
        """Gives back the mirrors of sequences no longer running."""
        live = {seq.seq_id for seq in running}
        for seq_id in [s for s in self.mirrors if s not in live]:
            self.blocks.free_sequence(self.mirrors.pop(seq_id))

    def draft_many(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Appends to each (sequence, room) of ``wanted`` a draft of at most ``room`` tokens (and the rule's k):
        the draft model steps all of their copies together, k decode steps for the longest draft."""
        jobs = []  # [sequence, its copy, its k, its draft so far]
        cost = self.cost.value + self.draft_cost()
        for seq, room in wanted:
            k = draft_budget(seq.spec, self.config, cost, room)
            if k >= 1 and len(seq) + k <= self.max_len:
                jobs.append((seq, self._mirror(seq), k, []))
        drafting = list(jobs)
        fresh = any(mirror.num_computed_tokens == 0 for _, mirror, _, _ in jobs)  # a copy's first prompt: not timed
        t0 = time.perf_counter()
        with torch.inference_mode():
            while jobs:
                batch = []
                for job in jobs:
                    mirror = job[1]
                    new = len(mirror) - mirror.num_computed_tokens
                    if self.blocks.can_allocate(mirror, new):  # else the draft cache is full: it drafts what it has
                        self.blocks.allocate(mirror, new)
                        batch.append((job, new))
                if not batch:
                    break
                logits = self.runner.execute(ScheduledBatch([j[1] for j, _ in batch], [n for _, n in batch], [])).logits
                going = []
                for (job, _), row in zip(batch, logits):
                    seq, mirror, k, draft = job
                    mirror.num_computed_tokens = len(mirror)
                    token = int(row.argmax())
                    if token >= self.vocab:  # a padded row of the draft's embedding: no token of the target's
                        continue
                    mirror.token_ids.append(token)
                    draft.append(token)
                    if len(draft) < k:
                        going.append(job)
                jobs = going
        tokens = sum(len(draft) for _, _, _, draft in drafting)
        if tokens and not fresh:  # the whole call over its tokens: the copies' catching up counts too
            self.calls_timed += 1
            seconds = (time.perf_counter() - t0) / tokens
            if self.calls_timed == 3:  # the first two warm caches up
                self.token_seconds = seconds
            elif self.calls_timed > 3:
                self.token_seconds += (seconds - self.token_seconds) * 0.1
        for seq, _, _, draft in drafting:
            if draft:
                seq.spec.draft = draft
                seq.token_ids.extend(draft)

    def draft_cost(self) -> float:
        """What drafting a token costs in one-row target steps (the draft model's time a drafted token, its copies'
        catching up with what the target emitted included, over a target step, both as timed so far; 0 until
        both are): added to the verify cost c in the rule, so a draft model no cheaper than what its accepted
        tokens save stops drafting (speculative.py)."""
        if self.token_seconds is None or not self.cost.one_row:
            return 0.0
        return self.token_seconds / self.cost.one_row

    def _mirror(self, seq: Sequence) -> Sequence:
        """The draft model's copy of ``seq``, its tokens now the target's and its computed length no longer than
        the tokens the two share."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(seq.request_id, [], SamplingParams(max_tokens=1))
        shared = 0
        for a, b in zip(mirror.token_ids, seq.token_ids):
            if a != b:
                break
            shared += 1
        mirror.token_ids = list(seq.token_ids)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, shared)
        return mirror


def _vocabulary(artifact: Artifact) -> dict[str, int]:
    """Token -> id of an artifact's tokenizer, added tokens included."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(artifact.path / TOKENIZER)).get_vocab(with_added_tokens=True)
