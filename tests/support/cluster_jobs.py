"""Jobs of several ranks for the tests: `serve` under `mlx.launch --backend ring` on loopback
(or `serve --hostfile` with hosts named 127.0.0.1), and the requests the cluster tests send."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.launch import BIND_FAILED, free_ports, launch_prefix, rank_pids
from tests.support.servers import ServerProcess
from tests.support.tiny_models import make_model_dir


@pytest.fixture(scope="session")
def job_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny models the job tests split: llama (4 heads, 2 KV heads), qwen3_next."""
    work = tmp_path_factory.mktemp("cluster-models")
    return {
        "llama": make_model_dir(work / "llama", "llama"),
        "qwen3_next": make_model_dir(work / "qwen3_next", "qwen3_next"),
    }


@pytest.fixture(scope="session")
def llama_alone(job_models, tmp_path_factory):
    """One process serving the tiny llama: what a job's answers must equal."""
    work = tmp_path_factory.mktemp("alone")
    server = ServerProcess(work, "--model", str(job_models["llama"])).wait_ready()
    yield server
    server.stop()


class Job(ServerProcess):
    """A server run by `mlx.launch` on `ranks` ranks; the process is the launcher."""

    def __init__(self, workdir: Path, ranks: int, *args: str, wrap: tuple[str, ...] = ()) -> None:
        """`wrap` runs each rank's command under a wrapper (`launch.on_rank`). No `--seed`: rank 0
        seeds what comes unseeded (distributed/request_wire.py), as a test checks; the requests
        compared with one process's answers are greedy or name their seed."""
        no_seed = {"MLX_KVSERVE_SEED": "-1"}
        super().__init__(workdir, *args, env=no_seed, prefix=launch_prefix(ranks) + wrap)

    def ranks(self) -> dict[int, int]:
        try:
            return rank_pids(self.proc.pid)
        except OSError:  # the launcher has just exited
            return {}

    def exit_codes(self) -> dict[int, int]:
        """Per rank, what mlx.launch reports (it exits 0 itself whatever its ranks did)."""
        found = re.findall(r"Node with rank (\d+) exited with code (-?\d+)", self.log())
        return {int(rank): int(code) for rank, code in found}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """A stop as a service manager's reaches rank 0: it drains and stops the others."""
        ranks = self.ranks() if self.proc.poll() is None else {}
        if 0 in ranks:
            with_signal(ranks[0], sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        code = super().stop(signal.SIGKILL, timeout)  # the launcher, if it is still there
        for pid in ranks.values():  # a killed launcher leaves its ranks running
            with_signal(pid, signal.SIGKILL)
        return code


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def start_job(
    workdir: Path, ranks: int, *args: str, ready: bool = True, wrap: tuple[str, ...] = ()
) -> Job:
    """A job, started again on other ports if the ring lost a race for one."""
    for _ in range(3):
        job = Job(workdir, ranks, *args, wrap=wrap)
        if not ready:
            return job
        try:
            return job.wait_ready(timeout=300)
        except RuntimeError:
            job.stop()
            if BIND_FAILED not in job.log():
                raise
    raise RuntimeError("the ring backend could not bind its ports three times")


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server: ServerProcess, i: int, **extra) -> dict:
    options = {"max_tokens": 6 + 3 * i, "temperature": 0, **extra}
    reply = client(server).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": f"Tell me about the number {i}, please."}],
        **options,
    )
    return reply.model_dump()["choices"][0]


def conversation(server: ServerProcess, turns: int) -> list[tuple[str, int]]:
    """A conversation of `turns` greedy turns: (each answer, its cached prompt tokens)."""
    messages = [{"role": "system", "content": "You answer briefly and kindly. " * 12}]
    seen = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what about {turn}?"})
        reply = client(server).chat.completions.create(
            model="llama", messages=messages, max_tokens=10, temperature=0
        )
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        details = reply.usage.prompt_tokens_details
        seen.append((text, details.cached_tokens if details else 0))
    return seen


def answers(server: ServerProcess, count: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: chat(server, i), range(count)))


def hostfile_job(tmp_path: Path, *args: str) -> ServerProcess:
    """`serve --hostfile` over two ranks on this machine (hosts named 127.0.0.1 run locally)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    for _ in range(3):
        port = str(free_ports(2))
        server = ServerProcess(tmp_path, "--hostfile", str(hosts), "--ring-port", port, *args)
        try:
            return server.wait_ready(timeout=300)
        except RuntimeError:
            server.stop()
            if BIND_FAILED not in server.log():
                raise
    raise RuntimeError("the ring backend could not bind its ports three times")


def ranks_of(server: ServerProcess) -> dict[int, int]:
    """The ranks under `serve --hostfile`'s launcher (its one child)."""
    pid = server.proc.pid
    (launcher,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return rank_pids(int(launcher))
