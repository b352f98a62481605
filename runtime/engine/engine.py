"""The engine: requests in, one scheduled forward pass per ``step()``, tokens and text out.

It ties the pieces together: an artifact verified on load, the scheduler and block manager
deciding what runs, the model runner executing it, the sampler choosing tokens, and per-request
detokenization with stop strings. It is synchronous; a server drives ``step()`` from its own loop.

One request cannot fail another: parameters are checked when a request is added, and a fault
during a step that belongs to one sequence (its rows of the forward pass, its sampling, its
detokenization or stop strings) finishes that request alone with ``finish_reason="error"`` and
``RequestOutput.error`` saying why, its KV blocks freed; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from infer.kernels.resolver import resolve, resolve_device

from ..artifact import CONFIG, TOKENIZER, Artifact, verify_artifact
from ..memory import available_memory
from .block_manager import BLOCK_SIZE, BlockManager
from ..model import ModelConfig, load_model
from ..parallel import tensor_parallel_size
from .model_runner import ModelRunner, StepOutput, graph_buckets_for, kv_bytes_per_block
from .plan import kv_cache_dtype, sliding_window
from .sampler import sample, token_logprobs, verify_draft
from .sampling_params import SamplingParams
from .scheduler import Fairness, ScheduledBatch, Scheduler
from .sequence import Sequence, Status
from .speculative import NgramProposer, SpeculativeConfig, eligible
from .structured import Constraint, Grammars, MaskFiller
from .step_record import StepRecord, new_step_records
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("infer.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


BURST_SECONDS = 0.05  # the longest a decode burst runs (at the measured decode step time), so a request arriving meanwhile waits no longer


@dataclass
class EngineConfig:
    dtype: str | None = None  # compute dtype; None: the artifact's
    block_size: int = BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes; None: a fraction of available RAM (of free GPU memory on cuda)
    kv_cache_fraction: float = 0.2
    kv_cache_dtype: str = "auto"  # auto (the artifact's manifest, else the model's dtype) | bfloat16 | int8 (runtime/engine/plan.py)
    # auto | decode-rows: prompt rows attend as decode rows on a 16-bit cache too, as an int8 cache's always do (a
    # like-for-like reference for measuring the int8 format: runtime/engine/plan.py make_plan)
    prompt_rows: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    # waiting prompts stop joining a step once its prompt tokens reach this (0: the budget alone)
    prefill_batch_tokens: int = 128
    max_model_len: int | None = None  # None: the model's
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # auto | cpp (compiled CPU kernels) | torch (plain torch ops: gather + SDPA, unfused norm/rotary);
    # amx: None where the CPU has AMX, False never (the non-AMX path), True required (infer.kernels.resolver)
    kernels: str = "auto"
    amx: bool | None = None
    # auto: the artifact's tuning.json where it was measured on this hardware | off | a table's path
    tuning: str = "auto"
    # auto (cuda when torch sees a GPU, else cpu) | cpu | cuda: where the model, KV cache and sampler run
    device: str = "auto"
    # on cuda with the triton kernels: decode steps replay a CUDA graph per batch bucket (False: eager)
    cuda_graphs: bool = True
    # speculative decoding: auto (the artifact's manifest serving.speculative, else off) | off | ngram (prompt
    # lookup; runtime/engine/speculative.py) | draft (a draft artifact: speculative_draft); k tokens a step. The
    # three below: None takes the artifact's value, else the default in the comment
    speculative: str = "auto"
    num_speculative_tokens: int | None = None  # the most a step drafts (8)
    speculative_adaptive: bool | None = None  # k per step from the sequence's acceptance (speculative.draft_length; True)
    speculative_verify_cost: float | None = None  # a verify row's cost in decode steps, which that choice weighs (measured)
    # speculative=draft: the draft artifact (the target's tokenizer; runtime/engine/draft_model.py) and its KV cache
    speculative_draft: str | None = None
    speculative_draft_memory: int = 256 << 20
    # tenancy: tenants' weights and running caps, the per-step prompt budget (infer-run --tenants; None: one tenant)
    fairness: Fairness | None = None
    # decode bursts: a step of plain decodes (greedy, or sampled by temperature, top-k, top-p, min-p alone) with nothing
    # waiting runs up to this many decode steps back to back (and at most BURST_SECONDS of them), without the
    # scheduler and the Python sampler between them (LLMEngine._burst); 1: off
    decode_burst: int = 8


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (then ``error`` says why)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    error_by_request: bool = False  # the request's own parameters caused ``error`` (a client error, not a fault)


class _Request:
    """Per-request text state: detokenizer, stop-string search, what was already emitted."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[:seq.num_prompt_tokens])
        self.text = ""
        self.emitted_text = 0
        self.emitted_tokens = 0
        self.error: str | None = None
        self.error_by_request = False
        self.max_stop = max((len(s) for s in seq.params.stop), default=0)

    def add_token(self, token_id: int) -> bool:
        """Appends a generated token's text; True when a stop string completed (text cut before it)."""
        self.text += self.detok.add(token_id)
        if not self.max_stop:
            return False
        window = len(self.text) - self.max_stop - 32
        for stop in self.seq.params.stop:
            at = self.text.find(stop, max(0, window))
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def holdback(self) -> int:
        """Characters at the end that might begin a stop string: not streamed until resolved."""
        for k in range(min(self.max_stop, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.seq.params.stop):
                return k
        return 0


def isolate(run, items: list) -> tuple[list[tuple[list, object]], list[tuple[object, Exception]]]:
    """``run(items)``; when it raises, each half again, down to single items, so that a fault one
    item causes fails that item alone. Returns ``([(part, run(part)), ...], [(item, exception), ...])``.
    A fault that every item hits alone fails them all (an engine-wide bug)."""
    try:
        return [(items, run(items))], []
    except Exception as e:
        if len(items) == 1:
            return [], [(items[0], e)]
        log.warning("%s failed on %d sequences (%s: %s); retrying in halves to find the culprit",
                    getattr(run, "__name__", "step"), len(items), type(e).__name__, e)
    mid = len(items) // 2
    ok_a, bad_a = isolate(run, items[:mid])
    ok_b, bad_b = isolate(run, items[mid:])
    return ok_a + ok_b, bad_a + bad_b


def _describe(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 300 else text[:297] + "..."


def load_tuning(artifact: Artifact, setting: str):
    """The tuning table the engine follows: the artifact's own (``auto``, when listed in its manifest),
    a given file, or none (``off``); a table measured on other hardware is ignored with a warning."""
    from ..artifact import TUNING
    from ..tuning import Tuning

    if setting == "off":
        return None
    if setting == "auto":
        if TUNING not in artifact.manifest.get("files", {}):
            return None
        path = artifact.path / TUNING
    else:
        path = Path(setting).expanduser()
    table = Tuning.load(path)
    if not table.matches_here(str(path)):
        return None
    changed = table.changed()
    log.info("tuning %s: %s", path, "; ".join(changed) if changed else "the defaults were measured best")
    return table


def for_dtype(table, dtype: torch.dtype):
    """The table where it was measured in the dtype the model runs in, else None with one warning: a float32
    artifact's table (the default build) timed float32 decode steps, which say nothing of a bfloat16 engine's
    kernels (its linear shapes are keyed by dtype and were never timed; decode attention's alternatives differ)."""
    measured = None if table is None else table.table.get("dtype")
    running = str(dtype).removeprefix("torch.")
    if measured is None or measured == running:
        return table
    log.warning("tuning table measured in %s, the model runs in %s: using the default kernels; infer-run ART "
                "--dtype %s --retune measures them", measured, running, running)
    return None


class LLMEngine:
    def __init__(self, artifact: Artifact | str | os.PathLike, config: EngineConfig | None = None, **overrides):
        """``artifact``: a verified Artifact (as the CLI, the server and eval pass it), or a path to verify."""
        self.config = config or EngineConfig(**overrides)
        cfg = self.config
        self.device = resolve_device(cfg.device)  # first: --device cuda without a GPU fails before any loading
        self.artifact = artifact if isinstance(artifact, Artifact) else verify_artifact(artifact)
        verified = time.perf_counter()  # here or by the caller: the artifact says how long it took
        self.tokenizer = Tokenizer(self.artifact.path, self.artifact.config)
        if cfg.dtype is not None and cfg.dtype not in _DTYPES:
            raise ValueError(f"dtype={cfg.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if not isinstance(cfg.decode_burst, int) or cfg.decode_burst < 1:
            raise ValueError(f"decode_burst={cfg.decode_burst!r}: the most decode steps a burst runs, at least 1 (1: off)")
        dtype = _DTYPES.get(cfg.dtype) if cfg.dtype else None
        mcfg = ModelConfig.from_hf(self.artifact.config)
        # the dtype the model will run in decides the kernels; load_model settles the artifact's default
        self.tuning = load_tuning(self.artifact, cfg.tuning)
        tp = tensor_parallel_size(self.artifact)
        self.ranks = None  # a sharded artifact: the other ranks load their slices meanwhile (runtime/parallel)
        if tp > 1 and self.device.type != "cpu":  # tensor parallelism runs on the CPU (gloo): auto means cpu here
            if cfg.device == "cuda":
                raise ValueError(f"a tensor-parallel artifact (tp={tp}) runs on the CPU over gloo: use --device cpu")
            self.device = torch.device("cpu")
        if tp > 1:
            from ..parallel.runner import RankGroup

            self.ranks = RankGroup.start(self.artifact, cfg)
        on = {} if self.ranks else {"device": self.device}
        self.model = (self.ranks.load_model if self.ranks else load_model)(self.artifact.path, dtype, lambda d: resolve(
            cfg.kernels, amx=cfg.amx, dtype=d, head_dim=mcfg.head_dim, block_size=cfg.block_size, device=self.device),
            hf_config=self.artifact.config, files=self.artifact.weight_files(), tuning=self.tuning, **on)
        self.kernels = self.model.kernels
        self.tuning = for_dtype(self.tuning, self.model.dtype)
        loaded = time.perf_counter()
        model_len = mcfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or model_len, model_len)
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.artifact.kv_cache_dtype, self.model.dtype, self.kernels)
        per_block = kv_bytes_per_block(self.model, cfg.block_size, self.kv_dtype) * tp  # a rank holds 1/tp of it
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else available_memory()
        budget = cfg.kv_cache_memory or int(free * cfg.kv_cache_fraction)
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={budget} bytes holds {num_blocks} blocks of {per_block} bytes; "
                             f"give the KV cache more memory")
        self.num_blocks = num_blocks
        window, windowed = sliding_window(mcfg)
        # blocks leave a sequence as its window slides only when every layer slides (a full layer reads them all)
        self.window = window if windowed is not None and all(windowed) else None
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          model_id=self.artifact.manifest["files"][CONFIG]["sha256"],
                                          window=self.window)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, cfg.prefill_batch_tokens, cfg.fairness)
        if not self.ranks:  # decode graphs are captured now, after the model, its kernels and the tuning are settled
            on["graph_buckets"] = graph_buckets_for(self.device, self.kernels.backend, cfg.cuda_graphs, cfg.max_num_seqs)
        on["kv_dtype"], on["prompt_rows"] = self.kv_dtype, cfg.prompt_rows
        self.runner = (self.ranks.runner if self.ranks else ModelRunner)(self.model, num_blocks, cfg.block_size,
                                                                        self.kernels, self.tuning, **on)
        self.plan = self.runner.plan  # what runs: the load log, /version and the benchmarks print it
        log.info("ready in %.1fs: files verified %.1fs, weights read and packed %.1fs, KV cache (%d blocks, %.2f GiB) "
                 "and step %.1fs", self.artifact.verify_seconds + time.perf_counter() - verified,
                 self.artifact.verify_seconds, loaded - verified, num_blocks, num_blocks * per_block / 2**30,
                 time.perf_counter() - loaded)
        log.info("plan: %s", self.plan.describe())
        self.requests: dict[str, _Request] = {}
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        # structured output: grammars compiled for this vocabulary (lazily: xgrammar loads on first use)
        self.grammars = Grammars(self.artifact.path / TOKENIZER, self.model.config.vocab_size,
                                 sorted(self.eos_token_ids))
        self.mask_filler = MaskFiller()
        # each setting given here wins over what the build stated; what neither says is SpeculativeConfig's default
        given = {"method": None if cfg.speculative == "auto" else cfg.speculative,
                 "num_tokens": cfg.num_speculative_tokens, "adaptive": cfg.speculative_adaptive,
                 "verify_cost": cfg.speculative_verify_cost}
        settings = {k: v for k, v in self.artifact.speculative.items() if k in given}
        settings.update((k, v) for k, v in given.items() if v is not None)
        spec = SpeculativeConfig(**settings)
        self.proposer = None
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec)
        elif spec.method == "draft":
            if not cfg.speculative_draft:
                raise ValueError("speculative=draft needs a draft artifact: speculative_draft=DIR (infer-run "
                                 "--speculative-draft DIR), a smaller model built with the target's tokenizer")
            from .draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(spec, cfg.speculative_draft, self.artifact, self.model.dtype, lambda d, head_dim:
                                               resolve(cfg.kernels, amx=cfg.amx, dtype=d, head_dim=head_dim,
                                                       block_size=cfg.block_size, device=self.device),
                                               cfg.block_size, cfg.speculative_draft_memory, self.device)
        elif cfg.speculative_draft:
            raise ValueError(f"speculative_draft={cfg.speculative_draft!r} is read with speculative=draft only "
                             f"(speculative={spec.method!r})")
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                      "spec_steps": 0, "spec_drafted": 0, "spec_accepted": 0, "spec_emitted": 0}

    # ------------------------------------------------------------------ requests
    @property
    def max_request_tokens(self) -> int:
        """Longest sequence (prompt + output) the model and the KV cache can hold. With a sliding window on
        every layer a sequence holds at most its window, a step's chunk and two part-filled blocks at once."""
        cache = self.num_blocks * self.config.block_size
        if self.window is not None and cache >= self.window + self.config.max_num_batched_tokens + 2 * self.config.block_size:
            return self.max_model_len
        return min(self.max_model_len, cache)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, tenant: str = "") -> Sequence:
        """Queues a request; ValueError naming the problem when its prompt or parameters are out of
        bounds (checked again here, against this model's vocabulary, since params are mutable).
        ``priority``: lower runs first; ``tenant``: whose fair share it draws on (scheduler.py)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, not {type(params).__name__}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, not {type(request_id).__name__}")
        params.validate(self.model.config.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) >= self.max_request_tokens:
            raise ValueError(f"prompt is {len(ids)} tokens, over this engine's context limit of "
                             f"{self.max_request_tokens} (prompt and output together); shorten the prompt")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, not {type(priority).__name__}")
        seq = Sequence(request_id, ids, params, prompt if isinstance(prompt, str) else None, priority, str(tenant))
        if params.structured is not None:  # the server compiled it already, off this thread
            seq.constraint = Constraint(self.grammars.compile(params.structured).compiled, self.model.config.vocab_size)
        self.requests[request_id] = _Request(seq, self.tokenizer)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.seq.is_finished:
            return None
        self.scheduler.abort(req.seq)
        req.seq.finish_reason = "abort"
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping
    @cached_property
    def step_records(self):
        """The last steps' timings and shapes (StepRecord, newest last): where engine time goes."""
        return new_step_records()

    def step(self) -> list[RequestOutput]:
        """One forward pass over what the scheduler picked; outputs of requests that advanced.

        What fails for one sequence ends that request alone (finish_reason "error"): a forward pass
        that raises is run again on halves of the batch until the sequences that fail alone are
        found, sampling likewise, and a row with non-finite logits or a detokenizer/stop-string
        fault fails its own request. Only scheduling itself can raise out of here, leaving the
        engine consistent: the caller may abort its requests and go on.
        """
        wall, t_start = time.time(), time.perf_counter()
        if self.proposer is not None:
            self._draft()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        now = time.monotonic()
        prefill_tokens = prefill_seqs = decode_rows = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if seq.runs_as_decode(n):
                decode_rows += n
            else:
                prefill_seqs += 1
                prefill_tokens += n
        burst = self._burst(batch, t_start, wall) if not prefill_seqs else None
        if burst is not None:
            return burst
        # grammar masks of the rows that sample this step, filled while the forward runs
        masks = self.mask_filler.start([s for s, n in zip(batch.seqs, batch.num_tokens)
                                        if s.num_computed_tokens + n >= len(s)])
        t_model = time.perf_counter()

        def forward(part: list[tuple[Sequence, int]]) -> StepOutput:
            return self.runner.execute(ScheduledBatch([s for s, _ in part], [n for _, n in part], []))

        ran, failed = isolate(forward, list(zip(batch.seqs, batch.num_tokens)))
        self.stats["steps"] += 1
        outputs = [self._fail(seq, f"the forward pass failed on this request: {_describe(e)}")
                   for (seq, _), e in failed]
        to_sample, rows, verify = [], [], []
        for part, result in ran:
            for seq, n in part:
                try:
                    self._advance(seq, n, result)
                except Exception as e:
                    outputs.append(self._fail(seq, f"recording this request's step failed: {_describe(e)}"))
            keep, first = [], 0
            for seq in result.sampled:  # a sequence with a draft has a row for each draft token too
                count = 1 + len(seq.spec.draft)
                if not seq.is_finished:
                    if count > 1:
                        verify.append((seq, result.logits[first:first + count]))
                    else:
                        keep.append(first)
                        to_sample.append(seq)
                first += count
            if keep:
                rows.append(result.logits if len(keep) == result.logits.shape[0] else result.logits[keep])
        if masks is not None:
            try:
                masks.result()
            except Exception:  # the sampler fills that row again and fails it alone
                pass
        t_sample = self._sampled_at = time.perf_counter()
        if to_sample:
            outputs += self._sample(rows[0] if len(rows) == 1 else torch.cat(rows), to_sample)
        for seq, logits in verify:
            try:
                outputs.append(self._verify(seq, logits))
            except Exception as e:
                outputs.append(self._fail(seq, f"verifying this request's draft failed: {_describe(e)}"))
        if self.proposer is not None:  # a draft model's copies of sequences that stopped running, given back
            self.proposer.keep_only(self.scheduler.running)
        t_end = time.perf_counter()
        self.scheduler.observe(t_end - t_start, prefill_tokens, decode_rows)
        if self.proposer is not None and not prefill_tokens:  # a verify row's cost, measured (speculative.VerifyCost)
            self.proposer.cost.observe(decode_rows, t_sample - t_model)
        self.step_records.append(StepRecord(
            step=self.stats["steps"], t=wall, schedule_ms=(t_model - t_start) * 1e3,
            model_ms=(t_sample - t_model) * 1e3, sample_ms=(self._sampled_at - t_sample) * 1e3,
            output_ms=(t_end - self._sampled_at) * 1e3, prefill_tokens=prefill_tokens, prefill_seqs=prefill_seqs,
            decode_rows=decode_rows, batched_tokens=batch.total_tokens, waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running)))
        return outputs

    def _burst(self, batch, t_start: float, wall: float) -> list[RequestOutput] | None:
        """A decode-only step as a burst of up to ``decode_burst`` steps (ModelRunner.run_burst), where nothing else
        would differ between them: no request waiting to join, no speculation, and every sequence's token its argmax
        or (with the plan's draw kernel) its draw from temperature, top-k, top-p and min-p, with nothing else that
        moves or reads its logits (no penalties, bias, allowed tokens, grammar or logprobs): a sampled row's uniforms
        are drawn before the burst as single steps would draw them (_burst_draws). Between single steps, the
        scheduler, the sampler and output processing cost a batch-1 step of the embedded model 0.5-0.8 ms, run after
        the step's weights have pushed their code and data out of the caches (bursts: W4A16 3.40 against 3.87 ms a
        token, bfloat16 8.75 against 9.54, Zen 5; docs/serving.md). The tokens are the steps' own (same kernels, same
        argmax or draw) and go through the same stop checks, one at a time; a sequence that stops ends the burst
        after that step. None: the step runs as one step (also when
        the burst computed nothing to keep)."""
        seqs = batch.seqs
        # without a proposer no sequence holds a draft; a row the burst cannot choose for is checked first
        if (self.config.decode_burst < 2 or self.proposer is not None or self.scheduler.waiting
                or not all(self._bursts(s, self.plan.draw_kernel is not None) for s in seqs)
                or not all(n == 1 and s.runs_as_decode(1) for s, n in zip(seqs, batch.num_tokens))
                or not self.runner.bursts(len(seqs))):
            return None
        # a request arriving meanwhile waits for the burst to end: at most BURST_SECONDS at the measured step time
        step_s = self.scheduler.step_cost.decode_s
        most = self.config.decode_burst if not step_s else min(self.config.decode_burst, int(BURST_SECONDS / step_s))
        steps = min([most] + [min(s.params.max_tokens - s.num_output_tokens, self.max_request_tokens - len(s))
                              for s in seqs])
        if steps < 2 or not self.scheduler.reserve(seqs, steps - 1):
            return None
        stops = [set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else self.eos_token_ids) for s in seqs]
        draws, states = self._burst_draws(seqs, steps)
        t_model = time.perf_counter()
        try:
            tokens = self.runner.run_burst(seqs, steps, stops, draws)
        except Exception as e:  # the single step runs it again and fails what fails there alone
            log.warning("a decode burst failed (%s); running the step alone", _describe(e))
            tokens = []
        for seq, state in states:  # a seeded row's generator moves by the steps that used its draws only
            seq.generator.set_state(state)
            for _ in tokens:
                torch.rand(1, generator=seq.generator)
        if not tokens:
            return None
        t_sample = time.perf_counter()
        self.stats["steps"] += len(tokens)
        now, outputs = time.monotonic(), []
        for r, seq in enumerate(seqs):
            req = self.requests[seq.request_id]
            try:
                for made, step in enumerate(tokens):
                    if made:  # the scheduler charged this step's first token
                        self.scheduler.charge(seq, 1)
                    seq.num_computed_tokens += 1  # the token this step read is in the cache now
                    self.block_manager.register_full_blocks(seq)
                    self._append(seq, step[r], None, now, output=False)
                    if seq.is_finished:
                        break
                outputs.append(self._output(req))
            except Exception as e:
                outputs.append(self._fail(seq, f"detokenizing or checking stop conditions failed: {_describe(e)}"))
        t_end = time.perf_counter()
        per_step = (t_end - t_start) / len(tokens)
        for _ in tokens:
            self.scheduler.observe(per_step, 0, len(seqs))
        self.step_records.append(StepRecord(
            step=self.stats["steps"], t=wall, schedule_ms=(t_model - t_start) * 1e3,
            model_ms=(t_sample - t_model) * 1e3, sample_ms=0.0, output_ms=(t_end - t_sample) * 1e3,
            prefill_tokens=0, prefill_seqs=0, decode_rows=len(seqs) * len(tokens), batched_tokens=len(seqs) * len(tokens),
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running)))
        return outputs

    @staticmethod
    def _bursts(seq: Sequence, draws: bool) -> bool:
        """Whether this sequence's next tokens are its greedy argmax alone or (``draws``: the plan has the sampler's
        draw kernel) the draw from its temperature, top-k, top-p and min-p alone, with nothing per token but stop
        checks: no penalties, bias, allowed tokens, grammar or logprobs."""
        p = seq.params
        return ((p.argmax_decides or (draws and not p.greedy and not p.penalized)) and p.logprobs is None
                and not p.logit_bias and p.allowed_token_ids is None and seq.constraint is None)

    @staticmethod
    def _burst_draws(seqs: list[Sequence], steps: int) -> tuple[torch.Tensor | None, list]:
        """A burst's uniforms, [steps, rows], the ones single steps would draw (the sampler's _uniforms: a seeded
        row's from its own generator, one a step), or None where every row is greedy; and each seeded row's
        generator state before them, which the burst rewinds to and then moves by the steps it ran."""
        if all(s.params.greedy for s in seqs):
            return None, []
        draws = torch.rand(steps, len(seqs))
        states = []
        for r, seq in enumerate(seqs):
            if seq.generator is not None and not seq.params.greedy:
                states.append((seq, seq.generator.get_state()))
                for step in range(steps):
                    draws[step, r] = torch.rand(1, generator=seq.generator)
        return draws, states

    def _advance(self, seq: Sequence, n: int, result: StepOutput) -> None:
        """Marks ``n`` more tokens of ``seq`` computed: prompt logprobs, counters, the prefix cache."""
        computed = seq.num_computed_tokens
        if seq.seq_id in result.prompt_logits:
            self._record_prompt_logprobs(seq, *result.prompt_logits[seq.seq_id])
        self.stats["prompt_tokens"] += max(0, min(computed + n, seq.num_prompt_tokens) - computed)
        seq.num_computed_tokens = computed + n
        if not seq.spec.draft:  # a draft's tokens are hashed (and a window slid) only once verified (_verify)
            self.block_manager.register_full_blocks(seq)
            self.block_manager.slide(seq)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[RequestOutput]:
        """Chooses each sequence's next token; a row the sampler fails on fails its own request.

        Seeded generators are rewound before every try, so a retry draws what the first try would have.
        """
        states = {s.seq_id: s.generator.get_state() for s in seqs if s.generator is not None}

        def sampling(rows: list[int]):
            for i in rows:
                if seqs[i].generator is not None:
                    seqs[i].generator.set_state(states[seqs[i].seq_id])
            return sample(logits if len(rows) == len(seqs) else logits[rows], [seqs[i] for i in rows],
                          self.plan.draw_kernel)

        done, failed = isolate(sampling, list(range(len(seqs))))
        self._sampled_at = time.perf_counter()  # step(): what follows is output processing
        outputs = [self._fail(seqs[i], f"sampling failed on this request: {_describe(e)}") for i, e in failed]
        now = time.monotonic()
        for rows, result in done:
            for k, i in enumerate(rows):
                seq = seqs[i]
                if k in result.errors:
                    why, by_request = result.errors[k]
                    outputs.append(self._fail(seq, why, by_request=by_request))
                    continue
                logprob = result.logprobs[k] if result.logprobs is not None else None
                try:
                    outputs.append(self._append(seq, result.token_ids[k], logprob, now))
                except Exception as e:
                    outputs.append(self._fail(seq, f"detokenizing or checking stop conditions failed: {_describe(e)}"))
        return outputs

    def _draft(self) -> None:
        """Appends a draft (n-gram, or a draft model's) to each running sequence about to decode, where the rule allows
        (runtime/engine/speculative.py): verified in this step's forward pass."""
        running = self.scheduler.running
        if len(running) + len(self.scheduler.waiting) > self.proposer.config.max_batch:
            return  # a loaded engine: requests waiting are work that verify rows would only delay
        self.proposer.draft_many([(seq, min(seq.params.max_tokens - seq.num_output_tokens,
                                            self.max_request_tokens - len(seq) - 1))
                                  for seq in running if seq.num_uncomputed_tokens == 1 and eligible(seq)])

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> RequestOutput:
        """Accepts a sequence's draft (greedily, or by speculative sampling: the sampler's verify_draft):
        the accepted tokens and one of the target's own; the rest of the draft is taken back and its blocks
        given back."""
        if not torch.isfinite(logits).all():
            raise ValueError("the model's logits for this sequence are not finite (NaN or infinity)")
        draft = seq.spec.draft
        emit = verify_draft(logits, seq)
        seq.spec.record(len(draft), len(emit) - 1)
        self.stats["spec_steps"] += 1
        self.stats["spec_drafted"] += len(draft)
        self.stats["spec_accepted"] += len(emit) - 1
        seq.drop_draft()
        seq.num_computed_tokens = len(seq)  # the last verified token's K/V went in with the draft's
        now, req = time.monotonic(), self.requests[seq.request_id]
        for token in emit:  # one output for them all: its deltas carry every token emitted
            self._append(seq, token, None, now, output=False)
            self.stats["spec_emitted"] += 1
            if seq.is_finished:
                return self._output(req)
        out = self._output(req)
        seq.num_computed_tokens = len(seq) - 1  # the accepted draft tokens' K/V are in; the new last is not
        self.block_manager.register_full_blocks(seq)
        self.block_manager.trim(seq)
        self.block_manager.slide(seq)
        return out

    def _append(self, seq: Sequence, token: int, logprob: dict | None, now: float,
                output: bool = True) -> RequestOutput | None:
        """Adds a sampled token: its text, stop strings and tokens, the finish reason. Returns the request's output
        (``output=False``: None, for a caller adding several tokens a step, whose one output then carries them
        all: each output's deltas run from the previous one)."""
        req = self.requests[seq.request_id]
        if seq.constraint is not None and not seq.constraint.accept(token):
            raise ValueError(f"its grammar refused the sampled token {token}")
        seq.token_ids.append(token)
        self.stats["generation_tokens"] += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        stopped_by_text = req.add_token(token)
        reason = self._finish_reason(seq, token, stopped_by_text)
        if reason:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            del self.requests[seq.request_id]
        return self._output(req) if output else None

    def _fail(self, seq: Sequence, why: str, by_request: bool = False) -> RequestOutput:
        """Ends one request with finish_reason "error": out of the scheduler, its blocks freed. ``by_request``:
        the request's own parameters caused it (a client error), not the engine or the model."""
        log.error("request %s failed: %s", seq.request_id, why)
        req = self.requests.pop(seq.request_id, None) or _Request(seq, self.tokenizer)
        if not seq.is_finished:
            self.scheduler.abort(seq)
        seq.finish_reason = "error"
        req.error = why
        req.error_by_request = by_request
        return self._output(req)

    def _finish_reason(self, seq: Sequence, token: int, stopped_by_text: bool) -> str | None:
        p = seq.params
        if stopped_by_text or token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.constraint is not None and seq.constraint.finished:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_request_tokens:
            return "length"
        return None

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        logprobs = logits.log_softmax(-1)
        for i in range(logits.shape[0]):
            target = first + i + 1
            if target >= seq.num_prompt_tokens:
                break
            seq.prompt_logprobs.append(token_logprobs(logprobs[i], seq.token_ids[target], seq.params.prompt_logprobs))

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        visible = len(req.text) if finished else len(req.text) - req.holdback()
        delta_text = req.text[req.emitted_text:visible]
        req.emitted_text = max(req.emitted_text, visible)
        tokens = seq.output_token_ids
        delta_tokens = tokens[req.emitted_tokens:]
        req.emitted_tokens = len(tokens)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            text=req.text, token_ids=list(tokens), finished=finished, finish_reason=seq.finish_reason,
            delta_text=delta_text, delta_token_ids=delta_tokens,
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens, error=req.error, error_by_request=req.error_by_request,
            metrics={"arrival_time": seq.arrival_time, "first_scheduled_time": seq.first_scheduled_time,
                     "first_token_time": seq.first_token_time, "num_preemptions": seq.num_preemptions},
        )

    def kv_usage(self) -> float:
        return self.block_manager.usage

    def close(self) -> None:
        """Stops what the engine started beyond this process (a sharded artifact's other ranks)."""
        self.runner.close()


__all__ = ["LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "Status"]
