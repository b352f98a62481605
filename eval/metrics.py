"""Accuracy metrics computed with the runtime that serves the artifact.

- Perplexity on held-out text: the engine (``LLM.generate`` with ``prompt_logprobs``) scores
  fixed-length windows cut from the token stream with a fixed stride; with a stride shorter
  than the window, each window scores only the tokens the previous one did not (so every token
  is scored once, with at least ``seq_len - stride`` tokens of context).
- Against a baseline: the runtime's own forward (``model.logits``) gives both models' full
  next-token distributions on the same windows, from which the statistics llama.cpp's
  ``perplexity --kl-divergence`` reports: mean / median / p90 / p99 / max KL divergence
  KL(baseline || variant), top-1 agreement ("same top p"), RMS and mean change of the
  probability of the correct token, and the log ratio of perplexities.
- On chat prompts, what a chat user sees: each prompt of the prompt set rendered through the
  artifact's chat template (special tokens, system prompt, generation prompt), as ``infer-run
  --prompt`` and ``/v1/chat/completions`` send it. Both engines answer greedily: greedy agreement is
  the mean, over prompts, of the common prefix length over the longer answer. Then both models
  read the baseline's answers (teacher forcing) and the KL divergence and top-1 agreement of
  their next-token distributions over the answer tokens give ``chat_mean_kld`` and
  ``chat_top1_agreement``: the raw-text statistics, where the user reads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from infer.runtime.artifact import CONFIG
from infer.runtime.memory import weight_budget

from .runner import open_llm
from .settings import EvalError, EvalSettings

EVAL_VERSION = 2  # bump when a metric's definition changes: cached evaluations then stop matching
PROMPTS_FILE = Path(__file__).parent / "tasks" / "chat_prompts.jsonl"  # in tasks/: shipped as package data; the first 16 are prompts.jsonl


# ---------------------------------------------------------------------------- data

def eval_texts(data: str) -> list[str]:
    """The held-out documents: the evaluation split of pydoc_data.topics, or a user's .txt/.jsonl/dir."""
    from infer.eval.datasets import DataError, load_texts

    try:
        return load_texts(data, split="evaluation", key="eval.data")
    except DataError as e:
        raise EvalError(str(e)) from None


def texts_digest(texts: Sequence[str]) -> str:
    from infer.eval.datasets import texts_digest as digest

    return digest(texts)


