"""A decode-only step's decoder layers in one C++ call (kernels/decode_layers.py), for a bfloat16
model whose every decoder linear runs on the AVX-512 BF16 kernel or on the int4 one (W4A16).

``Transformer.forward`` offers each step to it first; it takes the step when every row is a decode
through the C++ paged-attention kernel and KV store (what the engine runs on such a host), and
otherwise declines (returns None), leaving the step to the Python loop over the layers. Both run
the same kernels on the same weights, so they compute the same values.
"""

from __future__ import annotations

import torch


class FusedDecode:
    def __init__(self, model, kernels):
        """``kernels``: the model's KernelSet (infer.kernels.resolver), with ``decode_layers``."""
        self.module = kernels.decode_layers
        # the C++ paged decode attention and KV store: the steps whose context uses them are taken
        self.decode_kernel, self.store_kv = kernels.decode_attention, kernels.store_kv
        cfg = model.config
        self.dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        self.rotary = model.rotary
        none = torch.empty(0)

        def slots(linear) -> list[torch.Tensor]:  # decode_layers.cpp's LINEAR_SLOTS
            if getattr(linear, "backend", None) == "cpu-int4-avx512":
                return [linear.packed, linear.scales, none if linear.offsets is None else linear.offsets]
            return [linear.packed_weight, none, none]

        self.weights = []  # kernels/csrc/decode_layers.cpp's WEIGHTS_PER_LAYER, layer by layer
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            self.weights += [layer.input_layernorm.weight, none if bias is None else bias.float(),
                             layer.post_attention_layernorm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self.weights += slots(linear)

    @staticmethod
    def fits(model) -> bool:
        """Whether every decoder layer is this file's Llama block with the fused layer ops and linears on
        the AVX-512 BF16 kernel (bfloat16) or the int4 one in the column order of the checkpoint (a
        tensor-parallel model, another quantization scheme or activation order is not)."""
        from .llama import Block
        from .packed_linear import PackedLinear
        from .quant_linear import Int4Avx512Linear

        def fast(linear) -> bool:
            if type(linear) is Int4Avx512Linear:
                return linear.perm is None
            return type(linear) is PackedLinear and linear.kernel == "avx512bf16"

        return model.dtype == torch.bfloat16 and model.rotary.ops is not None and all(
            type(layer) is Block and layer.mlp.ops is not None and layer.input_layernorm.ops is not None
            and layer.self_attn.o_proj.bias is None
            and all(fast(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                      layer.mlp.down_proj))
            for layer in model.layers)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx):
        """(last layer's output, residual stream) for a decode-only step on the C++ kernels, else None."""
        if not (getattr(ctx, "decodes_only", False) and ctx.decode_kernel is self.decode_kernel
                and ctx.store_kv is self.store_kv and self.decode_kernel is not None and x.is_contiguous()):
            return None
        heads, kv_heads, head_dim, intermediate, eps = self.dims
        residual = torch.empty_like(x)
        out = self.module.decode_layers(x, residual, self.weights, ctx.kv_cache, ctx.slot_mapping, ctx.decode_blocks,
                                        ctx.decode_lens, positions, self.rotary.cos, self.rotary.sin, heads,
                                        kv_heads, head_dim, intermediate, eps)
        return out, residual
