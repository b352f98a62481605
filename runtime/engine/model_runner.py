"""Runs one scheduled step: builds the flattened inputs, one forward pass, the rows to sample.

Owns the KV cache: one preallocated tensor for all layers and blocks, never grown or copied, on
the model's device. A step is split in two so that tensor parallelism (runtime/parallel) can share
it: ``prepare`` turns the scheduled batch into ``StepInputs`` (tensors only, built on the CPU --
pinned when the model is on CUDA; rank 0 broadcasts them as they are), and ``forward`` copies them
to the device (one non-blocking copy each) and runs the model on them, the same code on every rank
over its own KV cache.

On CUDA with the triton kernels, decode-only steps of up to the largest bucket replay a CUDA graph
captured at load for their bucket (kernels/cuda_graphs.py): the step's rows are copied straight
into the graph's static buffers, padded to the bucket. Other steps run eagerly.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, fields, replace

import torch

from infer.kernels.cpu_attention import block_shape
from infer.kernels.cuda_graphs import DEFAULT_BUCKETS, DecodeInputs, GraphRunner, buckets_up_to

from .attention import PagedAttention, PrefillChunk
from .plan import ONE_CALL, kv_cache_dtype, make_plan, sliding_window
from .sampler import kernel_params
from ..model import Transformer
from .scheduler import ScheduledBatch
from .sequence import Sequence


log = logging.getLogger("infer.engine")


def kv_block_shape(model: Transformer, block_size: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """One layer's K (or V) block: kernels/cpu_attention.block_shape (int8 rows carry a scale, head-major)."""
    cfg = model.config
    return block_shape(block_size, cfg.num_kv_heads, cfg.head_dim, dtype)


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    return 2 * model.config.num_layers * math.prod(kv_block_shape(model, block_size, dtype)) * dtype.itemsize


@dataclass
class StepInputs:
    """What one step's forward pass needs, as int64 tensors: no Sequence objects, so it can travel."""
    input_ids: torch.Tensor  # [T] the step's tokens, flattened over its sequences
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] the KV cache slot each token's K/V goes to
    chunk_starts: torch.Tensor  # [P] first row of each prompt chunk
    chunk_lengths: torch.Tensor  # [P] its tokens this step
    chunk_contexts: torch.Tensor  # [P] its sequence's tokens in cache after this step
    chunk_blocks: torch.Tensor  # [P, W] block tables covering those contexts, padded with block 0
    decode_rows: torch.Tensor  # [D] rows of the single-token decodes
    decode_blocks: torch.Tensor  # [D, W'] their block tables, padded with block 0
    decode_lens: torch.Tensor  # [D] their context lengths
    decode_kernel: bool = True  # the C++ paged decode kernel (False: gather + SDPA, the tuning's choice)
    one_call: bool = False  # the one-call C++ step runs this step (the plan's route; else the layer loop)
    # [D] each decode row's sliding window's first position (position - window + 1, at least 0); None: the
    # model has no sliding-window layer
    decode_starts: torch.Tensor | None = None
    bf16_dots: bool = True  # the decode kernel's scores on vdpbf16ps where built in (False: its float path)

    # read into Python lists to build the prompt chunks, never by a kernel: they stay on the host
    HOST_FIELDS = ("chunk_starts", "chunk_lengths", "chunk_contexts")

    def to(self, device: torch.device) -> "StepInputs":
        """The tensors a kernel reads on ``device``, one non-blocking copy each (these inputs themselves on the
        CPU: a decode step's Python is on its critical path)."""
        if device.type == "cpu":
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in self.HOST_FIELDS})

    def decode_inputs(self) -> DecodeInputs | None:
        """A decode-only step as a CUDA graph's inputs (kernels/cuda_graphs.py); None when it has prompt
        chunks, or runs its decodes without the paged kernel (the graphs capture the kernel's path)."""
        if len(self.chunk_starts) or len(self.decode_rows) != len(self.input_ids) or not self.decode_kernel:
            return None
        return DecodeInputs(self.input_ids, self.positions, self.slots, self.decode_blocks, self.decode_lens)


