"""The engine core in a thread or in its own process, with the server's per-output work.

Run: .venv/bin/python benchmarks/engine_process.py [--streams 1,32] [--tokens 64]
[--rounds 3] [--dtype auto] [--neighbour]

The server steps the engine on a thread of its own and hands each step's outputs to the
asyncio loop on the main thread, which turns every output into an SSE chunk; the two
threads share one GIL. vLLM v1 and mini-sglang run the engine core in a process of its
own instead. Before building that, this measures what it changes here: the same engine
steps `streams` requests at once (256-token prompts, `tokens` forced outputs each) while
an asyncio loop does the per-output work (an OpenAI completion chunk as JSON, written to
a socket that a client process drains), with the engine

- on a thread, outputs handed over by call_soon_threadsafe (the server's arrangement);
- in a child process, each step's outputs pickled over a pipe the loop reads;
- with --neighbour, also on a thread beside a Python thread that never blocks (what a busy
  event loop would be): the GIL the engine thread waits for after each kernel call.

Both run with the same compute threads on the same cores, rounds alternated. Prints per
arrangement and stream count: the batch's output tokens per second and the median gap
between a stream's chunks as the loop writes them (the ITL a client would see, less the
socket), each the median over rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from typing import Any

from stallfree.executor.hardware import vector_flags

PROMPT_LEN = 256


def _engine(dtype: str) -> Any:
    from stallfree import LLM

    return LLM(dtype=dtype, max_model_len=1024, enable_prefix_caching=False).engine


def _add(engine: Any, streams: int, tokens: int, round_: int) -> None:
    from stallfree import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for s in range(streams):  # distinct prompts: nothing from a prefix cache
        ids = [(j * 7919 + s * 104729 + round_ * 31) % 40000 + 100 for j in range(PROMPT_LEN)]
        engine.add_request(f"{round_}-{s}", ids, params)


def _outputs(step: Any) -> list[tuple[str, str, str | None]]:
    return [(o.request_id, o.new_text, o.finish_reason) for o in step.outputs]


def _run_steps(engine: Any, send: Any) -> None:
    while engine.has_unfinished_requests():
        send(_outputs(engine.step()))
    send(None)


def _child(conn: Any, dtype: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    engine = _engine(dtype)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        _add(engine, *job)
        _run_steps(engine, conn.send)


def _drain(sock: socket.socket) -> None:
    while sock.recv(1 << 16):
        pass


class Consumer:
    """The event loop's part: a chunk per output, written to the client's socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.last, self.gaps, self.tokens = sock, {}, [], 0
        self.done = asyncio.get_running_loop().create_future()

    def take(self, outputs: list | None) -> None:
        if outputs is None:
            self.done.set_result(None)
            return
        now = time.perf_counter()
        for rid, text, finish in outputs:
            chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0,
                     "model": "m", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish}]}
            self.sock.sendall(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
            if rid in self.last:
                self.gaps.append(now - self.last[rid])
            self.last[rid], self.tokens = now, self.tokens + 1


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


async def _round(arrangement: str, worker: Any, streams: int, tokens: int, round_: int,
                 sock: socket.socket) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    consumer = Consumer(sock)
    stop = threading.Event()
    if arrangement == "neighbour":
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    start = time.perf_counter()
    if arrangement in ("thread", "neighbour"):
        engine, thread = worker
        thread.submit(_add, engine, streams, tokens, round_).result()
        steps = thread.submit(_run_steps, engine,
                              lambda out: loop.call_soon_threadsafe(consumer.take, out))
        # A failed step ends the round with its error instead of a wait for ever.
        steps.add_done_callback(lambda f: f.exception() and loop.call_soon_threadsafe(
            consumer.done.set_exception, f.exception()))
    else:
        conn = worker
        conn.send((streams, tokens, round_))
        loop.add_reader(conn.fileno(), lambda: consumer.take(conn.recv()))
    try:
        await consumer.done
    finally:
        stop.set()
    elapsed = time.perf_counter() - start
    if arrangement == "process":
        loop.remove_reader(worker.fileno())
    return consumer.tokens / elapsed, statistics.median(consumer.gaps or [0.0]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--neighbour", action="store_true",
                        help="also the engine thread beside a spinning Python thread")
    args = parser.parse_args()
    import torch

    from stallfree.server.engine_thread import EngineThread

    threads = torch.get_num_threads()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_child, args=(child, args.dtype, threads))
    proc.start()
    thread = EngineThread()
    engine = thread.run(lambda: (torch.set_num_threads(threads), _engine(args.dtype))[1])
    assert parent.recv() == "ready"
    server_end, client_end = socket.socketpair()
    client = mp.get_context("spawn").Process(target=_drain, args=(client_end,))
    client.start()
    workers = {"thread": (engine, thread), "process": parent, "neighbour": (engine, thread)}
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    print(f"CPU flags: {vector_flags()}; {threads} compute threads")
    for streams in map(int, args.streams.split(",")):
        for r in range(args.rounds + 1):  # round 0 warms both up
            order = ["thread", "process"] if r % 2 else ["process", "thread"]
            order += ["neighbour"] if args.neighbour else []
            for name in order:
                got = asyncio.run(_round(name, workers[name], streams, args.tokens,
                                         r, server_end))
                if r:
                    results.setdefault((name, streams), []).append(got)
    parent.send(None)
    proc.join()
    server_end.close()
    client.join()
    print("| streams | arrangement | output tok/s | median gap ms | rounds (tok/s) |")
    print("|---|---|---|---|---|")
    for (name, streams), rows in results.items():
        rates = [f"{tok:.0f}" for tok, _ in rows]
        print(f"| {streams} | {name} | {statistics.median(t for t, _ in rows):.1f} | "
              f"{statistics.median(g for _, g in rows):.2f} | {' '.join(rates)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
