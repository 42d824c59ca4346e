"""`serve --hostfile FILE`: start every rank with `mlx.launch` and stand for the job as one process.

A service manager needs one process that stops cleanly on SIGTERM and exits non-zero when the
job failed. `mlx.launch` is neither: on SIGTERM it dies and leaves its ranks running, and it
exits 0 whatever its ranks did. This process runs it as a child, on the host of rank 0 (the
first host of the hostfile), and:
- passes a SIGTERM or SIGINT on to rank 0, which drains its requests and stops every rank at
  the same turn (rank 0 tells where it runs through a pid file in a private directory);
- reads the ranks' exit codes from the launcher's warnings (`Node with rank R exited with code
  C`, passed through to its own stderr) and exits with the job's: 0 when every rank stopped
  cleanly, 75 when a peer was lost (the service manager restarts the job), else the first
  failure's.
The ranks run `python -m mlx_kvserve serve` with this process's interpreter path and the same
options: every host needs the same install at the same path, and its copy of the model.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mlx_kvserve.distributed.hostfile import HostfileError, read_hostfile

log = logging.getLogger("mlx_kvserve")

RANK_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
PIDFILE_ENV = "MLX_KVSERVE_RANK0_PIDFILE"
EXIT_PEER_LOST = 75


def launcher_path() -> str:
    """`mlx.launch` beside this interpreter (a virtualenv's), else on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.exists() else (shutil.which("mlx.launch") or "mlx.launch")


def serve_argv(argv: list[str]) -> list[str]:
    """The options of `serve` as given, less `--hostfile` (the ranks run inside the job)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--hostfile":
            skip = True
        elif not arg.startswith("--hostfile="):
            out.append(arg)
    return out


def run_job(hostfile_path: str, ring_port: int, grace: float, argv: list[str]) -> int:
    """Run the job until it ends; its exit code (see the module's docstring)."""
    try:
        hostfile = read_hostfile(hostfile_path)
    except HostfileError as exc:
        log.error("%s", exc)
        return 2
    for host, ip in hostfile.public_addresses():
        log.warning(
            "rank %d (%s) listens on %s, outside the private ranges: the collectives take no "
            "authentication; link the hosts by a private network (a Thunderbolt bridge)",
            host.rank,
            host.ssh,
            ip,
        )
    private = Path(tempfile.mkdtemp(prefix="mlx-kvserve-job-"))  # 0700
    pidfile = private / "rank0.pid"
    command = [launcher_path(), "--hostfile", str(hostfile.path)]
    command += ["--backend", hostfile.backend or "ring", "--starting-port", str(ring_port)]
    command += ["--env", f"{PIDFILE_ENV}={pidfile}", "--"]
    command += [sys.executable, "-m", "mlx_kvserve", "serve", *serve_argv(argv)]
    log.info(
        "starting a job of %d ranks on %s",
        hostfile.world_size,
        ", ".join(h.ssh for h in hostfile.hosts),
    )
    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    codes: dict[int, int] = {}
    reader = threading.Thread(target=_pass_stderr, args=(proc, codes), daemon=True)
    reader.start()
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        threading.Thread(target=_stop_rank_0, args=(proc, pidfile, grace), daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        launcher_code = proc.wait()
        reader.join(5)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return job_exit_code(codes, launcher_code)


def job_exit_code(codes: dict[int, int], launcher_code: int) -> int:
    """The job's exit code from its ranks' (the launcher's own only when it failed itself)."""
    failed = {rank: code for rank, code in codes.items() if code != 0}
    if any(code == EXIT_PEER_LOST for code in failed.values()):
        return EXIT_PEER_LOST
    if failed:
        code = failed[min(failed)]
        return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
    return launcher_code if launcher_code > 0 else 0


def _pass_stderr(proc: subprocess.Popen, codes: dict[int, int]) -> None:
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        found = RANK_EXIT.search(line)
        if found:
            codes[int(found.group(1))] = int(found.group(2))
        sys.stderr.write(line)
        sys.stderr.flush()


def _stop_rank_0(proc: subprocess.Popen, pidfile: Path, grace: float) -> None:
    """SIGTERM to rank 0 (it drains, then stops the others); the launcher if rank 0 is not
    here or the job outlives its grace."""
    try:
        os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
        log.info("stopping the job: rank 0 drains its requests, then every rank stops")
    except (OSError, ValueError):
        log.warning("rank 0 is not running on this host: stopping the launcher instead")
        proc.terminate()
    deadline = time.monotonic() + grace + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        log.error("the job did not stop in time: ending the launcher")
        proc.kill()


def warn_public_ring() -> None:
    """On rank 0 of any job: warn when the ring's addresses (MLX_HOSTFILE, written by
    `mlx.launch`) leave the private ranges; the collectives take no authentication."""
    import ipaddress
    import json

    path = os.environ.get("MLX_HOSTFILE")
    try:
        ring = json.loads(Path(path).read_text()) if path else []
        addresses = {str(item).rsplit(":", 1)[0] for node in ring for item in node}
    except (OSError, ValueError, TypeError):
        return
    for address in sorted(addresses):
        try:
            ip = ipaddress.ip_address(address.strip("[]"))
        except ValueError:
            continue
        if not (ip.is_private or ip.is_loopback or ip.is_link_local):
            log.warning(
                "the job's ranks talk over %s, outside the private ranges: the collectives "
                "take no authentication; link the hosts by a private network",
                address,
            )


def note_rank_0(rank: int) -> None:
    """On rank 0 of a job started by `serve --hostfile`: say where it runs, for its stop."""
    path = os.environ.get(PIDFILE_ENV)
    if rank != 0 or not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{os.getpid()}\n")
    except OSError as exc:  # another host: the launcher stops the job its own way
        log.info("rank 0 could not note its pid for the launcher (%s)", exc)


__all__ = ["job_exit_code", "note_rank_0", "run_job", "serve_argv", "warn_public_ring"]
