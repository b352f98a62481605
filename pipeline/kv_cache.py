"""The kv_cache stage: the KV cache format, chosen by the build's gates as the weights' format is.

Recipe ``kv_cache.dtype``: ``bfloat16`` (the default: the model's own 16-bit cache, nothing measured),
``int8`` (the quantized cache, kernels/csrc/paged_attention.cpp: values and a bfloat16 scale per token and
KV head, 1.94x the tokens in the same memory for head_dim 64), or ``auto``: the narrowest format whose gates
pass. A candidate is measured against the model's own cache through the runtime itself (the same model,
run in float32 so that the format's loss is what shows, two ModelRunners: one per cache), on held-out
windows of ``kv_cache.window_tokens`` tokens (the eval text, ``eval.data``) prefilled in chunks as the engine does: mean KL divergence of the next-token distributions
and top-1 agreement, at every position (long contexts are where quantized keys could hurt). The choice,
every candidate's metrics and the capacity gained go into the manifest's ``kv_cache`` section, which
``infer-run --kv-cache-dtype auto`` follows. An explicit ``int8`` that fails its gates is a build error.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from infer.runtime.artifact import CONFIG, MANIFEST, write_manifest

from .config import BuildConfig
from .stage import StageResult, artifact_view, content_key, link_tree, run_stage

log = logging.getLogger("infer.build")
KV_VERSION = 3  # 2: keys stored turned (paged_attention.cpp hadamard_block); 3: measured in float32
CANDIDATES = ("int8",)  # narrowest first; the 16-bit cache is the reference
CHUNK = 256  # prompt tokens a step, as a chunked prefill runs them


class KVCacheError(ValueError):
    """The recipe asked for a KV cache format its gates reject (or that cannot be measured here)."""


def wanted(cfg: BuildConfig) -> bool:
    return cfg.kv_cache.dtype != "bfloat16"


def compare_caches(artifact: Path, windows: list[list[int]], candidate: str = "int8",
                   compute: str = "float32", reference_rows: str = "auto") -> dict:
    """The candidate cache's next-token distributions against the model's own cache over ``windows`` (token
    ids), every position scored: mean/p99/max KL divergence, top-1 agreement, and the bytes a token takes
    against the 16-bit cache.

    ``compute`` float32 (the gate's): the model runs in float32, so what is measured is what the format
    loses. In bfloat16 the two runs' own rounding drifts apart whatever the cache, several times the
    format's loss on the embedded model (bench/kv_cache.py --kld-windows measures both; the figures are in
    docs/benchmarks/). ``reference_rows`` "decode-rows": the reference reads its prompt rows as the int8 cache
    does (each a decode row, runtime/engine/plan.py), so that in bfloat16 the two runs differ by the format
    alone and not also by the prompt-chunk kernel's rounding."""
    import torch

    from infer.runtime import LLM
    from infer.runtime.engine.model_runner import ModelRunner, kv_bytes_per_block
    from infer.runtime.engine.sampling_params import SamplingParams
    from infer.runtime.engine.scheduler import ScheduledBatch
    from infer.runtime.engine.sequence import Sequence

    longest = max(len(w) for w in windows)
    bs = 16
    blocks = -(-longest // bs) + 1
    llm = LLM(artifact, dtype=compute, kv_cache_dtype="bfloat16", kv_cache_memory=4 << 20, max_num_seqs=1,
              max_model_len=bs, enable_prefix_caching=False)  # the model and kernels; its own cache stays tiny
    engine = llm.engine
    model = engine.model
    kv_dtype = {"int8": torch.int8}[candidate]
    reference = ModelRunner(model, blocks, bs, engine.kernels, prompt_rows=reference_rows)
    quantized = ModelRunner(model, blocks, bs, engine.kernels, kv_dtype=kv_dtype)
    klds, agree = [], []
    start_time = time.perf_counter()
    with torch.inference_mode():
        for ids in windows:
            seq = Sequence("kv-gate", ids, SamplingParams(max_tokens=1))
            seq.block_table = list(range(-(-len(ids) // bs)))
            for start in range(0, len(ids), CHUNK):
                n = min(CHUNK, len(ids) - start)
                seq.num_computed_tokens = start
                batch = ScheduledBatch([seq], [n], [])
                lb = model.compute_logits(reference.forward(reference.prepare(batch))).log_softmax(-1)
                lv = model.compute_logits(quantized.forward(quantized.prepare(batch))).log_softmax(-1)
                klds.append((lb.exp() * (lb - lv)).sum(-1).clamp_min(0).double())
                agree.append((lb.argmax(-1) == lv.argmax(-1)).double())
    llm.close()
    kld, same = torch.cat(klds), torch.cat(agree)
    per_token = kv_bytes_per_block(model, bs, kv_dtype) // bs
    reference_per_token = kv_bytes_per_block(model, bs, torch.bfloat16) // bs  # what the 16-bit cache takes
    return {"dtype": candidate, "reference": str(model.dtype).removeprefix("torch."), "compute": compute,
            "reference_rows": reference.plan.prompt_rows,
            "windows": len(windows), "window_tokens": longest, "tokens": int(kld.numel()), "mean_kld": float(kld.mean()),
            "p99_kld": float(kld.quantile(0.99)), "max_kld": float(kld.max()), "top1_agreement": float(same.mean()),
            "bytes_per_token": per_token, "reference_bytes_per_token": reference_per_token,
            "capacity_x": round(reference_per_token / per_token, 4), "seconds": round(time.perf_counter() - start_time, 1)}


def eval_windows(artifact: Path, data: str, tokens: int, count: int) -> list[list[int]]:
    """``count`` disjoint windows of ``tokens`` tokens of the held-out eval text."""
    from infer.eval.metrics import eval_texts, token_stream
    from infer.runtime.engine.tokenizer import Tokenizer

    config = json.loads((Path(artifact) / CONFIG).read_text())
    ids = token_stream(Tokenizer(Path(artifact), config), eval_texts(data), tokens * count)
    if len(ids) < tokens:
        raise KVCacheError(f"kv_cache.window_tokens={tokens}: the eval text ({data}) has only {len(ids)} tokens")
    return [ids[i:i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)][:count]


def kv_stage(cfg: BuildConfig, cache: Path, packaged: StageResult) -> StageResult:
    """Measures the candidates (a stage cached by the package and the settings), decides, and seals the
    artifact with the manifest's ``kv_cache`` section."""
    k = cfg.kv_cache
    candidates = CANDIDATES if k.dtype == "auto" else (k.dtype,)
    settings = {"window_tokens": k.window_tokens, "windows": k.windows, "data": cfg.eval.data}
    inputs = {"v": KV_VERSION, "package": packaged.key, "candidates": list(candidates), **settings}

    def measure(out: Path) -> dict:
        with artifact_view(packaged.path, out / ".artifact") as view:
            windows = eval_windows(view, cfg.eval.data, k.window_tokens, k.windows)
            rows = [compare_caches(view, windows, c) for c in candidates]
        (out / "kv_cache.json").write_text(json.dumps(rows, indent=1))
        return {"candidates": len(rows)}

    measured = run_stage(cache, "kv-measure", inputs, measure)
    rows = json.loads((measured.path / "kv_cache.json").read_text())
    for r in rows:
        r["passed"] = r["mean_kld"] <= k.mean_kld_max and r["top1_agreement"] >= k.top1_agreement_min
        log.info("kv_cache %s: mean KLD %.5f (max %.5f), top-1 agreement %.4f (min %.4f) over %d tokens: %s",
                 r["dtype"], r["mean_kld"], k.mean_kld_max, r["top1_agreement"], k.top1_agreement_min, r["tokens"],
                 "passed" if r["passed"] else "failed")
    chosen = next((r["dtype"] for r in rows if r["passed"]), None)
    if chosen is None and k.dtype != "auto":
        r = rows[0]
        raise KVCacheError(f"kv_cache.dtype={k.dtype}: mean KLD {r['mean_kld']:.5f} (kv_cache.mean_kld_max "
                           f"{k.mean_kld_max}), top-1 agreement {r['top1_agreement']:.4f} (kv_cache.top1_agreement_min "
                           f"{k.top1_agreement_min}) against the 16-bit cache; use kv_cache.dtype=auto or bfloat16")
    record = {"dtype": chosen or "bfloat16", "requested": k.dtype, "rule": "the narrowest format whose gates pass",
              "gates": {"mean_kld_max": k.mean_kld_max, "top1_agreement_min": k.top1_agreement_min},
              "candidates": rows, "capacity_x": next((r["capacity_x"] for r in rows if r["dtype"] == chosen), 1.0)}
    seal_inputs = {**inputs, "record": record}
    key = content_key("kv-cache", seal_inputs)
    return run_stage(cache, "kv-cache", seal_inputs, lambda out: _seal(packaged.path, out, record, key))


def _seal(packaged: Path, out: Path, record: dict, key: str) -> dict:
    link_tree(packaged, out)
    manifest = json.loads((packaged / MANIFEST).read_text())
    for k in ("files", "format", "format_version"):
        manifest.pop(k, None)
    manifest["stages"] = {**manifest.get("stages", {}), "kv_cache": key}
    manifest["kv_cache"] = record
    sealed = write_manifest(out, manifest, linked_from=packaged)
    return {"files": len(sealed["files"]), "kv_cache": record["dtype"]}