def token_stream(tokenizer, texts: Sequence[str], limit: int) -> list[int]:
    """The documents joined by blank lines, tokenized (no special tokens), up to ``limit`` tokens."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t + "\n\n")
        if len(ids) >= limit:
            break
    return ids[:limit]


@dataclass(frozen=True)
class Window:
    ids: list[int]
    score_from: int  # positions >= score_from are scored (>= 1: position 0 has no prediction)


def make_windows(ids: Sequence[int], seq_len: int, stride: int, max_windows: int) -> list[Window]:
    """Windows of ``seq_len`` tokens every ``stride`` tokens; each scores only tokens not yet scored."""
    if len(ids) < 2:
        raise EvalError(f"the evaluation text has {len(ids)} tokens: at least 2 are needed")
    out: list[Window] = []
    scored_until, start = 0, 0
    while len(out) < max_windows:
        end = min(start + seq_len, len(ids))
        score_from = max(1, scored_until - start)
        if score_from < end - start:
            out.append(Window(list(ids[start:end]), score_from))
        scored_until = end
        if end == len(ids):
            break
        start += stride
    return out


def load_windows(tokenizer, s: EvalSettings) -> tuple[list[Window], dict]:
    texts = eval_texts(s.data)
    need = s.seq_len + s.stride * (s.max_windows - 1)
    ids = token_stream(tokenizer, texts, need)
    wins = make_windows(ids, s.seq_len, s.stride, s.max_windows)
    info = {"data": s.data, "digest": texts_digest(texts), "seq_len": s.seq_len, "stride": s.stride,
            "windows": len(wins), "tokens_scored": sum(len(w.ids) - w.score_from for w in wins)}
    return wins, info


def load_prompts(spec: str, limit: int) -> list[str]:
    """Prompts for greedy agreement: the shipped set, a .txt (one a line) or .jsonl ('prompt' or 'text')."""
    path = PROMPTS_FILE if spec == "default" else Path(spec).expanduser()
    if not path.is_file():
        raise EvalError(f"eval.prompts={spec!r}: no such file; use 'default', a .txt file (one prompt a line) "
                        f"or a .jsonl file with a 'prompt' field")
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                value = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
                if not isinstance(value, str):
                    raise EvalError(f"eval.prompts={spec!r}: line {n} has no string 'prompt' field")
                prompts.append(value)
    else:
        prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts[:limit]


# ---------------------------------------------------------------------------- engines

def engine_token_logprobs(llm, windows: Sequence[Window]) -> list[list[float]]:
    """Per window, the log-probability the engine gives each scored token (prompt_logprobs)."""
    from infer.runtime import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([w.ids for w in windows], params)
    result = []
    for w, out in zip(windows, outs):
        lps = out.prompt_logprobs
        result.append([lps[j]["logprob"] for j in range(w.score_from, len(w.ids))])
    return result


def perplexity_from(logprobs: Sequence[Sequence[float]]) -> dict:
    flat = [x for row in logprobs for x in row]
    nll = -math.fsum(flat) / len(flat)
    return {"ppl": math.exp(nll), "nll": nll, "tokens": len(flat)}


def engine_perplexity(llm, windows: Sequence[Window]) -> dict:
    start = time.perf_counter()
    result = perplexity_from(engine_token_logprobs(llm, windows))
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def compare_distributions(variant_model, baseline_model, windows: Sequence[Window],
                          baseline_logprobs: list[torch.Tensor] | None = None, keep_baseline: bool = False) -> dict:
    """llama.cpp's --kl-divergence statistics from both models' full next-token distributions.

    ``baseline_logprobs``: the baseline's log-softmax per window, when an earlier call computed them (see
    ``BaselineMemo``); ``keep_baseline``: return the ones computed here under ``"_baseline_logprobs"``
    (unless larger than ``BaselineMemo.MAX_FLOATS``)."""
    klds, agree, nll_v, nll_b, dp = [], [], [], [], []
    per_window = []
    start = time.perf_counter()
    hidden_v = _LayerTap(variant_model)
    hidden_b = _LayerTap(baseline_model if baseline_logprobs is None else None)
    layer_err: list[list[float]] = []
    kept: list[torch.Tensor] = []
    for n, w in enumerate(windows):
        targets = torch.tensor(w.ids[w.score_from:])
        lv = window_logprobs(variant_model, w)
        lb = window_logprobs(baseline_model, w) if baseline_logprobs is None else baseline_logprobs[n]
        if keep_baseline:
            kept.append(lb)
        if hidden_v.outputs and len(hidden_v.outputs) == len(hidden_b.outputs):
            layer_err.append([float((hv.float() - hb.float()).norm() / hb.float().norm().clamp_min(1e-12))
                              for hv, hb in zip(hidden_v.outputs, hidden_b.outputs)])
        hidden_v.outputs.clear(), hidden_b.outputs.clear()
        kld = (lb.exp() * (lb - lv)).sum(-1).clamp_min(0.0)
        klds.append(kld.double().numpy())
        agree.append((lv.argmax(-1) == lb.argmax(-1)).numpy())
        tv = lv.gather(-1, targets[:, None])[:, 0]
        tb = lb.gather(-1, targets[:, None])[:, 0]
        nll_v.append(-tv.double().numpy())
        nll_b.append(-tb.double().numpy())
        dp.append((tv.exp() - tb.exp()).double().numpy())
        per_window.append((float(klds[-1].mean()), float(agree[-1].mean()), int(klds[-1].size)))
        del lv, lb
    keep = {"_baseline_logprobs": kept} if keep_baseline and baseline_logprobs is None and \
        sum(t.numel() for t in kept) <= BaselineMemo.MAX_FLOATS else {}
    hidden_v.remove(), hidden_b.remove()
    kld, same, nv, nb, delta = (np.concatenate(x) for x in (klds, agree, nll_v, nll_b, dp))
    ppl_v, ppl_b = math.exp(nv.mean()), math.exp(nb.mean())
    return {
        "tokens": int(kld.size),
        "mean_kld": float(kld.mean()),
        "median_kld": float(np.median(kld)),
        "p90_kld": float(np.percentile(kld, 90)),
        "p99_kld": float(np.percentile(kld, 99)),
        "max_kld": float(kld.max()),
        "top1_agreement": float(same.mean()),
        "ppl_variant": ppl_v,
        "ppl_baseline": ppl_b,
        "ln_ppl_ratio": float(nv.mean() - nb.mean()),
        "rms_delta_p": float(np.sqrt((delta ** 2).mean())),
        "mean_delta_p": float(delta.mean()),
        # relative L2 error of each decoder layer's output hidden states against the baseline's
        "layer_hidden_error": [float(x) for x in np.mean(layer_err, axis=0)] if layer_err else None,
        # per window (a chat prompt's answer): mean KLD, top-1 agreement, tokens: for the spread over prompts
        "per_window": [{"mean_kld": k, "top1_agreement": a, "tokens": n} for k, a, n in per_window],
        "seconds": round(time.perf_counter() - start, 3),
        **keep,
    }


def window_logprobs(model, w: Window) -> torch.Tensor:
    """The model's float32 log-softmax over the vocabulary at each scored position of ``w`` (row j predicts
    token j + 1)."""
    return model.logits(torch.tensor([w.ids]))[0, w.score_from - 1:len(w.ids) - 1].float().log_softmax(-1)


class _LayerTap:
    """Forward hooks that keep each decoder layer's output of the last forward pass."""

    def __init__(self, model):
        self.outputs: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._hook) for layer in getattr(model, "layers", [])] \
            if model is not None else []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.outputs.clear()

    def _hook(self, module, inputs, output):
        self.outputs.append((output[0] if isinstance(output, tuple) else output).detach())


