"""The model: the Llama/Qwen2 decoder in one file, its weight loader, and the quantized and packed linears."""

from .llama import DenseCausalContext, ModelConfig, Transformer, linear_layout
from .loader import load_model, read_state_dict

__all__ = ["ModelConfig", "Transformer", "DenseCausalContext", "linear_layout", "load_model", "read_state_dict"]
