"""Tensor parallelism as module swaps on the ordinary model (gpt-fast style).

A rank's model is the same ``Transformer`` built from ``rank_config``: its share of the query heads,
KV heads and MLP channels. The column-parallel linears (q/k/v, gate/up) then need nothing: the
loader fuses the rank's slices (whole heads, pipeline/shard.py) into smaller linears, and attention
and SiLU(gate)*up run on the rank's own heads and channels. The row-parallel ones (o_proj,
down_proj) multiply the rank's slice of the activations, so the block's output is the sum over the
ranks: ``RowParallel`` wraps them and all-reduces their output, with a bias added once.

Every family's rank model is this one (Qwen3's per-head q/k norms and a partial rotary's per-head dim order
act within a head, so whole heads need nothing more; Gemma 2's attention soft-cap and query_pre_attn_scalar
scale act per score, its sandwich norms on the summed o_proj and down_proj outputs, its windows per layer
index, so ``rank_config`` keeps them as they are; Gemma 3's too, with its per-head (1 + weight) q/k norms and the
sliding layers' own rotary, ``Transformer.rotary_local``, which the loader builds from the rank config's
``local_rope_*`` as for the single model). The C++ step (runtime/model/fused_step.py) runs all
layers in one call with no all-reduce between them, so a rank's model runs the Python layer loop.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from ..model.llama import ModelConfig, Transformer


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one of ``tp`` ranks runs: heads, KV heads and MLP channels divided by ``tp``."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tp={tp}: {name}={getattr(cfg, name)} is not divisible by {tp}, so the ranks "
                             f"cannot hold whole heads/channels; rebuild with a parallel.tp that divides it")
    return replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                   intermediate_size=cfg.intermediate_size // tp)


class AllReduce:
    """The sum over the ranks, in place; counts its calls and the time spent in them (the benchmark's
    "collectives' share of a step": on rank 0 that includes waiting for the slowest rank)."""

    def __init__(self):
        self.group = None  # a torch.distributed backend (ProcessGroupGloo / NCCL), set once connected
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return t

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


class RowParallel(nn.Module):
    """A row-parallel linear: the wrapped linear on this rank's input slice, summed over the ranks.

    A bias (Llama's attention_bias / mlp_bias, Qwen3's attention_bias) is in every rank's file
    (replicated) and must count once: a float nn.Linear's is taken out and added after the sum; a
    quantized or prepacked linear keeps its own inside its kernel (some add it in float32 before
    rounding), so there rank 0 keeps it and every other rank zeroes its copy."""

    def __init__(self, inner: nn.Module, reduce: AllReduce, rank: int):
        super().__init__()
        self.inner, self.reduce = inner, reduce
        self.bias = None
        if getattr(inner, "bias", None) is not None:
            if type(inner) is nn.Linear:
                self.bias, inner.bias = inner.bias, None
            elif rank != 0:
                with torch.no_grad():
                    for name in ("bias", "bias_f32"):
                        if getattr(inner, name, None) is not None:
                            getattr(inner, name).zero_()

    @property
    def kernel_name(self) -> str:  # the plan's name for it (runtime/engine/plan.py): the wrapped linear's
        from ..engine.plan import linear_kernel

        return linear_kernel(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


def make_row_parallel(model: Transformer, reduce: AllReduce, rank: int) -> Transformer:
    """Wraps every block's o_proj and down_proj (after any packing: the wrapper keeps what it wraps); the
    C++ step, which has no all-reduce between layers, is switched off."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, reduce, rank)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, reduce, rank)
    model.fused_step = None
    model.step_path = "python layer loop: a tensor-parallel rank (the C++ step has no all-reduce between layers)"
    return model


def load_slice(artifact, rank: int, tp: int, dtype, kernels, tuning, reduce: AllReduce) -> Transformer:
    """Rank ``rank``'s model: its rank file only, through the one loader and the fused layout, with
    the rank-local config; then o_proj/down_proj wrapped to sum over the ranks."""
    from ..model.loader import load_model
    from .distributed import rank_file

    cfg = rank_config(ModelConfig.from_hf(artifact.config), tp)
    model = load_model(artifact.path, dtype, kernels, hf_config=artifact.config, files=[rank_file(artifact, rank)],
                       tuning=tuning, config=cfg)
    return make_row_parallel(model, reduce, rank)
