"""A step's decoder layers in one C++ call (kernels/step_layers.py), for a bfloat16 model whose
every decoder linear runs on AMX tiles, on the column-block kernel, the int4 one (W4A16) or the 8-bit ones
(W8A16, W8A8 with dynamic per-token activations, FP8_DYNAMIC), in any mix (quant.auto's mixed builds): each linear is
dispatched on its own packed weight.

``Transformer.forward`` hands it the steps the plan routes to it (runtime/engine/plan.py, ``ctx.one_call``):
those whose decodes run on the paged decode kernel and whose prompt chunks (fresh or after cached tokens)
run on the chunk kernel (AMX tiles' or the CPU class's), the KV store in C++. The others (SDPA at a batch
the tuning table chose it for, a head_dim the chunk kernel does not take) run the Python loop over the
layers. Both run the same kernels on the same weights, so they compute the same bits. Why:
between ~13 kernel calls a layer, Python costs ~3 ms a decode step and ~2 ms a prompt step (Zen 4),
and a server's event loop then waits for the GIL at every call; one call releases it for the whole
step.
"""

from __future__ import annotations

import torch

# decode_steps' sampling arguments for a burst of greedy rows: no draws
_GREEDY = (torch.empty(0, 0), torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0))


class FusedStep:
    def __init__(self, model, kernels):
        """``kernels``: the model's KernelSet (infer.kernels.resolver), with ``step_layers``."""
        self.module = kernels.step_layers
        self.amx_chunks = kernels.amx_chunks  # prompt chunks on AMX tiles (else the class's chunk kernel): both built in
        empty = torch.empty(0, dtype=torch.long)
        self.no_chunks = (empty, empty, empty, torch.empty(0, 0, dtype=torch.long))
        cfg = model.config
        self.dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        self.rotary = model.rotary
        # the sliding-window layers, which read the decode rows' window starts (empty: none)
        windows = cfg.layer_windows or ()
        self.window_layers = torch.tensor([w is not None for w in windows], dtype=torch.bool)
        none = torch.empty(0)

        def slots(linear) -> list[torch.Tensor]:  # step_layers.cpp's LINEAR_SLOTS
            if getattr(linear, "backend", None) == "cpu-int4-blocks":
                return [linear.packed, linear.scales, none if linear.offsets is None else linear.offsets]
            if getattr(linear, "backend", None) in ("cpu-int8-blocks", "cpu-w8a8-blocks", "cpu-fp8-blocks"):
                # 8-bit codes: W8A16, W8A8 (with column sums), FP8 (e4m3 bytes)
                return [linear.packed, linear.scales, none if linear.colsums is None else linear.colsums]
            return [linear.packed_weight, none, none]

        weights = []  # kernels/csrc/step_layers.cpp's WEIGHTS_PER_LAYER, layer by layer
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            # the bias as the qkv kernel adds it: bfloat16 on AMX tiles, float32 on the others
            bias = None if bias is None else bias if getattr(attn.qkv_proj, "kernel", None) == "amx" else bias.float()
            weights += [layer.input_layernorm.weight, none if bias is None else bias.contiguous(),
                        layer.post_attention_layernorm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                weights += slots(linear)
        # handed to C++ once: a list would be converted tensor by tensor on every step
        self.weights = self.module.StepWeights(weights)
        # decode bursts (burst): the embedding table, the final norm and an LM head whose kernel keeps float32 sums
        self.embedding, self.norm, self.vocab = model.embed_tokens.weight, model.norm, cfg.vocab_size
        from .packed_linear import PackedLinear

        head = model.lm_head
        self.head = (head.packed_weight if type(head) is PackedLinear and head.kernel in ("blocks", "amx")
                     and head.bias is None and model.norm.ops is not None and model.embed_scale is None
                     and not cfg.final_softcap else None)

    @staticmethod
    def fits(model) -> bool:
        return FusedStep.declines(model) is None

    @staticmethod
    def declines(model) -> str | None:
        """Why this model's layers do not run as one C++ call (None: they do). It needs every decoder layer
        to be this file's Llama block as kernels/csrc/step_layers.cpp computes it (SiLU MLP, Llama's RMSNorm,
        no q/k norms, no o_proj or MLP biases), with the fused layer ops and linears on AMX tiles, the
        column-block kernel (bfloat16), the int4 one in the column order of the checkpoint or the int8 ones, in
        any mix (a tensor-parallel model, another quantization scheme or activation order is not). The rotary
        tables, scaled rope types' included, are the model's own (``model.rotary``), so those need nothing of
        the C++ step. The resolver keeps ``kernels.step_layers`` only where it has AMX built in if AMX kernels
        run."""
        from .llama import Block
        from .packed_linear import PackedLinear
        from .quant_linear import FP8BlocksLinear, Int4BlocksLinear, Int8BlocksLinear, W8A8BlocksLinear

        def fast(linear) -> bool:
            if type(linear) is Int4BlocksLinear:
                return linear.perm is None
            if type(linear) in (Int8BlocksLinear, W8A8BlocksLinear, FP8BlocksLinear):
                return True
            return type(linear) is PackedLinear and linear.kernel in ("blocks", "amx")

        if model.dtype != torch.bfloat16:
            return f"dtype {model.dtype}: the C++ step runs bfloat16 models"
        cfg = model.config
        if cfg.local_rope_layers:
            return ("a rotary of their own for the sliding layers (Gemma 3's rope_local_base_freq): "
                    "kernels/csrc/step_layers.cpp turns every layer with one table")
        if cfg.sandwich_norms or cfg.attn_softcap or cfg.query_pre_attn_scalar is not None:
            return ("Gemma 2's sandwich norms, attention soft-cap and query_pre_attn_scalar are not implemented in "
                    "kernels/csrc/step_layers.cpp")
        if cfg.hidden_act != "silu":
            return (f"hidden_act {cfg.hidden_act} (GeGLU MLP): kernels/csrc/step_layers.cpp computes SiLU-gated MLPs "
                    f"only")
        if cfg.norm_offset:
            return "Gemma's (1 + weight) float32 RMSNorm is not implemented in kernels/csrc/step_layers.cpp"
        if model.rotary.ops is None or any(type(layer) is not Block or layer.mlp.ops is None
                                           or layer.input_layernorm.ops is None for layer in model.layers):
            return "the fused layer ops (kernels/layer_ops) are not in use"
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        if attn.q_norm is not None:
            return "q/k norms (Qwen3) are not implemented in kernels/csrc/step_layers.cpp"
        if getattr(attn.o_proj, "bias", None) is not None:
            return "an o_proj bias is not implemented in kernels/csrc/step_layers.cpp"
        if getattr(mlp.gate_up_proj, "bias", None) is not None or getattr(mlp.down_proj, "bias", None) is not None:
            return "MLP biases are not implemented in kernels/csrc/step_layers.cpp"
        if not all(fast(m) for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            return ("a linear is not on AMX tiles, the column-block, the int4 (checkpoint column order), the int8 or "
                    "the fp8 kernels")
        return None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx):
        """(last layer's output, residual stream) for a step the plan routes here (runtime/engine/plan.py:
        ``ctx.one_call``): its decode rows on the paged decode kernel, its prompt chunks on the chunk kernel."""
        chunks = self.no_chunks
        if ctx.in_place:
            c = ctx.in_place[0]
            chunks = (c.starts, c.lengths, c.cached, c.tables)
        heads, kv_heads, head_dim, intermediate, eps = self.dims
        residual = torch.empty_like(x)
        out = self.module.step_layers(x, residual, self.weights, ctx.kv_cache, ctx.slot_mapping, positions,
                                      self.rotary.cos, self.rotary.sin, *chunks, ctx.decode_rows, ctx.decode_blocks,
                                      ctx.decode_lens, self._starts(ctx), self.window_layers, self.amx_chunks,
                                      ctx.bf16_dots, heads, kv_heads, head_dim, intermediate, eps)
        return out, residual

    @property
    def bursts(self) -> bool:
        """Whether ``burst`` runs this model: its LM head on the bfloat16 column blocks or AMX tiles (float32 sums),
        no bias, embedding scale or logit soft-cap between the layers and the argmax."""
        return self.head is not None

    def burst(self, kv_cache: torch.Tensor, tokens: list[int], first_positions: list[int], block_tables: torch.Tensor,
              stops: list[list[int]], steps: int, sampling: tuple[torch.Tensor, ...] | None = None,
              bf16_dots: bool = True) -> list[list[int]]:
        """Up to ``steps`` decode steps of these rows back to back, each row's next token its argmax or, with
        ``sampling`` (draws [steps, rows] uniforms, then a row each: 1 / temperature (0: greedy), top-k, top-p,
        min-p), the sampler's draw, in one C++ call (kernels/csrc/step_layers.cpp decode_steps): the tokens a step.
        ``bf16_dots``: as a step's (PagedAttention's): False runs the decode kernel's float path."""
        heads, kv_heads, head_dim, intermediate, eps = self.dims
        out = self.module.decode_steps(torch.tensor(tokens, dtype=torch.long),
                                       torch.tensor(first_positions, dtype=torch.long), self.weights, kv_cache,
                                       block_tables, self.rotary.cos, self.rotary.sin, self.embedding, self.norm.weight,
                                       self.head, self.vocab, stops, steps, heads, kv_heads, head_dim, intermediate,
                                       eps, *(sampling or _GREEDY), bf16_dots)
        return out.tolist()

    def _starts(self, ctx) -> torch.Tensor:
        """The decode rows' window starts, or an empty tensor for a model without sliding layers."""
        if not len(self.window_layers):
            return self.no_chunks[0]
        if ctx.decode_starts is None:
            raise ValueError("a sliding-window model's step needs its decode rows' window starts")
        return ctx.decode_starts
