"""A 150K-value enum's compile beside simple requests, on a real server on 127.0.0.1.

Run: .venv/bin/python benchmarks/grammar_compiles.py [--rounds 5] [--model PATH]

Starts `stallfree serve` with the compile bounds raised (so the enum really compiles),
then measures, each a median over `rounds` requests:
1. a simple regex request (a new regex each time: it compiles) and a plain one, idle;
2. the same while the 150K-value enum compiles (it runs until --max-grammar-compile-
   seconds, then gets its 400);
3. the server's RSS, compile processes included, before the enum, while it compiles,
   and once it was refused; then the same for an enum whose client leaves (aborted).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil

HUGE_ENUM = {"enum": [f"value-{i:06d}" for i in range(150_000)]}


def _rss_mib(pid: int) -> float:
    """The server's resident memory with its children's (the compile processes)."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"stallfree:{name}"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _timed(url: str, body: dict) -> float:
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def _simple(url: str, i: int) -> float:
    return _timed(url, {"prompt": "Number:", "max_tokens": 8,
                        "structured_outputs": {"regex": f"[0-9]{{3}}-{i}"}})


def _plain(url: str) -> float:
    return _timed(url, {"prompt": "Hello", "max_tokens": 8})


def _huge(url: str, outcome: dict, timeout: float | None = None, title: str = "") -> None:
    schema = {**HUGE_ENUM, "title": title}  # a new title: a new compile, not a cached refusal
    try:
        reply = httpx.post(url + "/v1/completions", timeout=timeout, json={
            "prompt": "Pick:", "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}})
        outcome["status"] = reply.status_code
    except httpx.TimeoutException:
        outcome["status"] = "client left"


def _until_compiling(url: str) -> None:
    while _metric(url, "grammar_compiles_running") < 1:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--compile-seconds", type=int, default=60)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "stallfree", "serve", "--port", str(args.port),
               "--max-model-len", "1024", "--uvicorn-log-level", "warning",
               "--max-constraint-bytes", "8MiB", "--max-grammar-bytes", "4GiB",
               "--max-grammar-compile-seconds", str(args.compile_seconds)]
    server = subprocess.Popen(command + (["--model", args.model] if args.model else []))
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        _simple(url, -1)  # warm: the compile processes start with the first grammar
        idle = [_simple(url, i) for i in range(args.rounds)]
        idle_plain = [_plain(url) for _ in range(args.rounds)]
        rss_before = _rss_mib(server.pid)
        outcome: dict = {}
        huge = threading.Thread(target=_huge, args=(url, outcome))
        started = time.perf_counter()
        huge.start()
        _until_compiling(url)
        busy = [_simple(url, 100 + i) for i in range(args.rounds)]
        busy_plain = [_plain(url) for _ in range(args.rounds)]
        rss_during = _rss_mib(server.pid)
        huge.join()
        huge_seconds = time.perf_counter() - started
        time.sleep(5)  # the killed compile process's replacement starts
        rss_refused = _rss_mib(server.pid)
        aborted: dict = {}
        leaving = threading.Thread(target=_huge, args=(url, aborted, 10.0, "aborted"))
        left = time.perf_counter()
        leaving.start()
        leaving.join()
        while _metric(url, "grammar_compiles_running") > 0:
            time.sleep(0.2)
        stopped = time.perf_counter() - left
        time.sleep(5)
        rss_aborted = _rss_mib(server.pid)
        med = statistics.median
        print(f"simple regex request, idle:            {med(idle):7.3f} s median")
        print(f"simple regex request, enum compiling:  {med(busy):7.3f} s median")
        print(f"plain request, idle:                   {med(idle_plain):7.3f} s median")
        print(f"plain request, enum compiling:         {med(busy_plain):7.3f} s median")
        print(f"150K enum request: {outcome.get('status')} after {huge_seconds:.1f} s")
        print(f"aborted enum request: {aborted.get('status')} after 10 s; its compile "
              f"stopped {stopped:.1f} s after it was sent")
        print(f"RSS (server + compile processes): before {rss_before:.0f} MiB, during "
              f"{rss_during:.0f} MiB, after the refusal {rss_refused:.0f} MiB, after the "
              f"abort {rss_aborted:.0f} MiB")
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("stallfree:grammar"):
                print("  " + line)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