def chat_prompt_ids(tok, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as a chat request's tokens: the chat template with the generation prompt (raw
    text where the artifact has no template)."""
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if tok.chat_template else p for p in prompts]
    return [tok.encode(t) for t in texts]


def greedy_outputs(llm, prompts: Sequence[str] | Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations; text prompts go through the chat template when the artifact has one."""
    from infer.runtime import SamplingParams

    ids = chat_prompt_ids(llm.tokenizer, prompts) if prompts and isinstance(prompts[0], str) else [list(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.token_ids) for o in outs]


class BaselineMemo:
    """What a baseline computes on fixed inputs, kept in this process: candidates gated in turn against one
    baseline (pipeline/gate.py, choose_and_build) and the benchmark's rows against bfloat16 read the
    baseline's perplexity, greedy answers and answer distributions once. The engine is deterministic, so
    a kept value is the value a fresh computation gives (same model files, same inputs: the key)."""

    MAX_FLOATS = 400_000_000  # ~1.6 GB of float32: larger answer distributions are not kept
    _store: dict[str, dict] = {}
    _order: list[str] = []

    @classmethod
    def key(cls, identity, *inputs) -> str:
        import hashlib

        return hashlib.sha256(json.dumps([identity, *inputs], sort_keys=True, default=str).encode()).hexdigest()

    @classmethod
    def get(cls, key: str | None) -> dict | None:
        return None if key is None else cls._store.get(key)

    @classmethod
    def put(cls, key: str | None, value: dict) -> None:
        if key is None:
            return
        if key not in cls._store:
            cls._order.append(key)
        cls._store[key] = value
        while len(cls._order) > 2:  # two baselines at most (their chat distributions are ~0.3 GB each)
            cls._store.pop(cls._order.pop(0), None)

    @classmethod
    def clear(cls) -> None:
        cls._store.clear(), cls._order.clear()


