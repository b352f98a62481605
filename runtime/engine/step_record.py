"""One engine step's timings and shape, kept for the last ``KEPT`` steps (``LLMEngine.step_records``).

Cheap enough to be always on: a few ``time.perf_counter()`` calls and one small object per step, no
tensor synchronisation of its own. On a device that runs asynchronously the forward pass's time
shows partly in ``sample_ms``, where the sampled token ids are first read back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

KEPT = 10_000


@dataclass(slots=True)
class StepRecord:
    step: int  # the engine's step count at this step (1 = its first)
    t: float  # wall-clock start (time.time())
    schedule_ms: float  # the scheduler's choice of sequences and tokens
    model_ms: float  # preparing the inputs and the forward pass (model_runner.execute)
    sample_ms: float  # choosing the next tokens
    output_ms: float  # appending tokens: detokenizing, stop strings, finish reasons
    prefill_tokens: int  # tokens computed as prompt chunks (sequences reading their prompt, or recomputing)
    prefill_seqs: int
    decode_rows: int  # rows run as decodes (Sequence.runs_as_decode): generated tokens, one-token prompt tails, drafts
    batched_tokens: int
    waiting: int  # the scheduler's queues after the step
    running: int

    @property
    def dur_ms(self) -> float:
        return self.schedule_ms + self.model_ms + self.sample_ms + self.output_ms

    @property
    def kind(self) -> str:
        """decode (decode rows only), prefill (prompt chunks only) or mixed."""
        if not self.prefill_seqs:
            return "decode"
        return "mixed" if self.decode_rows else "prefill"

    def as_dict(self) -> dict:
        return {"type": "step", "step": self.step, "t": round(self.t, 6), "dur_ms": round(self.dur_ms, 3),
                "schedule_ms": round(self.schedule_ms, 3), "model_ms": round(self.model_ms, 3),
                "sample_ms": round(self.sample_ms, 3), "output_ms": round(self.output_ms, 3),
                "prefill_tokens": self.prefill_tokens, "prefill_seqs": self.prefill_seqs,
                "decode_rows": self.decode_rows, "batched_tokens": self.batched_tokens,
                "waiting": self.waiting, "running": self.running}


def new_step_records() -> deque:
    return deque(maxlen=KEPT)
