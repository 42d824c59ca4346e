"""Response bodies and stream chunks in the shapes the OpenAI SDK's types expect."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_kvserve.engine import Done

SYSTEM_FINGERPRINT = "mlx-kvserve"


@dataclass(frozen=True)
class Shape:
    """The fixed parts of one response: which endpoint, its id, model and creation time."""

    kind: str  # "chat" or "text"
    id: str
    model: str
    created: int

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def full(self, text: str, done: Done) -> dict[str, Any]:
        """The non-streaming response."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        return {**self._head(self.object), "choices": [choice], "usage": usage(done)}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False):
        """One streamed chunk; chat deltas carry the role on the first chunk."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        """The extra last chunk sent when stream_options.include_usage is set."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(done)}


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }
