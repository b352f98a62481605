"""The 7B-shaped checkpoint maker (bench/make_qwen7b.py) writes Qwen2.5-7B-Instruct's shapes: its parameter
count is the published 7,615,616,512 and the runtime reads its config as a supported qwen2 model."""

from __future__ import annotations

import torch

from infer.bench.make_qwen7b import QWEN2_5_7B_INSTRUCT, tensor_shapes
from infer.runtime.model import ModelConfig
from infer.runtime.model.llama import linear_layout


def test_shapes_are_qwen2_5_7b_instruct():
    shapes = dict(tensor_shapes(QWEN2_5_7B_INSTRUCT))
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 7_615_616_512
    cfg = ModelConfig.from_hf(QWEN2_5_7B_INSTRUCT)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias, cfg.tie_word_embeddings) == (128, 4, True, False)
    # every linear the model loads is there with the shape it expects
    for linear in linear_layout(cfg):
        for part in linear.parts:
            assert shapes[part.name + ".weight"] == (part.out_features, part.in_features), part.name
