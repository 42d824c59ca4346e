"""The hostfile of a job across machines, in `mlx.launch`'s own format, checked before anything
starts.

MLX reads it (`mlx._distributed_utils.common.Hostfile`): a JSON object with `hosts` (each `ssh`,
the name to log in to, `ips`, the addresses the ring backend connects to, and `rdma`, JACCL's
devices), an optional `backend` and `envs`; or just the list of hosts. MLX's parser takes any
shape and fails later, inside a launch, with a `KeyError` or a connection that never comes up.
Here every problem is said first, naming the host and the cause, and so is an address outside
the private ranges: the collectives' ports take no authentication, so the ranks must share a
private link (a Thunderbolt bridge).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve.json_value import JSON

BACKENDS = ("", "ring", "jaccl", "jaccl-ring", "mpi")


class HostfileError(ValueError):
    """A hostfile that cannot run a job; the message names the file, the host and the cause."""


@dataclass(frozen=True)
class JobHost:
    """One rank's machine: `ssh` to log in to it, `ips` the ring backend connects to."""

    rank: int
    ssh: str
    ips: tuple[str, ...]
    rdma: tuple[JSON, ...]  # as the hostfile gives them, for mlx.launch


@dataclass(frozen=True)
class JobHostfile:
    path: Path
    hosts: tuple[JobHost, ...]
    backend: str
    envs: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def public_addresses(self) -> list[tuple[JobHost, str]]:
        """(host, address) for each address outside private, loopback and link-local ranges."""
        found = []
        for host in self.hosts:
            for ip in host.ips:
                addr = ipaddress.ip_address(ip)
                if not (addr.is_private or addr.is_loopback or addr.is_link_local):
                    found.append((host, ip))
        return found


def read_hostfile(path: str | Path) -> JobHostfile:
    """Parse and check a hostfile; raises HostfileError naming the host and the cause."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise HostfileError(f"hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HostfileError(f"hostfile {path}: not JSON ({exc})") from None
    return parse_hostfile(data, path)


def parse_hostfile(data: JSON, path: Path) -> JobHostfile:
    """Check a parsed hostfile document (see `read_hostfile`)."""
    where = f"hostfile {path}"
    backend: JSON = ""
    envs: JSON = []
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"hosts", "backend", "envs"})
        if unknown:
            raise HostfileError(f"{where}: unknown key(s) {unknown}; expected hosts, backend, envs")
        if "hosts" not in data:
            raise HostfileError(f"{where}: no 'hosts' list")
        hosts, backend, envs = data["hosts"], data.get("backend", ""), data.get("envs", [])
    elif isinstance(data, list):
        hosts = data
    else:
        raise HostfileError(f"{where}: expected an object with 'hosts' or a list of hosts")
    if backend not in BACKENDS:
        names = ", ".join(b for b in BACKENDS if b)
        raise HostfileError(f"{where}: backend {backend!r} is not one of {names}")
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError(f"{where}: 'envs' must be a list of NAME=value strings")
    if not isinstance(hosts, list) or not hosts:
        raise HostfileError(f"{where}: 'hosts' must be a non-empty list")
    parsed = tuple(
        _host(rank, entry, len(hosts), backend, where) for rank, entry in enumerate(hosts)
    )
    return JobHostfile(path, parsed, backend, tuple(envs))


def _host(rank: int, entry: JSON, count: int, backend: str, where: str) -> JobHost:
    if not isinstance(entry, dict):
        raise HostfileError(f"{where}: host {rank} is not an object with 'ssh' and 'ips'")
    name = entry.get("ssh")
    if not isinstance(name, str) or not name.strip():
        raise HostfileError(f"{where}: host {rank} has no 'ssh' name")
    who = f"{where}: host {rank} ({name!r})"
    unknown = sorted(set(entry) - {"ssh", "ips", "rdma"})
    if unknown:
        raise HostfileError(f"{who}: unknown key(s) {unknown}; expected ssh, ips, rdma")
    ips = entry.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostfileError(f"{who}: 'ips' must be a list of addresses")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise HostfileError(f"{who}: {ip!r} is not an IP address") from None
    if backend in ("", "ring") and count > 1 and not ips:
        raise HostfileError(f"{who}: the ring backend needs the address it listens on in 'ips'")
    rdma = entry.get("rdma", [])
    if not isinstance(rdma, list):
        raise HostfileError(f"{who}: 'rdma' must be a list (one device per host)")
    if backend in ("jaccl", "jaccl-ring") and len(rdma) != count:
        raise HostfileError(
            f"{who}: JACCL needs {count} 'rdma' entries (one per host), got {len(rdma)}"
        )
    return JobHost(rank, name, tuple(ips), tuple(rdma))
