"""Join a job: every rank checks it holds the same model, loads its shard and steps in lockstep.

Run on every rank that `mlx.launch` started, before anything opens a port. In order:
1. the ranks gather each other's host name, versions (mlx-kvserve, mlx, mlx-lm: another
   version may lay out requests, kernels or caches otherwise) and model fingerprint (weights,
   config, tokenizer by content: `fingerprint_model`, so a copy made with `scp -r` under another
   directory name is the same model); a rank whose versions or files differ from rank 0's is
   named, with its host, on every rank, and every rank refuses (a job of different models would
   answer garbage, or hang when the shapes differ);
2. the split is planned from the config (`sharding.plan_sharding`: same inputs, same answer on
   every rank);
3. each rank builds the model lazily and keeps only its shard (`model.shard(group)` or
   `model.model.pipeline(group)`, as `mlx_lm.utils.sharded_load` does, from a local directory);
4. a greedy probe: a few tokens decoded together by every rank, whose ids must agree on every
   rank (the all-reduce gives every rank the same logits), so a job that cannot step together
   fails here and not on a user's first request.
A failure every rank sees alike (different model files, a split the model cannot take, probes
that disagree) is a `JoinError` or `ShardingError` with the same message on every rank; this
rank's own unreadable files are an `OSError` on this rank only.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.cache.fingerprint import layout_versions
from mlx_kvserve.distributed.collective import Collective
from mlx_kvserve.distributed.sharding import PIPELINE, ShardingError, ShardPlan, plan_sharding
from mlx_kvserve.engine import faults
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.identity import fingerprint_model

if TYPE_CHECKING:  # heavy (transformers): loaded after the cheap checks
    from mlx_lm.tokenizer_utils import TokenizerWrapper

PROBE_PROMPT = "The prompt cache of every rank"
PROBE_TOKENS = 4
PACKAGES = ("mlx-kvserve", "mlx", "mlx-lm")  # whose versions every rank must share


class JoinError(Exception):
    """This job cannot serve: the message names the rank, its host and the cause."""


@dataclass
class JoinedModel:
    """This rank's shard of the model, and what every rank agreed on."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    plan: ShardPlan
    fingerprint: str
    hosts: list[str]  # per rank
    probe: list[int]  # the greedy probe's token ids, the same on every rank


def join_model(
    collective: Collective, model_dir: Path, shard: str | None = None, *, host: str | None = None
) -> JoinedModel:
    """Steps 1-4 above; raises as the module's docstring says."""
    model_dir = Path(model_dir)
    host = host or socket.gethostname()
    try:
        fingerprint = fingerprint_model(model_dir, "")  # its content: not the directory's name
    except (OSError, ValueError) as exc:
        fingerprint = f"unreadable: {exc}"
    mine = {"host": host, "versions": versions(), "fingerprint": fingerprint}
    ranks = collective.gather(mine, "model check")
    hosts = [str(r["host"]) for r in ranks]
    check_same_versions(ranks)
    _check_same_model(ranks)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:  # this rank's own files: no barrier, see cluster join
        raise OSError(f"{model_dir}: no readable config.json ({exc})") from None
    from mlx_lm.utils import load_model, load_tokenizer  # heavy: after the cheap checks

    # the config as mlx_lm.load reads it: generation_config.json's end ids win over config.json's
    model, loaded_config = load_model(model_dir, lazy=True, strict=False)
    plan = plan_sharding(model, config, collective.size, shard, name=model_dir.name)
    if collective.distributed:
        if plan.mode == PIPELINE:
            model.model.pipeline(collective.group)
        else:
            model.shard(collective.group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_dir, eos_token_ids=loaded_config.get("eos_token_id"))
    probe = greedy_probe(model, tokenizer)
    if not collective.all_equal(json.dumps(probe), "greedy probe"):
        raise JoinError(
            f"the ranks decoded different tokens from the same prompt (rank 0: {probe} on "
            f"{hosts[0]}) with the same versions and model files: their devices compute "
            "otherwise"
        )
    return JoinedModel(model, tokenizer, plan, fingerprint, hosts, probe)


def versions() -> dict[str, str]:
    """What this rank runs, as the other ranks must too."""
    from mlx_kvserve import __version__

    found = layout_versions()
    mine = dict(zip(PACKAGES, (__version__, found["mlx"], found["mlx_lm"]), strict=True))
    if faults.fires("join_other_versions"):  # a rank installed otherwise (tests)
        mine = {name: f"{version}+other" for name, version in mine.items()}
    return mine


def check_same_versions(ranks: list[dict[str, JSON]]) -> None:
    """Refuse a job whose ranks run other versions, naming every such rank and package."""
    first = ranks[0].get("versions") or {}
    differ = []
    for rank, seen in enumerate(ranks[1:], start=1):
        theirs = seen.get("versions") or {}  # none at all: a version from before the check
        other = [
            f"{name} {theirs.get(name, 'unknown')} against {first.get(name, 'unknown')}"
            for name in PACKAGES
            if theirs.get(name) != first.get(name)
        ]
        if other:
            differ.append(f"rank {rank} ({seen['host']}) runs {', '.join(other)}")
    if differ:
        raise JoinError(
            f"{'; '.join(differ)} on rank 0 ({ranks[0]['host']}); install the same "
            "mlx-kvserve, mlx and mlx-lm on every host"
        )


def _check_same_model(ranks: list[dict[str, JSON]]) -> None:
    first = ranks[0]
    for rank, seen in enumerate(ranks[1:], start=1):
        if seen["fingerprint"] != first["fingerprint"]:
            raise JoinError(
                f"rank {rank} ({seen['host']}): its model files differ from rank 0's "
                f"({first['host']}): fingerprint {seen['fingerprint']} against "
                f"{first['fingerprint']}; copy the same model directory to every host"
            )


def greedy_probe(
    model: nn.Module, tokenizer: TokenizerWrapper, steps: int = PROBE_TOKENS
) -> list[int]:
    """`steps` greedy token ids after PROBE_PROMPT (one prefill, then one token at a time)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    tokens = mx.array(tokenizer.encode(PROBE_PROMPT))[None]
    out: list[int] = []
    for _ in range(steps):
        logits = model(tokens, cache=caches)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1, keepdims=True)
        out.append(int(tokens.item()))
    return out


__all__ = [
    "JoinError",
    "JoinedModel",
    "ShardingError",
    "check_same_versions",
    "greedy_probe",
    "join_model",
    "versions",
]
