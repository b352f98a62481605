"""The offline API: ``LLM(artifact).generate(prompts, params)``."""

from __future__ import annotations

from itertools import count

from tqdm import tqdm

from .engine import EngineConfig, LLMEngine, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, artifact, config: EngineConfig | None = None, **engine_args):
        """``artifact``: a path, or an Artifact already verified; ``config`` or keyword arguments: EngineConfig
        (e.g. ``kv_cache_dtype="int8"``: the quantized KV cache; "auto", the default, follows the artifact)."""
        self.engine = LLMEngine(artifact, config or EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order.

        Bad prompts or parameters raise ValueError, naming the field, before anything is queued. A
        request the engine fails on while generating comes back finished with
        ``finish_reason == "error"`` and ``error`` saying why; the other prompts are unaffected.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, per_prompt):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:  # a bad prompt in the list leaves nothing half-queued behind
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        except BaseException:  # an engine-wide fault (or Ctrl-C): leave the engine empty and usable
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def close(self) -> None:
        """Stops a sharded artifact's other ranks (also done at exit); the LLM cannot generate after."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], params)[0]
