"""The engine: one worker thread that owns every MLX object and runs requests one at a time."""

from mlx_kvserve.engine.requests import (
    Done,
    EngineError,
    GenerationRequest,
    Prefilled,
    SamplingParams,
    TextChunk,
)
from mlx_kvserve.engine.worker import Engine, EngineBusy, EngineNotReady

__all__ = [
    "Done",
    "Engine",
    "EngineBusy",
    "EngineError",
    "EngineNotReady",
    "GenerationRequest",
    "Prefilled",
    "SamplingParams",
    "TextChunk",
]
