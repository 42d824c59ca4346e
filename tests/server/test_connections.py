"""Connections cannot take the server down: silent and slowloris clients, slow bodies, a low
open-file limit, and resource-exhaustion logs that stay one line per interval."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.rawhttp import read_response
from tests.support.servers import ServerProcess

needs_prlimit = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="prlimit (util-linux) is Linux-only"
)

LIMIT = 64


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    proc = ServerProcess(
        tmp_path_factory.mktemp("conn"),
        "--max-connections", str(LIMIT),
        "--header-timeout", "1", "--idle-timeout", "1", "--body-timeout", "1",
    ).wait_ready()  # fmt: skip
    yield proc
    proc.stop()


def healthy(server) -> bool:
    return httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (EOF or reset), after reading what it sent."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def wait_all_closed(socks: list[socket.socket], guard: float = 60.0) -> int:
    for sock in socks:
        sock.setblocking(False)
    open_ = list(socks)
    deadline = time.monotonic() + guard  # a guard against hanging, not a benchmark
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not closed_by_server(s)]
        time.sleep(0.05)
    return len(socks) - len(open_)


def test_silent_connections_do_not_lock_out_health(tight_server):
    socks = []
    try:
        for i in range(300):
            socks.append(socket.create_connection(("127.0.0.1", tight_server.port)))
            if i % 100 == 99:
                assert healthy(tight_server)  # more silent connections than the cap: still up
        assert healthy(tight_server)
        assert wait_all_closed(socks) == 300  # evicted for room, or timed out: none held
    finally:
        for sock in socks:
            sock.close()
    log = tight_server.log()
    assert log.count(f"connection limit ({LIMIT}) reached") == 1, log  # once per interval
    assert "Traceback" not in log


def test_slowloris_headers_time_out_with_408(tight_server):
    socks = [socket.create_connection(("127.0.0.1", tight_server.port)) for _ in range(20)]
    for sock in socks:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{tight_server.port}\r\n".encode())
    answers = []
    try:
        alive = list(socks)
        for _ in range(200):  # one header byte per socket per round, as slowloris does
            if not alive:
                break
            for sock in list(alive):
                try:
                    sock.sendall(b"X")
                except OSError:
                    alive.remove(sock)
                    continue
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    answers.append(read_response(sock))
                    alive.remove(sock)
            time.sleep(0.1)
            assert healthy(tight_server)
        assert not alive, f"{len(alive)} slow connections still open"
    finally:
        for sock in socks:
            sock.close()
    statuses = [a.status for a in answers if a is not None]
    assert statuses and set(statuses) == {408}
    assert all(a.json()["error"]["code"] == "request_timeout" for a in answers if a)


def test_slow_body_is_408(tight_server):
    with socket.create_connection(("127.0.0.1", tight_server.port), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{tight_server.port}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'.encode()
        )
        response = read_response(sock)
    assert response is not None and response.status == 408
    assert response.json()["error"]["code"] == "request_timeout"


def test_idle_keepalive_connection_is_closed(tight_server):
    with socket.create_connection(("127.0.0.1", tight_server.port), timeout=60) as sock:
        sock.sendall(
            f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{tight_server.port}\r\n\r\n".encode()
        )
        response = read_response(sock)
        assert response is not None and response.status == 200
        assert wait_all_closed([sock]) == 1


@needs_prlimit
def test_low_open_file_limit_caps_connections(start_server):
    srv = start_server(prefix=("prlimit", "--nofile=256:256"))
    assert "open-file limit 256: at most 96 connections (not 1000), accept backlog 24" in srv.log()
    socks = []
    try:
        for _ in range(400):  # more connections than the process has file descriptors
            socks.append(socket.create_connection(("127.0.0.1", srv.port)))
        assert healthy(srv)
        reply = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60
        )
        assert reply.status_code == 200
    finally:
        for sock in socks:
            sock.close()
    log = srv.log()
    assert "Traceback" not in log
    assert "out of system resource" not in log  # the cap kept accept() from failing at all


HOLDER = """
import asyncio, logging, sys
from mlx_kvserve.net.resources import install_log_filters
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
if sys.argv[2] == "filtered":
    install_log_filters()
held = []
class Hold(asyncio.Protocol):
    def connection_made(self, transport):
        held.append(transport)
async def main():
    server = await asyncio.get_running_loop().create_server(Hold, "127.0.0.1", 0, backlog=512)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(float(sys.argv[1]))
asyncio.run(main())
"""


def _exhaust(mode: str) -> str:
    """Run an asyncio server with 40 file descriptors and connect 200 clients to it."""
    proc = subprocess.Popen(
        ["prlimit", "--nofile=40:40", sys.executable, "-c", HOLDER, "3.5", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    port = int(proc.stdout.readline())
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    _, err = proc.communicate(timeout=60)
    for sock in socks:
        sock.close()
    return err


@needs_prlimit
def test_exhausted_descriptors_log_once_per_interval():
    unfiltered = _exhaust("plain")
    assert unfiltered.count("out of system resource") >= 2  # the flood being prevented
    filtered = _exhaust("filtered")
    assert filtered.count("out of system resource") == 1, filtered
    assert "Traceback" not in filtered
