"""The protocol-neutral conversation layer.

Every wire protocol (OpenAI chat completions, Anthropic Messages, OpenAI Responses) adapts its
body into one `ChatRequest` and the engine's output back from one stream of `OutputEvent`s, so
templating, tool calls, constrained decoding and usage accounting live here, once.
"""

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import (
    ChatRequest,
    InputGrammar,
    Message,
    OutputFormat,
    Sampling,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)

__all__ = [
    "ChatRequest",
    "InputGrammar",
    "InvalidRequest",
    "Message",
    "OutputFormat",
    "Sampling",
    "Thinking",
    "Tool",
    "ToolCall",
    "ToolChoice",
]
