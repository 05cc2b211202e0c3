"""Compile processes (`worker.py`), each compiling one grammar at a time.

A compile is cancelled, or cut off at its time bound, by killing its process: xgrammar
offers no other way, and the kill also frees whatever the compile allocated. A fresh
process replaces it at once (~3 s to import xgrammar), so the next compile finds one
warm. With several processes, a long compile holds one and the others keep going.
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("stallfree.structured")

class CompileRefused(Exception):
    """A compile stopped at one of its bounds; the message names the flag that sets it."""


class CompileCancelled(RuntimeError):
    """Every request waiting for the compile left, so it was stopped."""


@dataclass(eq=False)
class CompileJob:
    grammar_json: str  # xgrammar's Grammar.serialize_json
    max_bytes: int  # the largest compiled grammar kept (--max-grammar-bytes)
    timeout: int  # seconds (--max-grammar-compile-seconds)
    future: Future = field(default_factory=Future)  # of (compiled grammar, its bytes)
    process: _Process | None = None  # while it compiles
    cancelled: bool = False


class _Process:
    """One compile process and its two pipes; ready once its xgrammar is loaded."""

    def __init__(self, info_json: str, threads: int) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        # The folder holding the package (stallfree/structured/pool.py, two levels up).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "stallfree.structured.worker", str(to_child),
             str(from_child)], pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL,
            env=env)
        os.close(to_child)
        os.close(from_child)
        self.send = Connection(from_parent, readable=False)
        self.recv = Connection(to_parent, writable=False)
        self.send.send((info_json, threads))
        self.recv.recv()  # ("ready",); EOFError if it died on the way

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self.send.close()
        self.recv.close()


class CompilePool:
    """Runs `CompileJob`s on `processes` compile processes, first come first served.

    `info_json` gives the tokenizer's info (called once, lazily); `load` turns a compiled
    grammar's JSON into the grammar, on the pool's thread that waited for it.
    """

    def __init__(self, info_json: Callable[[], str], load: Callable[[str], Any],
                 processes: int, threads: int) -> None:
        self._info_json = info_json
        self._load = load
        self._processes = processes
        self._threads = threads
        self._queue: queue.Queue[CompileJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._serving: list[threading.Thread] = []
        self._live: set[_Process] = set()
        self._running = 0

    def run(self, job: CompileJob) -> None:
        with self._lock:
            if not self._serving:  # started with the first compile: most servers never need it
                for i in range(self._processes):
                    thread = threading.Thread(target=self._serve, daemon=True,
                                              name=f"stallfree-grammar-{i}")
                    thread.start()
                    self._serving.append(thread)
        self._queue.put(job)

    @property
    def running(self) -> int:
        """Compiles taken from the queue and not yet answered."""
        return self._running

    def cancel(self, job: CompileJob) -> None:
        """Stops `job`: dropped if queued, its process killed if compiling."""
        with self._lock:
            job.cancelled = True
            process = job.process
        job.future.cancel()  # succeeds only while it waits in the queue
        if process is not None:
            process.kill()

    def shutdown(self) -> None:
        for _ in self._serving:
            self._queue.put(None)
        with self._lock:
            for process in self._live:
                process.kill()

    def _spawn(self) -> _Process | None:
        try:
            process = _Process(self._info_json(), self._threads)
        except Exception:  # noqa: BLE001 - e.g. no memory for it: its job fails, not the pool
            logger.exception("cannot start a grammar compile process")
            return None  # tried again for the next job
        with self._lock:
            self._live.add(process)
        return process

    def _retire(self, process: _Process) -> None:
        with self._lock:
            self._live.discard(process)
        process.close()

    def _serve(self) -> None:
        process = self._spawn()
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            process = process or self._spawn()
            with self._lock:
                job.process = process
                self._running += 1
                cancelled = job.cancelled
            reply: tuple | None = ("died",)
            if process is not None and not cancelled:
                try:
                    process.send.send((job.grammar_json, job.max_bytes))
                    reply = process.recv.recv() if process.recv.poll(job.timeout) else None
                except (EOFError, OSError):
                    reply = ("died",)
            with self._lock:
                job.process = None
                cancelled = job.cancelled
            # Killed, timed out, or holding a large compile's memory: start afresh (after
            # answering: the refusal need not wait for the new process).
            stale = process is not None and (reply is None or reply[0] in ("died", "too_large"))
            if stale:
                self._retire(process)
            self._finish(job, reply, cancelled)
            with self._lock:
                self._running -= 1
            if stale:
                process = self._spawn()
        if process is not None:
            self._retire(process)

    def _finish(self, job: CompileJob, reply: tuple | None, cancelled: bool) -> None:
        if cancelled:
            job.future.set_exception(CompileCancelled("every request for it left"))
        elif reply is None:
            job.future.set_exception(CompileRefused(
                f"its grammar did not compile within {job.timeout} s (this server's "
                f"--max-grammar-compile-seconds)"))
        elif reply[0] == "too_large":
            job.future.set_exception(CompileRefused(
                f"its compiled grammar takes {reply[1]} bytes; at most {job.max_bytes} "
                f"(this server's --max-grammar-bytes)"))
        elif reply[0] == "ok":
            try:
                job.future.set_result((self._load(reply[1]), reply[2]))
            except Exception as exc:  # noqa: BLE001 - the request fails, not the pool
                job.future.set_exception(exc)
        else:
            job.future.set_exception(RuntimeError(
                "the grammar compile process died" if reply[0] == "died" else reply[1]))
