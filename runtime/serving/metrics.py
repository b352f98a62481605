"""Prometheus metrics, named after vLLM's with the prefix ``infer:``.

Gauges and the engine's own cumulative counters (prefix cache, preemptions) are read from the
engine when scraped; per-request histograms and token counters are fed by the engine thread as
outputs come out of ``step()``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU latencies run from milliseconds to minutes
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
            160.0, 320.0, 640.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector:
    def __init__(self, server_metrics: "ServerMetrics"):
        self.m = server_metrics

    def collect(self):
        m = self.m
        labels = ["model_name"]
        lv = [m.model_name]
        snap = m.snapshot() if m.snapshot else None

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, value)
            return c

        snap = snap or {}
        yield gauge("infer:num_requests_running", "Requests in the running batch.", snap.get("running", 0))
        yield gauge("infer:num_requests_waiting", "Requests waiting to be scheduled.", snap.get("waiting", 0))
        yield gauge("infer:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).",
                    snap.get("kv_usage", 0.0))
        yield gauge("infer:kv_cache_blocks_used", "KV-cache blocks held by live requests.", snap.get("blocks_used", 0))
        yield gauge("infer:kv_cache_blocks_total", "KV-cache blocks in the pool.", snap.get("blocks_total", 0))
        yield gauge("infer:engine_ready", "1 once the model is loaded and serving.", 1 if snap else 0)
        yield counter("infer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.get("prefix_queries", 0))
        yield counter("infer:prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.get("prefix_hits", 0))
        yield counter("infer:num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks.",
                      snap.get("preemptions", 0))
        yield counter("infer:engine_steps", "Engine steps (forward passes) run.", snap.get("steps", 0))
        # speculative decoding, as vLLM names it (spec_decode_*)
        yield counter("infer:spec_decode_num_drafts", "Drafts verified (one per sequence per step that drafted).",
                      snap.get("spec_steps", 0))
        yield counter("infer:spec_decode_num_draft_tokens", "Draft tokens verified.", snap.get("spec_drafted", 0))
        yield counter("infer:spec_decode_num_accepted_tokens", "Draft tokens accepted.", snap.get("spec_accepted", 0))
        yield counter("infer:spec_decode_num_emitted_tokens",
                      "Tokens emitted by steps that verified a draft (accepted plus the target's own).",
                      snap.get("spec_emitted", 0))


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.e2e_sum, self.e2e_n = 0.0, 0  # for Retry-After estimates
        self.snapshot = None  # set to a callable returning engine gauges once the engine is loaded
        r, L = self.registry, ["model_name"]
        self.ttft = Histogram("infer:time_to_first_token_seconds", "Time from arrival to the first output token.",
                              L, buckets=_LATENCY, registry=r).labels(model_name)
        self.itl = Histogram("infer:inter_token_latency_seconds", "Time between successive output tokens.",
                             L, buckets=_TOKEN_LATENCY, registry=r).labels(model_name)
        self.tpot = Histogram("infer:time_per_output_token_seconds",
                              "Per request: (end - first token) / (output tokens - 1).",
                              L, buckets=_TOKEN_LATENCY, registry=r).labels(model_name)
        self.e2e = Histogram("infer:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             L, buckets=_LATENCY, registry=r).labels(model_name)
        self.queue = Histogram("infer:request_queue_time_seconds", "Time from arrival to first being scheduled.",
                               L, buckets=_LATENCY, registry=r).labels(model_name)
        self.prefill = Histogram("infer:request_prefill_time_seconds",
                                 "Time from first being scheduled to the first token.",
                                 L, buckets=_LATENCY, registry=r).labels(model_name)
        self.prompt_len = Histogram("infer:request_prompt_tokens", "Prompt tokens per request.",
                                    L, buckets=_TOKENS, registry=r).labels(model_name)
        self.gen_len = Histogram("infer:request_generation_tokens", "Generated tokens per request.",
                                 L, buckets=_TOKENS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("infer:prompt_tokens", "Prompt tokens of requests that started generating.",
                                     L, registry=r).labels(model_name)
        self.generation_tokens = Counter("infer:generation_tokens", "Tokens generated.",
                                         L, registry=r).labels(model_name)
        self._success = Counter("infer:request_success",
                                "Finished requests, by finish reason (stop, length, abort, error).",
                                L + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self._rejected = Counter("infer:request_rejected", "Requests refused before reaching the engine, by reason.",
                                 L + ["reason"], registry=r)
        for reason in ("queue_full", "draining"):
            self._rejected.labels(model_name, reason)
        self._constrained = Counter("infer:constrained_requests",
                                    "Requests whose output was held to a grammar, by kind (json, json_object, regex, "
                                    "choice, grammar, tools).", L + ["kind"], registry=r)
        for kind in ("json", "json_object", "regex", "choice", "grammar", "tools"):
            self._constrained.labels(model_name, kind)
        self.registry.register(_EngineCollector(self))

    def constrained(self, kind: str) -> None:
        self._constrained.labels(self.model_name, kind).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason or "abort").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
