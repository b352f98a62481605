"""Tensor parallelism: serving an artifact that pipeline/shard.py split into ``rank{r}.safetensors``.

One process per rank. Rank 0 is the engine (scheduler, sampler, detokenizer, HTTP server); every
rank runs its slice of each step's forward pass over its own KV cache (its own KV heads), and the
ranks sum the two row-parallel projections of each block with one all-reduce each. The pieces:

- ``layers.py``: the rank-local ModelConfig and the row-parallel all-reduce wrapper (module swaps on
  the ordinary model, gpt-fast style: a rank's model is the same Transformer with fewer heads);
- ``distributed.py``: rendezvous (torch's ``env://``), the process group, launching ranks, and the
  messages rank 0 sends every step (a fixed int64 header and one int64 payload: no pickling);
- ``runner.py``: rank 0's side (``RankGroup``: the other ranks, their liveness, the step lock;
  ``TensorParallelRunner``: the ModelRunner that broadcasts each step before running it);
- ``worker.py``: the loop every other rank runs (``python -m infer.runtime.parallel.worker ART``,
  or ``infer-run ART`` under torchrun with RANK > 0).
"""

from __future__ import annotations

from ..artifact import MANIFEST, Artifact, ArtifactError


def tensor_parallel_size(artifact: Artifact) -> int:
    """The number of ranks the artifact was sharded for (its manifest's ``parallel.tp``; 1 without)."""
    parallel = artifact.manifest.get("parallel")
    if parallel is None:
        return 1
    tp = parallel.get("tp") if isinstance(parallel, dict) else None
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ArtifactError(f"{artifact.path / MANIFEST}: parallel.tp is {tp!r}, not a positive integer; "
                            f"rebuild the artifact with infer-build")
    return tp


__all__ = ["tensor_parallel_size"]
