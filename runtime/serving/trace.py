"""``infer-run ART --step-trace FILE``: where online time goes, one JSON line per event.

Three record types: ``step`` (each engine step's phases and shape: runtime/engine/step_record.py),
``loop_lag`` (how late a 10 ms sleep on the event loop wakes: time the loop was busy elsewhere) and
``stream_delay`` (from the engine thread handing a step's outputs over to the chunk carrying them
having been written to its stream). The event loop only appends dicts to a deque (thread-safe);
the engine thread serialises and writes them between steps, buffered, flushing at least every
``FLUSH_S`` seconds while idle or between steps; ``close`` writes the rest at shutdown.
``python -m infer.bench.timeline FILE`` summarises a trace.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

FLUSH_S = 0.5
LOOP_LAG_INTERVAL_S = 0.01


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "w", encoding="utf-8", buffering=1 << 16)
        self._pending: collections.deque[dict] = collections.deque()
        self._lock = threading.Lock()  # write (engine thread) against close (shutdown)
        self._flushed = time.monotonic()

    def add(self, record: dict) -> None:
        """Any thread: queue a record for the next ``write``."""
        self._pending.append(record)

    def write(self) -> None:
        """Engine thread: writes the queued records; flushes when the last flush is FLUSH_S old."""
        with self._lock:
            if self._file.closed:
                return
            self._write_pending()
            if time.monotonic() - self._flushed >= FLUSH_S:
                self._file.flush()
                self._flushed = time.monotonic()

    def _write_pending(self) -> None:
        pending, write = self._pending, self._file.write
        while pending:
            write(json.dumps(pending.popleft(), separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._write_pending()
                self._file.close()


async def sample_loop_lag(trace: StepTrace, interval: float = LOOP_LAG_INTERVAL_S) -> None:
    """Sleeps ``interval`` over and over, recording how much later than asked each sleep ends."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(interval)
        lag = time.perf_counter() - start - interval
        trace.add({"type": "loop_lag", "t": round(time.time(), 6), "lag_ms": round(max(0.0, lag) * 1e3, 3)})


def stream_delay_record(produced: float, outputs: int) -> dict:
    """``produced``: the engine thread's time.perf_counter() when it handed the oldest output over."""
    return {"type": "stream_delay", "t": round(time.time(), 6),
            "delay_ms": round((time.perf_counter() - produced) * 1e3, 3), "outputs": outputs}
