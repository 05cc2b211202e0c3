"""Hostile clients beside honest ones, on a real server (127.0.0.1, started and stopped by
PID): /health and completion latency while idle sockets with unfinished headers are held,
and /health and a running stream's longest token gap while 4 MiB token-id bodies arrive.

    python benchmarks/hostile_connections.py --sockets 8192 --fd-limit 4096 --rounds 5

Run it against another tree (e.g. a git worktree of an older commit) with
PYTHONPATH=<tree>: the server is `python -m stallfree serve` from whatever imports.
Bounded: --sockets sockets, --rounds rounds, each request's wait --patience seconds
(a request that waited that long counts as timed out).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time

import httpx

from stallfree.bench.systems import ServerProcess, System


def start_server(args: argparse.Namespace) -> ServerProcess:
    command = ["prlimit", f"--nofile={args.fd_limit}:{args.fd_limit}", sys.executable, "-m",
               "stallfree", "serve", "--host", "127.0.0.1", "--port", "{port}",
               "--uvicorn-log-level", "warning", "--max-model-len", str(args.max_model_len)]
    return ServerProcess(System("hostile", command=command, env={"HF_HUB_OFFLINE": "1"}))


def timed(call) -> float:
    """Seconds `call` took; inf if it failed or timed out."""
    start = time.perf_counter()
    try:
        response = call()
        return time.perf_counter() - start if response.status_code < 500 else float("inf")
    except httpx.HTTPError:
        return float("inf")


@contextlib.contextmanager
def idle_sockets(port: int, count: int):
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError, OSError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        time.sleep(0.5)  # let the connections complete before their partial headers
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        yield socks
    finally:
        for sock in socks:
            sock.close()


def connections_round(server: ServerProcess, args: argparse.Namespace) -> dict:
    url = server.base_url
    log_before = os.path.getsize(server.log_path)
    with idle_sockets(server.port, args.sockets):
        health = timed(lambda: httpx.get(url + "/health", timeout=args.patience))
        completion = timed(lambda: httpx.post(url + "/v1/completions", timeout=args.patience,
                                              json={"prompt": "Hi", "max_tokens": 4}))
    return {"health_s": health, "completion_s": completion,
            "log_bytes": os.path.getsize(server.log_path) - log_before}


def stream_gaps(url: str, stop: threading.Event, gaps: list[float], patience: float) -> None:
    """Streams a long completion; records the gap before each token."""
    body = {"prompt": "Once", "max_tokens": 100000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=patience) as reply:
        last = time.perf_counter()
        for line in reply.iter_lines():
            now = time.perf_counter()
            if line.startswith("data: {"):
                gaps.append(now - last)
                last = now
            if stop.is_set():
                break


def bodies_round(server: ServerProcess, args: argparse.Namespace) -> dict:
    url = server.base_url
    ids = [1000 + i % 20000 for i in range(args.body_bytes // 6)]  # ~6 bytes an id
    body = json.dumps({"prompt": ids, "max_tokens": 1}, separators=(",", ":")).encode()
    stop, gaps = threading.Event(), []
    streamer = threading.Thread(target=stream_gaps, args=(url, stop, gaps, args.patience))
    streamer.start()
    while not gaps:  # the stream is running
        time.sleep(0.05)
    before = len(gaps)
    senders = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                kwargs={"content": body, "timeout": args.patience,
                                        "headers": {"content-type": "application/json"}})
               for _ in range(args.bodies)]
    for sender in senders:
        sender.start()
    health = timed(lambda: httpx.get(url + "/health", timeout=args.patience))
    for sender in senders:
        sender.join()
    stop.set()
    streamer.join()
    return {"health_s": health, "stream_max_gap_s": max(gaps[before:], default=float("inf")),
            "body_bytes": len(body)}


def medians(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=8192)
    parser.add_argument("--fd-limit", type=int, default=4096, help="the server's (prlimit)")
    parser.add_argument("--bodies", type=int, default=8)
    parser.add_argument("--body-bytes", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--patience", type=float, default=10.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.sockets + 512), hard))
    server = start_server(args)
    try:
        connections = [connections_round(server, args) for _ in range(args.rounds)]
        bodies = [bodies_round(server, args) for _ in range(args.rounds)]
    finally:
        server.stop(grace=15)
        os.unlink(server.log_path)
    print(json.dumps({"idle_sockets": {"rounds": connections, "median": medians(connections)},
                      "large_bodies": {"rounds": bodies, "median": medians(bodies)}}, indent=1))


if __name__ == "__main__":
    main()
