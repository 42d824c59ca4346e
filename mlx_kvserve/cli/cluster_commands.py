"""`mlx-kvserve cluster check`: is a hostfile, and a model split across its hosts, runnable?

Checked before any machine is contacted: the hostfile in `mlx.launch`'s format (every host
named, every address an address, JACCL's devices one per host), addresses outside private
ranges (the collectives take no authentication), and, with `--model DIR`, how the model splits
across that many ranks (see `distributed.sharding`; the model is built from its config alone,
no weight is read). Exit status 0 when the job can run, 2 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_kvserve.distributed.hostfile import HostfileError, read_hostfile
from mlx_kvserve.distributed.sharding import (
    PIPELINE,
    TENSOR,
    ShardingError,
    plan_for_directory,
)


def add_cluster_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    join = actions.add_parser(
        "join",
        help="on every rank of an mlx.launch job: check the model, load the shards, step once",
        description=(
            "Run by mlx.launch on every rank, e.g. `mlx.launch --hostfile hosts.json -- "
            "mlx-kvserve cluster join --model DIR`. Every rank fingerprints its copy of the "
            "model (a rank whose files differ is named with its host), loads its shard and "
            "decodes a few greedy tokens together with the others; the tokens must agree. "
            "Exit status 0 on every rank when the job can serve, 2 with the same reason on "
            "every rank otherwise; a peer that dies or stops answering ends the job (75)."
        ),
    )
    join.add_argument("--model", required=True, help="the local model directory on every host")
    join.add_argument("--shard", choices=(TENSOR, PIPELINE), help="force a split (default: best)")
    join.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a peer may take to answer (30)"
    )


def run_cluster_command(args: argparse.Namespace) -> int:
    if args.cluster_command == "join":
        return _join(args)
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
        mode = plan_for_directory(Path(args.model), hostfile.world_size, args.shard)
    except ShardingError as exc:
        print(f"mlx-kvserve: {exc}", file=sys.stderr)
        return 2
    print(f"model {args.model}: {mode} parallel across {hostfile.world_size} rank(s)")
    return 0


def _join(args: argparse.Namespace) -> int:
    from mlx_kvserve.blas import preload_optimised_blas

    preload_optimised_blas()  # before the first `import mlx`, as `serve` does
    from mlx_kvserve.distributed.collective import Collective
    from mlx_kvserve.distributed.join import JoinError, join_model

    collective = Collective.join(timeout=args.timeout)
    try:
        joined = join_model(collective, Path(args.model), args.shard)
    except (JoinError, ShardingError) as exc:  # the same on every rank
        print(f"mlx-kvserve: rank {collective.rank}: {exc}", file=sys.stderr, flush=True)
        collective.barrier("refusal")  # mlx.launch ends the others once one rank exits
        return 2
    except (OSError, ValueError) as exc:  # this rank's own files
        print(f"mlx-kvserve: rank {collective.rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    if collective.is_leader:
        print(
            f"{collective.size} rank(s) on {', '.join(joined.hosts)}: {joined.plan.mode} "
            f"parallel, model {joined.fingerprint}; greedy probe {joined.probe} on every rank"
        )
    return 0
