"""The kernel tuning table, ``tuning.json``: its format, the hardware it is valid for, and the
choices the runtime reads from it per batch-size bucket.

A table holds, for the machine it was measured on (runtime/tuning_measure.py says what is timed and
the rule): per bfloat16 linear shape, the kernel the loader packs it for (``linear``); per bucket of
decode sequences in a step, the C++ paged kernel or gather + SDPA (``decode_attention``); per bucket
of rows in a step, how many cores the step uses (``threads``). Each entry keeps every candidate's
timings, the default and the choice. The runtime follows the table only where its hardware matches
this machine's: a table measured elsewhere is ignored with one warning naming what differs (never a
refusal). The build's ``tune`` stage writes one into the artifact, ``infer-run ART --retune`` writes
one next to it. (The choices are the CPU's: the runtime does not apply them on CUDA.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("infer.tuning")
FORMAT, VERSION = "infer-tuning", 1


class TuningError(ValueError):
    """A tuning table that cannot be read; the message names the file and the fix."""


def hardware() -> dict:
    """What a table is valid for: the CPU (model, instruction set, the kernels' class), cores, torch."""
    from infer.kernels import isa
    from infer.kernels.extension import cpu_flags, cpu_has_avx512_bf16
    from infer.kernels.resolver import cpu_has_amx

    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpu_flags()
    hw = {"cpu": model, "isa": hashlib.sha256(flags.encode()).hexdigest()[:16], "amx": cpu_has_amx(),
          "avx512_bf16": cpu_has_avx512_bf16(), "cpu_class": isa.active(), "cores": len(os.sched_getaffinity(0)),
          "torch": torch.__version__}
    if torch.cuda.is_available():  # only then: a table from a machine without a GPU still matches one without
        hw["gpu"] = torch.cuda.get_device_name()
    return hw


def differences(table_hw: dict, here: dict) -> list[str]:
    """What differs between the table's hardware and this machine's, as readable items."""
    return [f"{k}: table {table_hw.get(k)!r}, here {here.get(k)!r}" for k in sorted(here) if table_hw.get(k) != here[k]]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n (the largest when n exceeds them all)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def shape_key(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    """A linear shape's key in the table's ``linear`` section: ``1536x576:bfloat16``."""
    return f"{in_features}x{out_features}:{str(dtype).removeprefix('torch.')}"


@dataclass
class Tuning:
    """A loaded table: the choices the runtime asks for."""
    table: dict
    _stale: set = field(default_factory=set, repr=False)  # linear shapes already warned about

    @classmethod
    def load(cls, path: Path) -> "Tuning":
        try:
            table = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TuningError(f"{path}: not a readable tuning table ({e}); delete it or run infer-run --retune") from e
        if table.get("format") != FORMAT or table.get("version") != VERSION:
            raise TuningError(f"{path}: format {table.get('format')!r} version {table.get('version')!r} is not "
                              f"{FORMAT!r} version {VERSION}; rebuild or run infer-run --retune")
        return cls(table)

    @property
    def buckets(self) -> list[int]:
        return self.table["buckets"]

    def matches_here(self, source: str) -> bool:
        """True when measured on this hardware; otherwise one warning naming what differs."""
        diff = differences(self.table.get("hardware") or {}, hardware())
        if diff:
            log.warning("tuning table %s was measured on other hardware (%s): using the default kernels; "
                        "infer-run --retune measures this machine", source, "; ".join(diff))
        return not diff

    def linear(self, in_features: int, out_features: int, dtype: torch.dtype, runnable=None) -> str | None:
        """The table's kernel for a shape; None (the default) where it has none, or where this runtime
        can run a kernel (``runnable``: their names) that the table never timed against its choice."""
        key = shape_key(in_features, out_features, dtype)
        entry = self.table.get("linear", {}).get(key)
        if not entry:
            return None
        untimed = sorted(set(runnable or ()) - set(entry.get("seconds", {})))
        if untimed:
            if key not in self._stale:
                self._stale.add(key)
                log.warning("tuning table: linear %s was timed without %s, which this runtime has; using the "
                            "default kernel for it (infer-run --retune measures them all)", key, ", ".join(untimed))
            return None
        return entry["choice"]

    def decode_attention(self, decodes: int) -> str | None:
        entry = self.table.get("decode_attention", {}).get(str(bucket_for(decodes, self.buckets)))
        return entry["choice"] if entry else None

    def threads(self, rows: int) -> int | None:
        entry = self.table.get("threads", {}).get(str(bucket_for(rows, self.buckets)))
        return int(entry["choice"]) if entry else None

    def changed(self) -> list[str]:
        """Where the table departs from the defaults, for logs and benchmarks."""
        out = []
        for section in ("linear", "decode_attention", "threads"):
            for key, entry in sorted(self.table.get(section, {}).items()):
                if str(entry["choice"]) != str(entry["default"]):
                    out.append(f"{section}[{key}]: {entry['default']} -> {entry['choice']}")
        return out


def write(table: dict, path: Path) -> Path:
    """The table as canonical JSON; timings rounded to the microsecond (what noise leaves meaningful)."""
    def rounded(v):
        if isinstance(v, float):
            return round(v, 6)
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return v

    Path(path).write_text(json.dumps(rounded(table), indent=2, sort_keys=True) + "\n")
    return Path(path)
