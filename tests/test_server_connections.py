"""Hostile connections (server/connections.py): idle sockets cannot use up the server's
file descriptors, nor hold a connection without sending their headers."""
from __future__ import annotations

import contextlib
import resource
import socket
import sys

import httpx
import pytest

from stallfree.bench.systems import ServerProcess, System

FD_LIMIT = 512  # the server's open-file limit (hard and soft): small, to be used up here
PATIENCE = 20  # seconds a test waits for what must happen: a bound on a hang, not a timing


def _serve(model: str, *args: str) -> ServerProcess:
    command = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", sys.executable, "-m",
               "stallfree", "serve", "--host", "127.0.0.1", "--port", "{port}",
               "--uvicorn-log-level", "warning", "--model", model, "--dtype", "float32",
               "--max-model-len", "64", *args]
    return ServerProcess(System("stallfree-fds", command=command,
                                env={"HF_HUB_OFFLINE": "1"}), startup_timeout=240)


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = _serve(tiny_model, "--header-timeout", "2")
    yield proc
    proc.stop(grace=15)


@contextlib.contextmanager
def idle_sockets(port: int, count: int):
    """`count` connections that send part of a request's headers and then nothing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 256)), hard))
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(PATIENCE)
            with contextlib.suppress(OSError):  # one dropped already
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_idle_sockets_beyond_the_fd_limit_leave_health_answering(server):
    """Twice the server's descriptors in silent sockets: before, accept() failed with
    EMFILE and /health timed out; now the longest idle make room."""
    with idle_sockets(server.port, 2 * FD_LIMIT):
        health = httpx.get(server.base_url + "/health", timeout=PATIENCE)
        assert health.status_code == 200
        completion = httpx.post(server.base_url + "/v1/completions", timeout=PATIENCE,
                                json={"prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200
    log = server.log_tail(1 << 20)
    # Never out of descriptors (before: a traceback each time accept() failed).
    assert "Too many open files" not in log and "out of system resource" not in log
    # Logged once, not per socket.
    assert log.count("closing connections that send no request") == 1, log[-3000:]


def test_a_socket_that_never_finishes_its_headers_is_closed(server):
    """Before, it was held forever; now it gets a 408 naming --header-timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"--header-timeout" in reply