def graph_buckets_for(device: torch.device, backend: str, enabled: bool, max_num_seqs: int) -> tuple[int, ...] | None:
    """The decode batch buckets to capture as CUDA graphs, or None for none: only on CUDA, and only with
    the triton kernels (padding rows carry slot -1, which the triton KV store skips and index_copy_ would not)."""
    if not enabled or torch.device(device).type != "cuda" or backend != "triton":
        return None
    return buckets_up_to(max_num_seqs, DEFAULT_BUCKETS)


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that reached their last token: one new token each
    # [rows, vocab] float32: one row per sampled sequence, or 1 + its draft's length for one with a draft
    # (the rows of its last verified token and of each draft token, in order)
    logits: torch.Tensor
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits of its chunk rows)


class ModelRunner:
    error: str | None = None  # set by a runner that can no longer step (a tensor-parallel rank died)
    max_threads: int | None = None  # a cap on the tuning table's threads (ranks sharing the cores)

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, kernels, tuning=None,
                 device: torch.device | str | None = None, graph_buckets: tuple[int, ...] | None = None,
                 kv_dtype: torch.dtype | None = None, prompt_rows: str = "auto"):
        """``kernels``: the KernelSet the model was loaded with (infer.kernels.resolver); ``tuning``: a
        runtime.tuning.Tuning for this machine, whose per-bucket choices (decode attention kernel,
        threads) each step follows on the CPU. ``device``: the model's (None: wherever it is).
        ``graph_buckets`` (``graph_buckets_for``): decode steps padded to these batch sizes and, on
        CUDA, captured as graphs now; on the CPU (tests) the padded step runs eagerly. ``kv_dtype``: the
        cache's (``kv_cache_dtype``; None: the model's). An int8 cache is read by the C++ decode kernel
        alone: prompt chunks run as decode rows, each over the context up to its own position, after the
        chunk's K/V are stored (quantized), so a prompt attends to the quantized cache as later tokens
        do and a prefix-cache hit computes what a miss computes. A model with sliding-window layers runs the
        same way (every row a decode row), each row reading its window's positions only in those layers
        (``sliding_window``). ``prompt_rows``: the plan's (runtime/engine/plan.py make_plan)."""
        cfg = model.config
        self.device = model.device
        if device is not None and torch.device(device) not in (model.device, torch.device(model.device.type)):
            raise ValueError(f"the model is on {model.device}, the runner was asked for {torch.device(device)}")
        if tuning is not None and self.device.type != "cpu":
            log.info("tuning: the table's choices (C++ kernel or SDPA, threads) are for the CPU; not used on %s",
                     self.device)
            tuning = None
        self.tuning = tuning
        self.default_threads = torch.get_num_threads()
        self.model = model
        self.block_size = block_size
        self.pin = self.device.type == "cuda"  # step inputs in pinned memory: copies that do not block
        self._no_chunks = torch.empty(0, 3, dtype=torch.long)  # a step without prompt chunks (never written)
        kv_dtype = kv_dtype or model.dtype
        if kv_dtype == torch.int8:
            kv_cache_dtype("int8", None, model.dtype, kernels)  # raises unless the C++ CPU kernels run
        self.window, self.windowed_layers = sliding_window(cfg)
        if self.window is not None and kernels.backend == "triton":
            raise ValueError(f"sliding-window attention (window {self.window}) runs on the CPU kernels or torch "
                             f"SDPA; the triton decode kernel has no window yet: use kernels=cpp or kernels=torch")
        self.plan = make_plan(model, kernels, kv_dtype, tuning, prompt_rows)  # which kernel runs each row, and each step's path
        self.decode_kernel, self.store_kv, self.chunk_kernel = (self.plan.decode_kernel, self.plan.store_kv,
                                                                self.plan.chunk_kernel)
        # zeros, not torch.empty's stale memory (which can hold NaN: the SDPA paths weight padding and slots
        # past a sequence's end by 0, and 0 x NaN would fail a request); writing it also touches every page
        # now, at load, rather than during the first requests
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, *kv_block_shape(model, block_size, kv_dtype),
                                    dtype=kv_dtype, device=self.device)
        self.graphs = None
        if graph_buckets:
            if kernels.backend != "triton":
                raise ValueError(f"decode graphs need kernels=triton (padding rows write slot -1, which only its KV "
                                 f"store skips), not {kernels.backend}")
            # widest block table: a sequence holds at most the model's positions, and never more than the cache
            max_blocks = min(num_blocks, -(-cfg.max_position_embeddings // block_size))
            self.graphs = GraphRunner(self._decode_step, max_blocks, self.device, buckets=tuple(graph_buckets))
            self.capture_graphs()

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The scheduled batch as flattened tensors: tokens, positions, slots, chunks and decodes."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        chunks, chunk_tables = [], []
        decode_rows, decode_tables, decode_lens = [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            pos = range(start, end)
            ids.extend(seq.token_ids[start:end])
            positions.extend(pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if self.plan.decode_rows_only or seq.runs_as_decode(n):
                # a decode, or a decode and its draft: each row a decode over the context up to its own
                # position (the draft's K/V are stored before any row attends), so a draft is verified by
                # the same kernels and the one-call step that decode steps run
                slid = seq.num_slid_blocks  # blocks a sliding window gave back (-1, never read): block 0, as padding
                for j in range(n):
                    decode_rows.append(row + j)
                    used = table[:-(-(start + j + 1) // bs)]
                    decode_tables.append([0] * slid + used[slid:] if slid else used)
                    decode_lens.append(start + j + 1)
            else:
                chunks.append((row, n, end))
                chunk_tables.append(table[:-(-end // bs)])
            row += n
        decode_kernel = self.plan.decode_on_kernel(len(decode_rows))
        bf16_dots = self.plan.decode_bf16_dots(len(decode_rows))
        one_call = self.plan.route(len(chunks), len(decode_rows)) == (ONE_CALL,)
        chunk_info = torch.tensor(chunks, dtype=torch.long).view(len(chunks), 3) if chunks else self._no_chunks
        pin = self._pinned
        # the per-row fields from one tensor (one conversion of Python ints, not five): rows of [tokens, positions,
        # slots] then [decode rows, decode lengths], split by views
        t, d = len(ids), len(decode_rows)
        flat = pin(torch.tensor(ids + positions + slots + decode_rows + decode_lens, dtype=torch.long))
        starts = None
        if self.window is not None:
            starts = pin(flat[3 * t + d:].sub(self.window).clamp_(min=0))
        return StepInputs(flat[:t], flat[t:2 * t], flat[2 * t:3 * t], chunk_info[:, 0], chunk_info[:, 1],
                          chunk_info[:, 2], pin(_padded(chunk_tables)), flat[3 * t:3 * t + d],
                          pin(_padded(decode_tables)), flat[3 * t + d:], decode_kernel, one_call, starts, bf16_dots)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.pin else t

    def _context(self, inputs: StepInputs) -> PagedAttention:
        bs = self.block_size
        prefills = [PrefillChunk(start, length, context, inputs.chunk_blocks[i, :-(-context // bs)])
                    for i, (start, length, context) in enumerate(zip(inputs.chunk_starts.tolist(),
                                                                     inputs.chunk_lengths.tolist(),
                                                                     inputs.chunk_contexts.tolist()))]
        return PagedAttention(self.kv_cache, bs, inputs.slots, prefills, inputs.decode_rows, inputs.decode_blocks,
                              inputs.decode_lens, self.decode_kernel if inputs.decode_kernel else None,
                              self.store_kv, self.chunk_kernel, inputs.decode_starts, self.windowed_layers,
                              inputs.one_call, inputs.bf16_dots)

    def _threads(self, rows: int) -> None:
        """The table's thread count for a step of this many rows (the process default without one).
        CPU only: on CUDA the host threads only launch kernels."""
        if self.device.type != "cpu":
            return
        want = (self.tuning.threads(rows) if self.tuning is not None else None) or self.default_threads
        if self.max_threads is not None:
            want = min(want, self.max_threads)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's inputs (on the CPU): final hidden states [T, hidden] on the device.
        Every rank runs this. A decode-only step that fits a bucket runs padded to it (replayed as a
        CUDA graph on CUDA); the rows returned then are a view the next such step overwrites."""
        self._threads(len(inputs.input_ids))
        decode = inputs.decode_inputs() if self.graphs is not None else None
        if decode is not None and self.graphs.bucket(decode) is not None:
            return self.graphs(decode)  # copies the rows into the static buffers: one copy each
        inputs = inputs.to(self.device)
        return self.model(inputs.input_ids, inputs.positions, self._context(inputs))

    def _decode_step(self, x: DecodeInputs) -> torch.Tensor:
        """One decode step over static buffers: what a CUDA graph captures (no host syncs on this path:
        the triton wrappers skip their checks while capturing)."""
        rows = torch.arange(x.num_seqs, device=self.device)
        ctx = PagedAttention(self.kv_cache, self.block_size, x.slot_mapping, [], rows, x.block_tables, x.context_lens,
                             self.decode_kernel, self.store_kv, self.chunk_kernel)
        return self.model(x.input_ids, x.positions, ctx)

    @torch.inference_mode()
    def capture_graphs(self) -> list[int]:
        """Captures every bucket's decode graph (once the kernels' tuning is settled: the warm-up runs
        before each capture let triton compile and autotune); the buckets captured (none on the CPU)."""
        if self.graphs is None or not self.graphs.use_graphs:
            return []
        t0 = time.perf_counter()
        self.graphs.capture_all()
        torch.cuda.synchronize(self.device)
        log.info("cuda graphs: decode buckets %s captured in %.1fs", sorted(self.graphs.graphs),
                 time.perf_counter() - t0)
        return sorted(self.graphs.graphs)

    def bursts(self, rows: int) -> bool:
        """Whether a decode-only step of ``rows`` rows may run as a burst (run_burst): on the CPU, on the one-call
        C++ step with the paged decode kernel and an LM head it runs too (FusedStep.bursts), without sliding-window
        layers (whose blocks slide every step)."""
        fused = getattr(self.model, "fused_step", None)
        return (self.device.type == "cpu" and self.graphs is None and self.window is None and fused is not None
                and fused.bursts and self.plan.decode_on_kernel(rows) and self.plan.route(0, rows) == (ONE_CALL,))

    @torch.inference_mode()
    def run_burst(self, seqs: list[Sequence], steps: int, stops: list[set[int]],
                  draws: torch.Tensor | None = None) -> list[list[int]]:
        """Up to ``steps`` decode steps of ``seqs`` back to back in one C++ call (FusedStep.burst), each row's next
        input its own argmax (the greedy sampler's choice) or, for a sampled row, the sampler's draw with
        ``draws[step, row]`` as its uniform (the plan's draw kernel, with the row's temperature, top-k, top-p and
        min-p), with nothing between the steps but the model, its LM head and that choice: the tokens of each step,
        a list a step with a token a sequence. Every sequence decodes (its last token not yet in the cache), has
        nothing that moves or reads its logits but that choice, and has blocks for ``steps`` tokens (the scheduler's
        reserve). Ends early after a step where a row chose one of its ``stops``, and before one where a row's
        logits are not finite (that step's tokens are not returned: the engine's sampler reports the row)."""
        self._threads(len(seqs))
        sampling = None
        if draws is not None:  # the same per-row parameters the sampler hands the kernel
            sampling = (draws.contiguous(), *kernel_params(seqs, self.model.config.vocab_size))
        return self.model.fused_step.burst(self.kv_cache, [s.token_ids[-1] for s in seqs],
                                           [s.num_computed_tokens for s in seqs], _padded([s.block_table for s in seqs]),
                                           [sorted(stop) for stop in stops], steps, sampling,
                                           self.plan.decode_bf16_dots(len(seqs)))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        hidden = self.forward(self.prepare(batch))
        rows, sampled = [], []
        prompt_logits = {}
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                prompt_logits[seq.seq_id] = (start, self.model.compute_logits(hidden[row:row + n]))
            if start + n == len(seq):
                drafted = len(seq.spec.draft)
                rows.extend(range(row + n - 1 - drafted, row + n))
                sampled.append(seq)
            row += n
        if len(rows) == hidden.shape[0]:  # every row (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[rows]) if rows else torch.empty(0, device=self.device)
        return StepOutput(sampled, logits, prompt_logits)

    def close(self) -> None:
        """Releases what the runner holds beyond memory (a tensor-parallel runner: its ranks)."""


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [n, widest] tensor, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)
