"""The server's tokenizer work, off the event loop and never sharing a tokenizer.

HF `tokenizers` objects take a Rust borrow per call: one used from two threads at
once can fail with "Already borrowed". The engine thread keeps the engine's own
tokenizer (prompts of the offline API, incremental detokenizing); the pool's threads
each check out a private copy, made up front, so no copy ever serves two threads.
A long prompt or chat template then stalls neither the event loop nor the engine.
"""
from __future__ import annotations

import asyncio
import copy
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, tokenizer: Any, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(threads):
            self._copies.put(copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="stallfree-tokenizer")

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        tokenizer = self._copies.get()  # one per thread: never more callers than copies
        try:
            return fn(tokenizer, *args)
        finally:
            self._copies.put(tokenizer)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` on a pool thread with a tokenizer of its own."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
