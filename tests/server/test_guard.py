"""Browser defences: the Host allow-list (DNS rebinding), Origin checks, JSON-only POSTs, CORS.

The matrices below are the issue's table: each row is one request sent with exact headers over a
raw socket, and the status the server must answer.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.support.rawhttp import request

COMPLETION = b'{"prompt": "Hi", "max_tokens": 1}'
APP_ORIGIN = "http://app.example:3000"


def _local_address() -> str | None:
    """A non-loopback address of this machine, to bind the server to all interfaces."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


HOST_MATRIX = [
    # (Host header, expected status); {port} is the server's port
    ("127.0.0.1:{port}", 200),
    ("localhost:{port}", 200),
    ("localhost", 200),
    ("LocalHost.:{port}", 200),
    ("[::1]:{port}", 200),
    ("[::ffff:127.0.0.1]:{port}", 200),
    ("127.0.0.2:{port}", 200),
    ("evil.example", 403),
    ("evil.example:{port}", 403),
    ("localhost.evil.example:{port}", 403),
    ("127.0.0.1.nip.io:{port}", 403),
    ("", 403),
    ("127.0.0.1:1", 403),
    ("localhost:{port}0", 403),
    ("[::1]:1", 403),
    ("::1", 403),
    ("[::1", 403),
    ("[fe80::1%25lo]:{port}", 403),
    ("2130706433:{port}", 403),
    ("127.0.0.1:{port}@evil.example", 403),
]


@pytest.mark.parametrize(("host", "expected"), HOST_MATRIX)
def test_host_matrix(server, host, expected):
    response = request(server.port, "GET", "/v1/models", [("Host", host.format(port=server.port))])
    assert response.status == expected, response.body
    if expected == 403:
        error = response.json()["error"]
        assert error["code"] == "host_not_allowed"
        assert error["type"] == "permission_error"


def test_missing_and_repeated_host_are_refused(server):
    # HTTP/1.0 may omit Host: no name to check means no answer.
    bare = request(server.port, "GET", "/health", [], version="HTTP/1.0")
    assert bare.status == 403
    # HTTP/1.1 without Host is malformed: 400, still in the error shape.
    missing = request(server.port, "GET", "/health", [])
    assert missing.status == 400 and "error" in missing.json()
    # Two Host headers: h11 refuses the request as malformed (400); the guard would say 403.
    twice = [("Host", f"127.0.0.1:{server.port}"), ("Host", "evil.example")]
    refused = request(server.port, "GET", "/health", twice)
    assert refused.status in {400, 403} and "error" in refused.json()


ORIGIN_MATRIX = [
    (None, 200),
    ("http://127.0.0.1:{port}", 200),  # same origin
    ("http://evil.example", 403),
    ("https://evil.example", 403),
    ("null", 403),
    ("http://localhost:3000", 403),  # another local web app is another origin
    ("http://127.0.0.1:{port}.evil.example", 403),
    ("file://", 403),
    (APP_ORIGIN, 403),  # not configured on this server
]


@pytest.mark.parametrize(("origin", "expected"), ORIGIN_MATRIX)
def test_origin_matrix(server, origin, expected):
    headers = [("Host", f"127.0.0.1:{server.port}"), ("Content-Type", "application/json")]
    if origin is not None:
        headers.append(("Origin", origin.format(port=server.port)))
    response = request(server.port, "POST", "/v1/completions", headers, COMPLETION)
    assert response.status == expected, response.body
    assert "access-control-allow-origin" not in response.headers
    if expected == 403:
        assert response.json()["error"]["code"] == "origin_not_allowed"


def _engine_runs(server) -> int:
    return sum(1 for line in server.log().splitlines() if "text id=" in line)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_non_json_post_never_reaches_the_engine(server, content_type):
    runs = _engine_runs(server)
    headers = [("Host", f"127.0.0.1:{server.port}")]
    if content_type:
        headers.append(("Content-Type", content_type))
    response = request(server.port, "POST", "/v1/completions", headers, COMPLETION)
    assert response.status == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"
    # The cross-site form a web page can send without a preflight:
    headers.append(("Origin", "http://evil.example"))
    assert request(server.port, "POST", "/v1/completions", headers, COMPLETION).status == 403
    ok = [("Host", f"127.0.0.1:{server.port}"), ("Content-Type", "application/json; charset=utf-8")]
    assert request(server.port, "POST", "/v1/completions", ok, COMPLETION).status == 200
    server.wait_for_log("text id=", after=runs)  # the engine logs just after answering
    assert _engine_runs(server) == runs + 1  # only the JSON request generated


def test_public_bind_requires_a_key(tmp_path):
    from tests.support.servers import ServerProcess

    refused = ServerProcess(tmp_path, "--host", "0.0.0.0")
    assert refused.proc.wait(60) == 2
    assert "--insecure-public" in refused.log()
    assert "Traceback" not in refused.log()
    refused.stop()


@pytest.fixture(scope="module")
def public_server(tmp_path_factory):
    """Bound to every interface, with a key, an allowed host name and an allowed web origin."""
    from tests.support.servers import ServerProcess

    proc = ServerProcess(
        tmp_path_factory.mktemp("public"),
        "--host", "0.0.0.0", "--api-key", "sekrit",
        "--allowed-hosts", "myhost.example",
        "--allowed-origins", APP_ORIGIN,
    ).wait_ready()  # fmt: skip
    yield proc
    proc.stop()


def test_bound_address_and_allowed_hosts(public_server):
    port = public_server.port
    auth = ("Authorization", "bearer sekrit")  # the scheme is case-insensitive
    for host, expected in [
        (f"myhost.example:{port}", 200),
        ("myhost.example", 200),
        ("MyHost.Example:12345", 200),  # a name allowed without a port: any port (proxies)
        (f"other.example:{port}", 403),
        (f"192.0.2.77:{port}", 403),  # an address this connection did not arrive at
    ]:
        assert request(port, "GET", "/v1/models", [("Host", host), auth]).status == expected, host
    address = _local_address()
    if address is None:
        pytest.skip("no non-loopback address to connect to")
    with socket.create_connection((address, port), timeout=30) as sock:
        sock.sendall(
            f"GET /v1/models HTTP/1.1\r\nHost: {address}:{port}\r\nAuthorization: Bearer sekrit"
            "\r\nConnection: close\r\n\r\n".encode()
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200")


def test_cors_only_for_allowed_origins(public_server):
    base = public_server.base_url
    auth = {"Authorization": "Bearer sekrit"}
    preflight = {
        "Origin": "HTTP://APP.example:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    answer = httpx.options(base + "/v1/completions", headers=preflight)
    assert answer.status_code == 204
    assert answer.headers["access-control-allow-origin"] == APP_ORIGIN  # the configured one
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"]
    ok = httpx.post(
        base + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={**auth, "Origin": APP_ORIGIN},
        timeout=60,
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == APP_ORIGIN
    for origin in ("http://evil.example", "https://app.example:3000", "http://app.example"):
        denied = httpx.options(base + "/v1/completions", headers={**preflight, "Origin": origin})
        assert denied.status_code == 403, origin
        assert "access-control-allow-origin" not in denied.headers
        post = httpx.post(
            base + "/v1/completions", json={"prompt": "Hi"}, headers={**auth, "Origin": origin}
        )
        assert post.status_code == 403, origin
