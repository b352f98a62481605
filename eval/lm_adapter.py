"""An lm-eval ``LM`` over the engine, so any lm-eval task scores the artifact with the serving code.

``loglikelihood`` and ``loglikelihood_rolling`` read the engine's ``prompt_logprobs``;
``generate_until`` runs the engine's sampler (greedy unless the task asks to sample) with the
task's stop strings. The local tasks in ``eval/tasks/`` need no network.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

TASKS_DIR = Path(__file__).parent / "tasks"
LOCAL_TASKS = ("infer_lastword", "infer_mc")


class InferLM(TemplateLM):
    """``lm_eval`` model backed by an ``infer.runtime.LLM`` (an artifact, verified on load)."""

    def __init__(self, llm, max_length: int | None = None, batch_size: int = 16):
        super().__init__()
        self.llm = llm
        self.tok = llm.tokenizer
        limit = llm.engine.max_request_tokens - 1
        self.max_length = min(max_length or 2048, limit)
        self.batch_size = batch_size

    @classmethod
    def from_artifact(cls, path, **kwargs) -> "InferLM":
        from .runner import open_llm

        return cls(open_llm(path, kwargs.pop("max_length", 2048)), **kwargs)

    # -- tokenization
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tok.bos_token
        bos_id = self.tok._tok.token_to_id(bos) if bos else None
        return bos_id if bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.engine.artifact.path)

    # -- scoring
    def _score(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether every continuation token was the argmax."""
        from infer.runtime import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        prompts, spans = [], []
        for ctx, cont in items:
            if not cont:
                raise ValueError("an empty continuation cannot be scored")
            whole = (ctx + cont)[-(self.max_length + 1):]
            prompts.append(whole)
            spans.append(len(whole) - len(cont))
        results = []
        for i in range(0, len(prompts), self.batch_size):
            outs = self.llm.generate(prompts[i:i + self.batch_size], params)
            for out, first in zip(outs, spans[i:i + self.batch_size]):
                lps = out.prompt_logprobs[first:]
                total = sum(lp["logprob"] for lp in lps)
                greedy = all(lp["top"] and lp["top"][0][0] == lp["token_id"] for lp in lps)
                results.append((total, greedy))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not sys.stderr.isatty())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from infer.runtime import SamplingParams

        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(kwargs.pop("max_gen_toks", 256))
            sample = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_tokens):]
            prompts.append(ids)
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                         top_p=float(kwargs.pop("top_p", 1.0)) if sample else 1.0,
                                         seed=kwargs.pop("seed", None) if sample else None,
                                         stop=[s for s in until if s]))
        texts = []
        for i in range(0, len(prompts), self.batch_size):
            outs = self.llm.generate(prompts[i:i + self.batch_size], params[i:i + self.batch_size])
            for req, out in zip(requests[i:i + self.batch_size], outs):
                self.cache_hook.add_partial("generate_until", req.args, out.text)
                texts.append(out.text)
        return texts


@contextmanager
def _quiet_unless_terminal():
    """Off a terminal (CI), no progress bars and no chatter from lm-eval: warnings and errors only."""
    if sys.stderr.isatty():
        yield
        return
    import tqdm

    logger = logging.getLogger("lm_eval")
    level, original = logger.level, tqdm.tqdm.__init__
    tqdm.tqdm.__init__ = functools.partialmethod(original, disable=True)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tqdm.tqdm.__init__ = original
        logger.setLevel(level)


def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def run_tasks(llm_or_path, tasks: list[str], limit: int | None = None, log_samples: bool = False) -> dict:
    """Runs lm-eval tasks on the engine; the task's metrics by task name (plain floats)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks need no network; others use the HF cache
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval

    lm = llm_or_path if isinstance(llm_or_path, InferLM) else (
        InferLM.from_artifact(llm_or_path) if isinstance(llm_or_path, (str, Path)) else InferLM(llm_or_path))
    with _quiet_unless_terminal():
        res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager(), limit=limit,
                                      log_samples=log_samples, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                      torch_random_seed=0, fewshot_random_seed=0)
    out = {}
    for name, metrics in (res or {}).get("results", {}).items():
        out[name] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k}
    return out