def compare_on_chat(llm, base_llm, prompts: Sequence[str], max_tokens: int, memo_key: str | None = None,
                    reference: dict | None = None) -> dict:
    """Greedy agreement on chat prompts, then both models' next-token distributions over the
    baseline's answers: KL divergence and top-1 agreement where the user reads.

    ``memo_key`` (``BaselineMemo.key`` of the baseline's model identity): the baseline's answers and their
    distributions are computed once per process for it. ``reference``: the baseline's ``answers`` and
    ``logprobs``, computed earlier (``base_llm`` is then not needed)."""
    ids = chat_prompt_ids(llm.tokenizer, prompts)
    key = None if memo_key is None else BaselineMemo.key(memo_key, "chat", ids, max_tokens)
    kept = reference or BaselineMemo.get(key)
    ours = greedy_outputs(llm, ids, max_tokens)
    theirs = kept["answers"] if kept else greedy_outputs(base_llm, ids, max_tokens)
    out = greedy_agreement(ours, theirs)
    windows = [Window(p + a, len(p)) for p, a in zip(ids, theirs) if a]
    if windows:
        comp = compare_distributions(llm.engine.model, None if kept else base_llm.engine.model, windows,
                                     baseline_logprobs=kept["logprobs"] if kept else None,
                                     keep_baseline=key is not None and not kept)
        if not kept and "_baseline_logprobs" in comp:
            BaselineMemo.put(key, {"answers": theirs, "logprobs": comp["_baseline_logprobs"]})
        out.update(chat_tokens=comp["tokens"], chat_mean_kld=comp["mean_kld"], chat_p99_kld=comp["p99_kld"],
                   chat_max_kld=comp["max_kld"], chat_top1_agreement=comp["top1_agreement"],
                   chat_per_prompt=comp["per_window"])
    out["chat_template"] = bool(llm.tokenizer.chat_template)
    return out


def greedy_agreement(variant: Sequence[Sequence[int]], baseline: Sequence[Sequence[int]]) -> dict:
    scores, exact = [], []
    for a, b in zip(variant, baseline):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        longest = max(len(a), len(b))
        scores.append(n / longest if longest else 1.0)
        exact.append(list(a) == list(b))
    return {"prompts": len(scores), "greedy_agreement": float(np.mean(scores)) if scores else 1.0,
            "greedy_exact_match": float(np.mean(exact)) if exact else 1.0,
            "greedy_per_prompt": [round(x, 4) for x in scores]}


# ---------------------------------------------------------------------------- one evaluation

def artifact_summary(path: Path, manifest: dict) -> dict:
    files = manifest.get("files", {})
    weights = {k: v["sha256"] for k, v in files.items() if k.endswith(".safetensors") or k == CONFIG}
    return {"path": str(path), "name": manifest.get("name"), "version": manifest.get("version"),
            "model": manifest.get("model"), "quantization": manifest.get("quantization"),
            "recipe_quant": (manifest.get("recipe") or {}).get("quant"), "weights": weights}


def model_identity(manifest: dict) -> dict:
    """What decides an artifact's outputs: its model and tokenizer files' hashes (not its name or recipe)."""
    skip = {"eval.json", "report.md", "report.html"}
    return {k: v["sha256"] for k, v in (manifest.get("files") or {}).items()
            if k not in skip and not k.startswith("plots/")}


def artifact_result(llm, art, windows, data_info: dict, settings: EvalSettings, say) -> dict:
    """An evaluation's own part, whichever way the baseline runs: what was evaluated, on what, and its perplexity."""
    result: dict = {"eval_version": EVAL_VERSION, "settings": asdict(settings), "data": data_info,
                    "artifact": artifact_summary(art.path, art.manifest)}
    say("perplexity: %d windows, %d tokens scored", data_info["windows"], data_info["tokens_scored"])
    result["perplexity"] = engine_perplexity(llm, windows)
    return result


def add_ppl_increase(result: dict) -> None:
    """The comparison's perplexity increase over the baseline's, in percent."""
    p, pb = result["perplexity"]["ppl"], result["baseline_perplexity"]["ppl"]
    result["comparison"]["ppl_increase_pct"] = (p / pb - 1.0) * 100.0


