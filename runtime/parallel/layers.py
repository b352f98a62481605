"""Tensor parallelism as module swaps on the ordinary model (gpt-fast style).

A rank's model is the same ``Transformer`` built from ``rank_config``: its share of the query heads,
KV heads and MLP channels. The column-parallel linears (q/k/v, gate/up) then need nothing: the
loader fuses the rank's slices (whole heads, pipeline/shard.py) into smaller linears, and attention
and SiLU(gate)*up run on the rank's own heads and channels. The row-parallel ones (o_proj,
down_proj) multiply the rank's slice of the activations, so the block's output is the sum over the
ranks: ``RowParallel`` wraps them and all-reduces their output, then adds a bias once, after the sum.
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
    """A row-parallel linear: the wrapped linear on this rank's input slice, summed over the ranks."""

    def __init__(self, inner: nn.Module, reduce: AllReduce):
        super().__init__()
        self.inner, self.reduce = inner, reduce
        self.bias = None
        if getattr(inner, "bias", None) is not None:  # none in Llama/Qwen2; replicated, so added once
            if type(inner) is not nn.Linear:
                raise ValueError(f"a row-parallel {type(inner).__name__} with a bias is not supported")
            self.bias, inner.bias = inner.bias, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


def make_row_parallel(model: Transformer, reduce: AllReduce) -> Transformer:
    """Wraps every block's o_proj and down_proj (after any packing: the wrapper keeps what it wraps)."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, reduce)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, reduce)
    return model


def load_slice(artifact, rank: int, tp: int, dtype, kernels, tuning, reduce: AllReduce) -> Transformer:
    """Rank ``rank``'s model: its rank file only, through the one loader and the fused layout, with
    the rank-local config; then o_proj/down_proj wrapped to sum over the ranks."""
    from ..model.loader import load_model
    from .distributed import rank_file

    cfg = rank_config(ModelConfig.from_hf(artifact.config), tp)
    model = load_model(artifact.path, dtype, kernels, hf_config=artifact.config, files=[rank_file(artifact, rank)],
                       tuning=tuning, config=cfg)
    return make_row_parallel(model, reduce)
