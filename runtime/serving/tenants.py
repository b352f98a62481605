"""Tenants: API keys, their share of the engine and their request rates, from one YAML file.

``infer-run ART --tenants tenants.yaml``::

    prompt_tokens_per_step: 256   # prompt tokens one engine step computes at most (default 256)
    decode_slowdown_max: 2        # while any request decodes, steps take at most 2x a decode-only step
                                  # (prompt tokens cut to fit, by measured step costs; default 0: off)
    tenants:
      alice:
        key: sk-alice              # or key_env: ALICE_KEY (read from the environment)
        weight: 2                  # fair share in the scheduler (default 1)
        rate: 5                    # requests per second, a token bucket (default: no limit)
        burst: 10                  # the bucket's size (default: max(1, rate))
        max_running: 8             # most sequences it runs at once (default: no cap)
      bob: {key: sk-bob}

A request's key names its tenant (unknown key: 401); past the tenant's rate a request gets a 429
whose Retry-After says when its bucket holds a token again. Weights, caps and the prompt budget go
to the scheduler (``engine.scheduler.Fairness``), which shares the engine between tenants.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..engine.scheduler import Fairness

_TENANT_KEYS = {"key", "key_env", "weight", "rate", "burst", "max_running"}
_TOP_KEYS = {"tenants", "prompt_tokens_per_step", "decode_slowdown_max"}


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; a request takes one."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()
        self.lock = threading.Lock()

    def take(self, now: float | None = None) -> float:
        """0 when a token was taken; otherwise the seconds until one is there."""
        with self.lock:
            now = time.monotonic() if now is None else now
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return 0.0
            return (1 - self.tokens) / self.rate


@dataclass
class Tenant:
    name: str
    key: str
    weight: float = 1.0
    rate: float | None = None
    burst: float | None = None
    max_running: int | None = None

    def __post_init__(self):
        self.bucket = TokenBucket(self.rate, self.burst or max(1.0, self.rate)) if self.rate else None


class Tenants:
    def __init__(self, tenants: list[Tenant], prompt_tokens_per_step: int = 256, decode_slowdown_max: float = 0.0):
        self.tenants = tenants
        self.prompt_tokens_per_step = prompt_tokens_per_step
        self.decode_slowdown_max = decode_slowdown_max
        self.by_key = {t.key: t for t in tenants}

    def fairness(self) -> Fairness:
        return Fairness({t.name: t.weight for t in self.tenants},
                        {t.name: t.max_running for t in self.tenants if t.max_running},
                        self.prompt_tokens_per_step, self.decode_slowdown_max)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tenants:
        """Reads and checks a tenants file; ValueError naming the file, the tenant and the fix."""
        import yaml

        path = Path(path)
        where = f"tenants file {path}"
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read the {where}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{where} is not valid YAML: {str(e)[:300]}") from None
        return cls.parse(doc, where)

    @classmethod
    def parse(cls, doc, where: str = "tenants") -> Tenants:
        if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict) or not doc["tenants"]:
            raise ValueError(f"{where}: expected a mapping with 'tenants: {{NAME: {{key: ...}}, ...}}' "
                             f"(at least one tenant)")
        unknown = set(doc) - _TOP_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown setting {sorted(unknown)[0]!r}; known: {', '.join(sorted(_TOP_KEYS))}")
        budget = doc.get("prompt_tokens_per_step", 256)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"{where}: prompt_tokens_per_step must be an integer >= 0 (0: no cap), got {budget!r}")
        slowdown = doc.get("decode_slowdown_max", 0)
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not (slowdown == 0 or slowdown > 1):
            raise ValueError(f"{where}: decode_slowdown_max must be a number > 1 (e.g. 2: decoding requests' steps "
                             f"at most 2x a decode-only step) or 0 (off), got {slowdown!r}")
        tenants, keys = [], set()
        for name, spec in doc["tenants"].items():
            at = f"{where}: tenant {name!r}"
            if not isinstance(spec, dict):
                raise ValueError(f"{at}: expected a mapping such as {{key: sk-..., weight: 1}}")
            unknown = set(spec) - _TENANT_KEYS
            if unknown:
                raise ValueError(f"{at}: unknown setting {sorted(unknown)[0]!r}; known: {', '.join(sorted(_TENANT_KEYS))}")
            key = spec.get("key")
            if "key_env" in spec:
                key = os.environ.get(str(spec["key_env"]))
                if not key:
                    raise ValueError(f"{at}: the environment variable {spec['key_env']} (key_env) is not set")
            if not isinstance(key, str) or not key:
                raise ValueError(f"{at}: give its API key as key: ... or key_env: VARIABLE")
            if key in keys:
                raise ValueError(f"{at}: its key is also another tenant's; give each tenant its own key")
            keys.add(key)
            values = {}
            for field, lo, integer in (("weight", 0, False), ("rate", 0, False), ("burst", 1, False),
                                       ("max_running", 1, True)):
                v = spec.get(field)
                if v is None:
                    continue
                ok = isinstance(v, int) if integer else isinstance(v, (int, float))
                if isinstance(v, bool) or not ok or not math.isfinite(v) or not (v > lo if lo == 0 else v >= lo):
                    what = "an integer" if integer else "a number"
                    raise ValueError(f"{at}: {field} must be {what} {'> 0' if lo == 0 else f'>= {lo}'}, got {v!r}")
                values[field] = v
            tenants.append(Tenant(str(name), key, **values))
        return cls(tenants, budget, float(slowdown))
