"""``infer-run ARTIFACT``: verify an artifact, then answer one prompt (``--prompt``) or serve it."""

from __future__ import annotations

import argparse
import sys

from infer.kernels.resolver import BACKENDS, DEVICES

from .artifact import MANIFEST, ArtifactError, verify_artifact
from .engine.speculative import METHODS as SPECULATIVE_METHODS


def _at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer of at least ``minimum`` (and at most ``maximum``), refused at parse
    time (before the model loads)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}, the least this option takes")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}, the most this option takes")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="infer-run", description="Load a verified infer artifact and run it.")
    p.add_argument("artifact", help="artifact directory written by infer-build")
    p.add_argument("--prompt", help="answer this prompt and exit (chat template applied unless --raw)")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    p.add_argument("--max-tokens", type=_at_least(1), default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the artifact's)")
    p.add_argument("--kv-cache-memory", type=str, default=None,
                   help="KV cache size in bytes, or with a unit: 512M, 4G (default: 20%% of available RAM)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "int8"], default="auto",
                   help="KV cache format: int8 (a bfloat16 scale per token and KV head) holds 1.94x the tokens of "
                        "bfloat16 in the same --kv-cache-memory; auto: what the artifact's build chose (default)")
    p.add_argument("--max-num-seqs", type=_at_least(1), default=128)
    p.add_argument("--max-model-len", type=_at_least(1), default=None)
    p.add_argument("--max-num-batched-tokens", type=_at_least(1), default=1024,
                   help="most tokens one step computes; longer prompts are prefilled in chunks (default 1024)")
    p.add_argument("--decode-burst", type=_at_least(1), default=8,
                   help="a step of plain decodes (greedy, or sampled by temperature, top-k, top-p, min-p alone) with no "
                        "request waiting runs up to this many decode steps "
                        "back to back (at most ~50 ms of them), without the scheduler and sampler between them: "
                        "the same tokens, streamed a burst at a time (default 8; 1: off)")
    p.add_argument("--prefill-batch-tokens", type=_at_least(0), default=128,
                   help="waiting prompts stop joining a step once its prompt tokens reach this: a burst of long "
                        "prompts is prefilled one after another, the first answered first; short ones still "
                        "share a step (default 128; 0: only --max-num-batched-tokens limits them)")
    p.add_argument("--tuning", default="auto", metavar="auto|off|PATH",
                   help="kernel choices per batch bucket: auto uses the artifact's tuning.json where it was "
                        "measured on this hardware; off the defaults; or a tuning.json to follow (default auto)")
    p.add_argument("--retune", action="store_true",
                   help="measure the kernel choices on this machine now (a minute or two), write them to "
                        "ARTIFACT.tuning.json beside the artifact (never into it), and use them")
    p.add_argument("--kernels", choices=BACKENDS, default="auto",
                   help="auto: triton on cuda; on cpu the compiled CPU kernels where they load, else torch ops; "
                        "cpp: those or fail (cpu only); torch: plain torch ops; triton: the GPU kernels (a CUDA "
                        "device, or TRITON_INTERPRET=1 to check them on the CPU) (default auto; INFER_AMX=0 keeps "
                        "AMX tiles off)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model, KV cache and sampler run: auto is cuda when torch sees a GPU, else cpu "
                        "(default auto)")
    p.add_argument("--speculative", choices=["auto", *SPECULATIVE_METHODS], default="auto",
                   help="speculative decoding: ngram drafts from the prompt and output so far (prompt lookup), draft "
                        "from a draft artifact's greedy tokens (--speculative-draft), verified k at a time: greedy "
                        "requests keep their tokens, sampled ones their distribution; auto: what the artifact's "
                        "build stated (recipe speculative.*), else off (default auto)")
    p.add_argument("--speculative-draft", default=None, metavar="DIR",
                   help="with --speculative draft: the draft artifact, a smaller model built with the target's "
                        "tokenizer, verified like the target")
    p.add_argument("--speculative-draft-memory", type=str, default="256M", metavar="BYTES",
                   help="the draft model's own KV cache (default 256M)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="the most draft tokens a step verifies with --speculative (default: the artifact's, else 8)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="draft per step the k (up to K) that the sequence's acceptance so far makes pay best; "
                        "--no-speculative-adaptive always drafts K (default: the artifact's, else on)")
    p.add_argument("--speculative-verify-cost", type=float, default=None, metavar="C",
                   help="a verify row's cost in decode steps, which the adaptive k weighs (default: the artifact's, "
                        "else measured from the engine's own steps: ~0.04 where linears are memory-bound, ~0.4 "
                        "where bfloat16 is emulated)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on cuda with the triton kernels, replay decode steps as a CUDA graph per batch bucket, "
                        "captured at load; --no-cuda-graphs runs every step eagerly (default on)")
    s = p.add_argument_group("server (without --prompt: an OpenAI-compatible HTTP API)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_at_least(1, 65535), default=8000, help="port to listen on (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                        "(default: $INFER_API_KEY, else none)")
    s.add_argument("--max-queue", type=_at_least(1), default=256,
                   help="most requests waiting for a batch slot; past it, 429 with Retry-After (default 256)")
    s.add_argument("--grace-period", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted (default 30)")
    s.add_argument("--max-body", type=_at_least(1), default=32 << 20, help="largest request body in bytes (default 32 MiB)")
    s.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request (no bodies)")
    s.add_argument("--step-trace", metavar="FILE", default=None,
                   help="write one JSON line per engine step (phase times, batch shape, queues), with event-loop "
                        "lag and stream delays, to FILE; summarise with python -m infer.bench.timeline FILE")
    s.add_argument("--tenants", metavar="FILE", default=None,
                   help="tenants.yaml: API keys, their fair-share weights, rate limits (429 with Retry-After) and "
                        "the per-step prompt budget (docs/replicas.md)")
    args = p.parse_args(argv)
    if args.api_key is None:
        import os

        args.api_key = os.environ.get("INFER_API_KEY") or None
    return args


def parse_bytes(text: str | None, flag: str = "--kv-cache-memory") -> int | None:
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise SystemExit(f"infer-run: error: {flag} {text!r} is not a size such as 536870912, 512M or 4G")


def engine_config(args: argparse.Namespace):
    from .engine.engine import EngineConfig

    return EngineConfig(dtype=args.dtype, kv_cache_memory=parse_bytes(args.kv_cache_memory),
                        kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kernels=args.kernels,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_batch_tokens=args.prefill_batch_tokens, decode_burst=args.decode_burst,
                        tuning=args.tuning, device=args.device, cuda_graphs=args.cuda_graphs,
                        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                        speculative_adaptive=args.speculative_adaptive,
                        speculative_verify_cost=args.speculative_verify_cost,
                        speculative_draft=args.speculative_draft,
                        speculative_draft_memory=parse_bytes(args.speculative_draft_memory, "--speculative-draft-memory"))


def retune(args: argparse.Namespace, artifact) -> None:
    """Measures this machine's table beside the artifact (the verified directory stays as it is)."""
    import torch

    from .tuning import write
    from .tuning_measure import measure

    path = artifact.path.with_name(artifact.path.name + ".tuning.json")
    print("infer-run: measuring kernel choices on this machine (--retune) ...", file=sys.stderr, flush=True)
    table = measure(artifact.path, [1, 2, 4, 8, 16, 32, 64], dtype=getattr(torch, args.dtype) if args.dtype else None)
    write(table, path)
    print(f"infer-run: wrote {path} in {table['seconds']:.0f}s; using it", file=sys.stderr, flush=True)
    args.tuning = str(path)


def server_config(args: argparse.Namespace):
    from .serving.server import ServerConfig

    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                        log_requests=args.log_requests, grace_period=args.grace_period, max_body=args.max_body,
                        access_log=args.access_log, step_trace=args.step_trace, engine=engine_config(args),
                        tenants=_tenants(args.tenants))


def _tenants(path: str | None):
    from .serving.tenants import Tenants

    return Tenants.load(path) if path else None


def answer(args: argparse.Namespace, artifact) -> int:
    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    llm = LLM(artifact, config=engine_config(args))
    prompt = args.prompt if args.raw else llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    print(out.text)
    return 0


def launched_worker(path: str) -> bool:
    """Under a launcher (torchrun: RANK, WORLD_SIZE set) every rank runs infer-run on a sharded artifact:
    rank 0 serves, the others become its workers (runtime/parallel/worker.py)."""
    import json
    from pathlib import Path

    from .parallel.distributed import launched

    env = launched()
    if env is None or env[0] == 0:
        return False
    try:
        tp = (json.loads((Path(path) / MANIFEST).read_text()).get("parallel") or {}).get("tp", 1)
    except (OSError, ValueError, AttributeError):
        tp = None
    if tp == 1:
        raise SystemExit(f"infer-run: error: RANK={env[0]}, but {path} is not sharded (no parallel.tp in its manifest): "
                         f"run it without a launcher, or build it with parallel.tp=N")
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    if launched_worker(args.artifact):
        from .parallel.worker import run_worker

        sys.exit(run_worker(args.artifact))
    try:
        artifact = verify_artifact(args.artifact)  # a bad artifact fails here, before any loading (exit 2)
        if args.retune:
            retune(args, artifact)
        if args.prompt is not None:
            sys.exit(answer(args, artifact))
        from .serving.server import serve

        sys.exit(serve(server_config(args), artifact))
    except ArtifactError as e:
        print(f"infer-run: refusing artifact: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:
        print(f"infer-run: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
