"""Connections a client holds without finishing a request: a head or body that trickles in (or
never comes) is cut with a 408 within the configured limits, and a client that goes away
mid-request costs one INFO line, not an ERROR with a traceback. Raw sockets against a real
`kvship serve` on loopback; every wait is bounded."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import start_server

HEADER_S = 1.5
BODY_S = 2.0
KEEP_ALIVE_S = 4.0  # longer than the head's limit: what cuts a half-sent head is the head's limit
SLACK_S = 3.0  # scheduling on a loaded 2-core machine
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
GOOD = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "256", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "5",
                       "--timeout-request-header", str(HEADER_S), "--timeout-request-body", str(BODY_S),
                       "--timeout-keep-alive", str(KEEP_ALIVE_S))
    yield srv
    assert srv.stop() == 0, srv.log()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=HEADER_S + BODY_S + KEEP_ALIVE_S + SLACK_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds it)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def trickle(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Send `data` a byte at a time until it is sent or the server closes the connection."""
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except OSError:
            return
        time.sleep(every_s)


def parse(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in `raw` (Content-Length framed)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers["content-length"])
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        raw = rest[n:]
    return out


def assert_408(response: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = response
    assert status == 408 and headers["connection"] == "close", response
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}


def test_connection_that_sends_nothing_is_closed(server):
    started = time.monotonic()
    with connect(server) as sock:
        assert read_until_closed(sock) == b""
    assert HEADER_S - 0.2 <= time.monotonic() - started <= HEADER_S + SLACK_S


@pytest.mark.parametrize("every_s", [0.1, 0.4])
def test_head_that_trickles_gets_408(server, every_s):
    started = time.monotonic()
    with connect(server) as sock:
        trickle(sock, HEAD + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n", every_s)
        (response,) = parse(read_until_closed(sock))
    assert_408(response)
    assert time.monotonic() - started <= HEADER_S + SLACK_S


def test_body_that_trickles_gets_408(server):
    started = time.monotonic()
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(GOOD))
        trickle(sock, GOOD, 0.2)
        (response,) = parse(read_until_closed(sock))
    assert_408(response)
    assert BODY_S - 0.2 <= time.monotonic() - started <= BODY_S + SLACK_S


def test_body_that_never_comes_gets_408(server):
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: 500\r\n\r\n")
        (response,) = parse(read_until_closed(sock))
    assert_408(response)


def test_half_sent_head_after_a_keep_alive_response_gets_408(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        started = time.monotonic()
        trickle(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"b" * 100 + b"\r\n\r\n", 0.1)
        first, second = parse(read_until_closed(sock))
    assert first[0] == 200
    assert_408(second)
    assert time.monotonic() - started <= HEADER_S + SLACK_S


def test_requests_inside_the_limits_are_served(server):
    """A body sent in pieces within the limit, and several requests on one keep-alive connection,
    each head starting well inside the limits."""
    with connect(server) as sock:
        for _ in range(3):
            sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(GOOD))
            for i in range(0, len(GOOD), len(GOOD) // 3 + 1):
                sock.sendall(GOOD[i:i + len(GOOD) // 3 + 1])
                time.sleep(0.2)
            data = b""
            while b"\r\n\r\n" not in data or len(parse_partial(data)) == 0:
                chunk = sock.recv(65536)
                assert chunk, "closed before the response"
                data += chunk
            status, headers, body = parse_partial(data)[0]
            assert status == 200 and json.loads(body)["object"] == "chat.completion", body
            time.sleep(HEADER_S / 2)


def parse_partial(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return []
    length = next((int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")),
                  0)
    return parse(raw) if len(rest) >= length else []


def test_clients_that_leave_mid_request_log_one_info_line_each(server):
    before = server.log()
    clients = 40
    for i in range(clients):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            path = (b"/v1/chat/completions", b"/v1/completions", b"/tokenize", b"/v1/responses")[i % 4]
            sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' * (i % 2))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        new = server.log()[len(before):]
        if new.count("client disconnected") >= clients:
            break
        time.sleep(0.2)
    new = server.log()[len(before):]
    assert "ERROR" not in new and "Traceback" not in new, new[:3000]
    assert new.count("client disconnected") == clients, new[:3000]
    assert all(" INFO " in line for line in new.splitlines() if "client disconnected" in line)
    r = httpx.post(server.url + "/v1/chat/completions", content=GOOD, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("flag,value", [("--timeout-request-header", "0"), ("--timeout-request-body", "-1"),
                                        ("--timeout-keep-alive", "inf"), ("--timeout-request-body", "soon")])
def test_time_limits_must_be_positive_seconds(flag, value):
    done = subprocess.run([sys.executable, "-m", "kvship.cli", "serve", flag, value], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and flag in done.stderr, done.stderr
