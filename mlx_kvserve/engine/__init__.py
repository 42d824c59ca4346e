"""The engine: one worker thread that owns every MLX object and decodes requests in a batch."""

from mlx_kvserve.engine.requests import (
    Done,
    EngineError,
    GenerationRequest,
    Prefilled,
    SamplingParams,
    TextChunk,
)
from mlx_kvserve.engine.worker import Engine, EngineBusy, EngineNotReady, RequestTooLarge

__all__ = [
    "Done",
    "Engine",
    "EngineBusy",
    "EngineError",
    "EngineNotReady",
    "GenerationRequest",
    "Prefilled",
    "RequestTooLarge",
    "SamplingParams",
    "TextChunk",
]
