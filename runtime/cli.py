"""``infer-run ARTIFACT``: verify an artifact, then answer one prompt (``--prompt``) or serve it."""

from __future__ import annotations

import argparse
import sys

from .artifact import ArtifactError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="infer-run", description="Load a verified infer artifact and run it.")
    p.add_argument("artifact", help="artifact directory written by infer-build")
    p.add_argument("--prompt", help="answer this prompt and exit (chat template applied unless --raw)")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the artifact's)")
    p.add_argument("--kv-cache-memory", type=str, default=None,
                   help="KV cache size in bytes, or with a unit: 512M, 4G (default: 20%% of available RAM)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    s = p.add_argument_group("server (without --prompt: an OpenAI-compatible HTTP API)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                        "(default: $INFER_API_KEY, else none)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting for a batch slot; past it, 429 with Retry-After (default 256)")
    s.add_argument("--grace-period", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted (default 30)")
    s.add_argument("--max-body", type=int, default=32 << 20, help="largest request body in bytes (default 32 MiB)")
    s.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request (no bodies)")
    args = p.parse_args(argv)
    if args.api_key is None:
        import os

        args.api_key = os.environ.get("INFER_API_KEY") or None
    return args


def parse_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise SystemExit(f"infer-run: error: --kv-cache-memory {text!r} is not a size such as 536870912, 512M or 4G")


def engine_args(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "kv_cache_memory": parse_bytes(args.kv_cache_memory),
            "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}


def answer(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(args.artifact, **engine_args(args))
    prompt = args.prompt if args.raw else llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    print(out.text)
    return 0


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if args.prompt is not None:
            sys.exit(answer(args))
        from .server import serve

        sys.exit(serve(args))
    except ArtifactError as e:
        print(f"infer-run: refusing artifact: {e}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:
        print(f"infer-run: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
