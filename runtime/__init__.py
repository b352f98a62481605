"""infer.runtime: loads a verified artifact and serves it. Never imports infer.pipeline or infer.eval.

Rooms: ``model/`` (the model in one file, its weight loader, the compressed-tensors reader, the
quantized and packed linears), ``engine/`` (sequence, block manager, scheduler, model runner,
attention, sampler, the engine and the offline ``LLM``), ``serving/`` (the HTTP app and routes,
request parsing, responses, the engine thread, metrics); ``artifact.py`` is the format both
halves share, ``cli.py`` is ``infer-run``.
"""

from .artifact import Artifact, ArtifactError, verify_artifact
from .engine.engine import EngineConfig, LLMEngine, RequestOutput
from .engine.llm import LLM
from .engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "Artifact", "ArtifactError",
           "verify_artifact"]
