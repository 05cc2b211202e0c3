"""The one thread that runs the engine's tensor work: it builds the engine, then runs the
engine loop.

Why one: each thread that starts OpenMP work (torch's CPU ops, our kernels) gets its own
pool of OpenMP threads, and once libgomp manages more threads than there are CPUs it
stops spin-waiting between parallel regions and puts its threads to sleep after every
one. A model loaded on the main thread and stepped on another thus leaves two pools, and
every one of a decode step's ~150 parallel regions pays a wake-up: measured on 2 cores,
a bf16 batch-1 step took 31.7 ms that way against 18.9 ms when one thread did both
(docs/benchmarks.md, "Serving path").
"""
from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EngineThread:
    """A daemon thread running submitted calls in order (a daemon, unlike a
    ThreadPoolExecutor's worker: a server that exits must not wait for it)."""

    def __init__(self, name: str = "stallfree-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((functools.partial(fn, *args), future))
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this thread; its result, or its exception raised here."""
        return self.submit(fn, *args).result()

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)
