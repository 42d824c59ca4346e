"""The models `scripts/soak.py` runs its kill loop on, beside the default one.

Each is a tiny random-weight model (tests/support/thinking_models.py) whose cache cannot be cut
at any position, so a restart restores whole snapshots rather than a trimmed prefix:

* hybrid: Qwen3-Next's layout (three Gated DeltaNet layers whose recurrent state is an
  `ArraysCache`, one full-attention layer) with Qwen3.5's real chat template (its generation
  prompt opens `<think>`, calls are `qwen3_coder` XML in Qwen's `<tool_call>` tags); a thinking
  budget ends the reasoning, so every answer is reasoning, then text or calls;
* window: Gemma 3's (two sliding-window layers of 32 tokens as `RotatingKVCache`, one global
  layer) with Qwen3's chat template (Hermes JSON calls in `<tool_call>` tags).

Both templates render tools, so with `tools` in a request the server constrains the calls.
Random weights would almost never write `<tool_call>` (one id in 49,156), so its output row is
scaled up (`CALL_SCALE`): greedy answers then open a call at some positions and not at others,
and the soak compares answers with calls, streamed and not, and histories holding them.
`padded` gives the embedding more rows than the tokenizer has ids, as real checkpoints ship
(Qwen, Gemma 3); without it the rows are exactly the tokenizer's ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tests.support.soak_workload import DEFAULT, Target
from tests.support.thinking_models import THINK_TOKENS, TOOL_TOKENS, VOCAB, build_thinking_model
from tests.support.tiny_models import padded_vocab, scale_output_row

KINDS = ("default", "hybrid", "window")
TOKENS = VOCAB + len(THINK_TOKENS) + len(TOOL_TOKENS)  # the tokenizer's ids
# The `<tool_call>` logit times this: about half the soak workload's greedy answers open a call.
CALL_SCALE = 2.5


@dataclass(frozen=True)
class Build:
    architecture: str  # a tests/support/tiny_models.py family
    family: str  # a thinking_models.FAMILIES chat template
    server_args: tuple[str, ...]
    max_tokens: int  # per answer: room for the reasoning and a whole short call
    budget: str  # the disk budget a soak gives it: small enough to evict


BUILDS = {
    "hybrid": Build("qwen3_next", "qwen3.5", ("--thinking-budget", "4"), 48, "512KiB"),
    "window": Build("gemma3_text", "qwen3", (), 48, "256KiB"),
}


def rows(padded: bool) -> int:
    """The embedding rows of a soak model."""
    return padded_vocab(TOKENS) if padded else TOKENS


def model_dir(kind: str, workdir: Path, *, padded: bool) -> Path:
    """The model of `kind` in `workdir`, built on first use (it is kept for later runs)."""
    build = BUILDS[kind]
    dest = workdir / f"model-{kind}-{'padded' if padded else 'exact'}"
    if not (dest / "config.json").is_file():
        build_thinking_model(
            dest,
            build.family,
            architecture=build.architecture,
            tool_tokens=TOOL_TOKENS,
            vocab_size=rows(padded),
        )
        prone_to_call(dest)
    return dest


def prone_to_call(model: Path, scale: float = CALL_SCALE) -> None:
    """Scale the output row of `<tool_call>` in `model`'s weights (in place)."""
    scale_output_row(model, TOOL_TOKENS[0], scale)


def soak_target(kind: str, workdir: Path, *, tools: bool, padded: bool) -> Target:
    """The target of a soak of `kind` (KINDS); `padded` is ignored for the default model, a
    real checkpoint with its own vocabulary."""
    if kind == "default":
        return replace(DEFAULT, tools=tools)
    build = BUILDS[kind]
    model = model_dir(kind, workdir, padded=padded)
    args = ("--model", str(model), "--served-model-name", kind, *build.server_args)
    return Target(kind, kind, args, tools=tools, max_tokens=build.max_tokens)
