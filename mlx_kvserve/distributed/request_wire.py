"""A generation request as rank 0 of a job sends it to the other ranks, and as they rebuild it.

Everything that decides what the engine computes travels: the prompt's ids, the sampling
settings, the checkpoint boundaries, where the prompt's images sit (every rank keys its cache
by them alike), the grammar's text (each rank compiles its own matcher against its own copy of
the tokenizer) and the request's id (by which later cancellations name it). A request that
samples without a seed gets one on rank 0 before it is sent: MLX's random state is each
process's own, and a seed gives every rank the same draws from the same logits
(engine/sampling.py draws a seeded row from its seed and token index). Nothing here becomes
code: it is JSON, read as data (distributed/collective.py).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from mlx_kvserve.chat.grammar import GrammarCompiler
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.requests import CancelLatch, GenerationRequest, SamplingParams
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.json_value import JSON


class RequestWire:
    """Encodes on rank 0, decodes on the others; `compiler()` is this rank's GrammarCompiler
    (made once the model's tokenizer is loaded)."""

    def __init__(self, compiler: Callable[[], GrammarCompiler]) -> None:
        self._compiler = compiler

    def encode(self, req: GenerationRequest) -> dict[str, JSON]:
        """The request as JSON data; from now on its cancellation waits for the engine's turn."""
        params = req.params
        if params.temperature > 0 and params.seed is None:
            req.params = params = dataclasses.replace(params, seed=secrets.randbits(63))
        constraint = req.constraint
        grammar = getattr(constraint, "grammar", None)
        if constraint is not None and grammar is None:
            raise TypeError("a constraint without its grammar's text cannot go to other ranks")
        flag = req.cancelled
        return {
            "id": req.request_id,
            "prompt": list(req.prompt_tokens),
            "params": {**dataclasses.asdict(params), "stop": list(params.stop)},
            "kind": req.kind,
            "boundaries": [[position, reason] for position, reason in req.boundaries.items()],
            "images": [[s.start, s.length, s.digest] for s in req.image_spans],
            "grammar": grammar,
            "lazy": bool(getattr(constraint, "lazy", False)),
            "logprobs": req.token_bytes is not None,
            "cancelled": flag.hold() if isinstance(flag, CancelLatch) else flag.is_set(),
        }

    def decode(self, wire: dict[str, JSON]) -> GenerationRequest:
        faults.maybe_fail("request_decode")
        params = SamplingParams(**{**wire["params"], "stop": tuple(wire["params"]["stop"])})
        compiler = self._compiler() if wire["grammar"] is not None or wire["logprobs"] else None
        req = GenerationRequest(
            prompt_tokens=[int(t) for t in wire["prompt"]],
            params=params,
            kind=str(wire["kind"]),
            boundaries={int(p): str(r) for p, r in wire["boundaries"]},
            image_spans=tuple(
                ImageSpan(int(s), int(n), str(d)) for s, n, d in wire.get("images", [])
            ),
            constraint=(
                compiler.constraint_from(wire["grammar"], lazy=wire["lazy"])
                if wire["grammar"] is not None
                else None
            ),
            token_bytes=compiler.token_bytes if wire["logprobs"] else None,
            request_id=str(wire["id"]),
            namespace=None,
        )
        if wire["cancelled"]:
            req.cancelled.set()
        return req


__all__ = ["RequestWire"]
