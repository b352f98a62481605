"""infer.runtime: loads a verified artifact and serves it. Never imports infer.pipeline."""

from .engine import EngineConfig, LLMEngine, RequestOutput
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