def evaluate(artifact, baseline, settings: EvalSettings, log=None, memory_bytes: int | None = None) -> dict:
    """Every metric for one artifact (and against a baseline when given), as plain JSON-able data.

    ``artifact``, ``baseline``: verified Artifacts, as the CLI and the gate stage pass them (a path
    is verified here). Both models are loaded together when their weights fit in ``memory_bytes``
    (None: ``weight_budget()``, the build's default rule); otherwise the baseline runs first, alone (``_evaluate_apart``)."""
    from infer.runtime.artifact import Artifact, verify_artifact

    settings.check()
    say = log or (lambda *a: None)
    art = artifact if isinstance(artifact, Artifact) else verify_artifact(artifact)
    if baseline is not None and not isinstance(baseline, Artifact):
        baseline = verify_artifact(baseline)
    same = baseline is not None and baseline.path.resolve() == art.path.resolve()
    base = baseline if baseline is not None and not same else None
    max_len = max(settings.seq_len, 512) + settings.greedy_tokens
    if base is not None:
        sizes = weights_bytes(art.path), weights_bytes(base.path)
        budget = weight_budget() if memory_bytes is None else memory_bytes
        if sum(sizes) > budget:
            say("the two models' weights (%.1f + %.1f GiB) exceed %.1f GiB: the baseline runs first, alone, and its "
                "distributions wait on disk", sizes[0] / 2**30, sizes[1] / 2**30, budget / 2**30)
            return _evaluate_apart(art, base, settings, max_len, say)
    llm = open_llm(art, max_len)
    windows, data_info = load_windows(llm.tokenizer, settings)
    result = artifact_result(llm, art, windows, data_info, settings, say)
    prompts = load_prompts(settings.prompts, settings.max_prompts) if baseline is not None else []
    if baseline is not None:
        if same:
            result["baseline"] = {**result["artifact"], "same_as_artifact": True}
            result["baseline_perplexity"] = dict(result["perplexity"])
            result["comparison"] = {"tokens": data_info["tokens_scored"], "mean_kld": 0.0, "median_kld": 0.0,
                                    "p90_kld": 0.0, "p99_kld": 0.0, "max_kld": 0.0, "top1_agreement": 1.0,
                                    "ln_ppl_ratio": 0.0, "rms_delta_p": 0.0, "mean_delta_p": 0.0,
                                    "prompts": len(prompts), "greedy_agreement": 1.0, "greedy_exact_match": 1.0,
                                    "chat_mean_kld": 0.0, "chat_top1_agreement": 1.0}
        else:
            base_llm = open_llm(base, max_len)
            if base_llm.tokenizer.encode("Hello, world! 123") != llm.tokenizer.encode("Hello, world! 123"):
                raise EvalError(f"{base.path}: its tokenizer differs from {art.path}'s; a baseline must share it")
            result["baseline"] = artifact_summary(base.path, base.manifest)
            identity = model_identity(base.manifest)
            ppl_key = BaselineMemo.key(identity, "perplexity", [(w.ids, w.score_from) for w in windows])
            kept = BaselineMemo.get(ppl_key)
            say("baseline perplexity" + (" (kept from an earlier evaluation in this process)" if kept else ""))
            result["baseline_perplexity"] = dict(kept) if kept else engine_perplexity(base_llm, windows)
            if not kept:
                BaselineMemo.put(ppl_key, result["baseline_perplexity"])
            say("KL divergence and top-1 agreement against the baseline")
            comp = compare_distributions(llm.engine.model, base_llm.engine.model, windows)
            if prompts:
                say("chat prompts: greedy agreement, KL divergence and top-1 agreement on %d prompts", len(prompts))
                comp.update(compare_on_chat(llm, base_llm, prompts, settings.greedy_tokens, memo_key=identity))
            result["comparison"] = comp
            del base_llm
        add_ppl_increase(result)
    if settings.tasks:
        from .lm_adapter import run_tasks

        say("lm-eval tasks: %s", ", ".join(settings.tasks))
        result["tasks"] = run_tasks(llm, settings.tasks, limit=settings.task_limit)
        if base is not None:
            result["baseline_tasks"] = run_tasks(open_llm(base, max_len), settings.tasks, limit=settings.task_limit)
    return result


# ---------------------------------------------------------------------------- a baseline too large to sit beside

