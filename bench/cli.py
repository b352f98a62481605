"""``infer-bench``: ``serve`` loads a running server over HTTP; ``offline`` and ``single`` run the engine."""

from __future__ import annotations

import sys

USAGE = """usage: infer-bench {serve,offline,single,tune,structured,speculative,quant-speed,kv-cache,replicas,sliding-window} [options]

  serve     load an OpenAI-compatible server (infer-run ARTIFACT) with Poisson arrivals of streaming
            requests; report TTFT, TPOT, ITL, end-to-end and queue time (p50/p95/p99), tokens/s, req/s;
            --target NAME=URL (repeated) runs one workload against each server, side by side
  offline   the engine's throughput on 64 mixed requests against transformers generate (no server)
  single    one request's decode speed against transformers generate at batch 1 (no server)
  tune      decode step time per batch bucket, the artifact's tuning.json against the defaults
  structured  tokens/s held to a JSON schema against the same prompts unconstrained, mask and compile
            times (no server)
  speculative  batch-1 decode with n-gram speculation against without, on a grounded and a chat prompt
            set (no server)
  quant-speed  batch-1 decode and 256-token prefill of quantized artifacts against bfloat16 (and llama.cpp
            GGUFs), interleaved rounds, each against its own bandwidth floor (no server)
  kv-cache  the int8 KV cache against bfloat16: decode attention at 2k context, the decode step at batch
            16, capacity at the same memory, optionally the gate's KLD, chat answers, long prompts, and
            int8 against fp8 (no server)
  replicas  2 replicas behind the router: prefix-aware against round-robin on a multi-tenant workload
            (hit rate, TTFT); one tenant's TTFT/TPOT while another floods, fair share against FCFS
  sliding-window  the KV blocks a long conversation holds with a sliding window against full attention,
            and its decode speed (no server)

infer-bench COMMAND --help shows the options of each."""


# command -> the bench/ module whose main(argv) runs it (serve is separate: its exit code is the verdict)
COMMANDS = {"offline": "throughput", "single": "single", "tune": "tune", "structured": "structured",
            "speculative": "speculative", "quant-speed": "quant_speed", "kv-cache": "kv_cache", "replicas": "replicas",
            "sliding-window": "sliding_window"}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from .serve import main as serve_main

        sys.exit(serve_main(rest))
    if command in COMMANDS:
        import importlib

        importlib.import_module(f".{COMMANDS[command]}", __package__).main(rest)
        sys.exit(0)
    print(f"infer-bench: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
