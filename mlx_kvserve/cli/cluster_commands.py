"""`mlx-kvserve cluster check`: is a hostfile, and a model split across its hosts, runnable?

Checked before any machine is contacted: the hostfile in `mlx.launch`'s format (every host
named, every address an address, JACCL's devices one per host), addresses outside private
ranges (the collectives take no authentication), and, with `--model DIR`, how the model splits
across that many ranks (see `distributed.sharding`; the model is built from its config alone,
no weight is read). Exit status 0 when the job can run, 2 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_kvserve.distributed.hostfile import HostfileError, read_hostfile
from mlx_kvserve.distributed.sharding import PIPELINE, TENSOR, ShardingError, plan_sharding


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="check a hostfile for serving one model across several machines",
        description="Commands for jobs across machines (mlx.launch hostfiles).",
    )
    actions = cluster.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="check a hostfile, and how a model splits across its hosts",
        description=__doc__.split("\n\n")[1],
    )
    check.add_argument("--hostfile", required=True, help="the JSON hostfile mlx.launch reads")
    check.add_argument("--model", help="a local model directory to plan the split for")
    check.add_argument("--shard", choices=(TENSOR, PIPELINE), help="force a split (default: best)")


def run_cluster_command(args: argparse.Namespace) -> int:
    try:
        hostfile = read_hostfile(args.hostfile)
    except HostfileError as exc:
        print(f"mlx-kvserve: {exc}", file=sys.stderr)
        return 2
    backend = hostfile.backend or "ring"
    print(f"{hostfile.world_size} rank(s), backend {backend}:")
    for host in hostfile.hosts:
        print(f"  rank {host.rank}: {host.ssh} {' '.join(host.ips)}".rstrip())
    for host, ip in hostfile.public_addresses():
        print(
            f"warning: rank {host.rank} ({host.ssh}) listens on {ip}, outside the private "
            "ranges: the collectives take no authentication, use a private link "
            "(a Thunderbolt bridge)",
            file=sys.stderr,
        )
    if args.model is None:
        return 0
    try:
        mode = _plan(Path(args.model), hostfile.world_size, args.shard)
    except ShardingError as exc:
        print(f"mlx-kvserve: {exc}", file=sys.stderr)
        return 2
    print(f"model {args.model}: {mode} parallel across {hostfile.world_size} rank(s)")
    return 0


def _plan(model_dir: Path, world_size: int, shard: str | None) -> str:
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardingError(f"{model_dir}: no readable config.json ({exc})") from None
    from mlx_lm.utils import load_model  # heavy: only when a model is checked

    try:
        model, _ = load_model(model_dir, lazy=True, strict=False)
    except Exception as exc:  # an architecture mlx-lm cannot build
        raise ShardingError(f"{model_dir}: mlx-lm cannot build this model ({exc})") from None
    return plan_sharding(model, config, world_size, shard, name=str(model_dir)).mode
