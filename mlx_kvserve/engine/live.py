"""What a request holds while it runs: its live KV caches and the figures its log line reports.

Shared by the prefill (engine/generate.py) and the decode side (engine/sequence.py), which is
why they live apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlx_kvserve.cache.kinds import LayerCache
from mlx_kvserve.engine.requests import GenerationRequest
from mlx_kvserve.images.spans import ImageSpan, key_tokens, whole_spans

if TYPE_CHECKING:
    from mlx_kvserve.engine.speculation.mtp import MTPDraft


@dataclass
class Timings:
    """What the per-request log line reports."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_source: str = "cold"
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft_seconds: float = 0.0
    finish_reason: str = ""
    stop_sequence: str | None = None
    retried: bool = False  # a try from reused state failed (engine/blame.py)
    restore_seconds: float = 0.0  # copying a RAM/disk checkpoint into the KV caches
    failed_source: str | None = None  # where the state that failed and forced a retry came from
    batch_peak: int = 1  # the most sequences it decoded beside (itself included)
    drafted: int = 0  # tokens speculation drafted for it (engine/speculation/step.py)
    accepted: int = 0  # ... and verification kept
    verify_passes: int = 0  # ... in this many verify passes (those it drafted in)
    # the same three by draft source (engine/speculation/drafts.py `Draft.source`)
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def log_line(self, req: GenerationRequest) -> str:
        prefilled = self.prompt_tokens - self.cached_tokens
        prefill_tps = prefilled / self.prefill_seconds if self.prefill_seconds else 0.0
        decode_tps = (
            (self.completion_tokens - 1) / self.decode_seconds
            if self.decode_seconds and self.completion_tokens > 1
            else 0.0
        )
        return (
            f"{req.kind} id={req.request_id} prompt_tokens={self.prompt_tokens} "
            f"cached_tokens={self.cached_tokens} cache={self.cache_source} "
            f"completion_tokens={self.completion_tokens} ttft={self.ttft_seconds:.3f}s "
            f"prefill={prefill_tps:.1f} tok/s decode={decode_tps:.1f} tok/s "
            f"batch={self.batch_peak} finish={self.finish_reason}"
            + (f" retried={self.failed_source}" if self.retried else "")
            + (
                f" drafted={self.drafted} accepted={self.accepted} passes={self.verify_passes}"
                + " by_source="
                + ",".join(f"{s}:{d}/{a}/{n}" for s, (d, a, n) in sorted(self.by_source.items()))
                if self.drafted
                else ""
            )
        )


@dataclass
class Live:
    """The KV caches being filled and the exact tokens they hold (the ids the model was fed);
    `spans`: where the request's images sit among them, which the cache keys by content;
    `mtp`: the MTP heads' own state over the same tokens, when it has one."""

    caches: list[LayerCache]
    tokens: list[int] = field(default_factory=list)
    spans: tuple[ImageSpan, ...] = ()
    # The row's MTP source, fed every prefill chunk's hidden states (engine/speculation/mtp.py);
    # None without heads, or for a row that drafts nothing
    mtp: MTPDraft | None = None

    def key(self, length: int | None = None) -> list[int] | None:
        """The first `length` (default: all) tokens as the prompt cache keys them, or None
        where that would end inside an image (no state of half an image is ever stored)."""
        tokens = self.tokens if length is None else self.tokens[:length]
        if not self.spans:
            return tokens
        if whole_spans(len(tokens), self.spans) != len(tokens):
            return None
        return key_tokens(tokens, [s for s in self.spans if s.start < len(tokens)])