PROBE_TEXT = "Hello, world! 123"


def weights_bytes(path: Path) -> int:
    """Bytes of an artifact's weight files (what loading it holds in memory, about)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))


def logprobs_on_disk(model, windows: Sequence[Window], path: Path) -> list[torch.Tensor]:
    """The model's log-softmax rows for each window's scored positions, float32, in a file at ``path``
    (read back through a memory map: page cache, not the process's memory)."""
    if not windows:
        return []
    ends = np.cumsum([len(w.ids) - w.score_from for w in windows]).tolist()
    store = None
    for w, start, end in zip(windows, [0] + ends, ends):
        lp = window_logprobs(model, w)
        if store is None:
            store = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(ends[-1], lp.shape[-1]))
        store[start:end] = lp.numpy()
    store.flush()
    del store
    kept = np.load(path, mmap_mode="c")  # copy-on-write: torch wants a writable array, nothing writes it
    return [torch.from_numpy(kept[start:end]) for start, end in zip([0] + ends, ends)]


def _evaluate_apart(art, base, settings: EvalSettings, max_len: int, say) -> dict:
    """``evaluate`` against a baseline that cannot be loaded beside the artifact (a 15 GB bfloat16 7B
    beside its 5 GB int4 build): the baseline alone first (perplexity, its greedy answers, its full
    distributions on every window and answer, written to a temporary file), then the artifact alone,
    compared against what was kept. The same metrics, except the per-layer hidden-state error, which
    needs both models' layers at once (``layer_hidden_error`` is None)."""
    import gc
    import tempfile

    with tempfile.TemporaryDirectory(prefix="infer-eval-baseline-") as scratch:
        say("baseline %s alone: perplexity, answers and distributions", base.path)
        base_llm = open_llm(base, max_len)
        windows, data_info = load_windows(base_llm.tokenizer, settings)
        probe = base_llm.tokenizer.encode(PROBE_TEXT)
        base_ppl = engine_perplexity(base_llm, windows)
        base_lps = logprobs_on_disk(base_llm.engine.model, windows, Path(scratch) / "windows.npy")
        prompts = load_prompts(settings.prompts, settings.max_prompts)
        ids = chat_prompt_ids(base_llm.tokenizer, prompts)
        answers = greedy_outputs(base_llm, ids, settings.greedy_tokens) if prompts else []
        chat_windows = [Window(p + a, len(p)) for p, a in zip(ids, answers) if a]
        chat_lps = logprobs_on_disk(base_llm.engine.model, chat_windows, Path(scratch) / "chat.npy")
        base_tasks = None
        if settings.tasks:
            from .lm_adapter import run_tasks

            base_tasks = run_tasks(base_llm, settings.tasks, limit=settings.task_limit)
        del base_llm
        gc.collect()

        say("artifact %s alone", art.path)
        llm = open_llm(art, max_len)
        if llm.tokenizer.encode(PROBE_TEXT) != probe:
            raise EvalError(f"{base.path}: its tokenizer differs from {art.path}'s; a baseline must share it")
        result = artifact_result(llm, art, windows, data_info, settings, say)
        result["baseline"] = artifact_summary(base.path, base.manifest)
        result["baseline_perplexity"] = base_ppl
        say("KL divergence and top-1 agreement against the baseline's kept distributions")
        comp = compare_distributions(llm.engine.model, None, windows, baseline_logprobs=base_lps)
        if prompts:
            say("chat prompts: greedy agreement, KL divergence and top-1 agreement on %d prompts", len(prompts))
            comp.update(compare_on_chat(llm, None, prompts, settings.greedy_tokens,
                                        reference={"answers": answers, "logprobs": chat_lps}))
        result["comparison"] = comp
        add_ppl_increase(result)
        if settings.tasks:
            from .lm_adapter import run_tasks

            say("lm-eval tasks: %s", ", ".join(settings.tasks))
            result["tasks"] = run_tasks(llm, settings.tasks, limit=settings.task_limit)
            result["baseline_tasks"] = base_tasks
        del base_lps, chat_lps  # the memory maps, before their directory goes
        return result
