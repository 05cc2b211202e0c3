"""The engine's side of tensor/pipeline parallelism: start workers, send batches, collect tokens.

The engine process holds no weights. It runs the TCPStore that is both the
torch.distributed rendezvous and the message board: batch k goes under msg/k,
every rank reads it, and TP rank 0 of the last stage answers under out/k.
With PP = M, up to M batches are in flight: stage 0 starts batch k+1 while
stage 1 still computes batch k.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import weakref
from collections import deque

import torch.distributed as dist

from ..config import ParallelConfig
from ..executor.base import RunnerOutput
from ..executor.hardware import available_cores
from ..scheduler.output import SchedulerOutput
from . import channel
from .worker import WorkerConfig, WorkerInfo


class WorkerError(RuntimeError):
    """A worker failed or exited; the engine cannot go on."""


def threads_per_worker(world_size: int, requested: int | None = None) -> int | None:
    """CPU threads per local worker: the ones asked for, else (unless OMP_NUM_THREADS is
    set) an even share of the cores this process may use, each used once, since
    oversubscribed OpenMP threads collapse."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, available_cores() // world_size)


class DistributedExecutor:
    def __init__(self, worker_config: WorkerConfig, parallel: ParallelConfig) -> None:
        self.depth = parallel.pipeline_parallel_size  # micro-batches in flight at most
        self.world_size = parallel.world_size
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # Port 0: the store binds a free port itself (no pick-then-bind race).
        self.store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT") or 0), is_master=True,
                                   wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        port = self.store.port
        channel.put(self.store, "config", worker_config)
        local = self.world_size if parallel.num_local_workers is None \
            else parallel.num_local_workers
        self.procs = [self._launch(rank, addr, port, local) for rank in range(local)]
        # Stops the workers when the engine is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self.store, self.procs)
        self._next = 0  # index of the next message
        self._in_flight: deque[int] = deque()
        self.workers: list[WorkerInfo] = self._wait_ready(parallel.startup_timeout)

    def _launch(self, rank: int, addr: str, port: int, local: int) -> subprocess.Popen:
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(local))
        return subprocess.Popen([sys.executable, "-m", "stallfree", "worker"], env=env)

    def _wait_ready(self, timeout: float) -> list[WorkerInfo]:
        deadline = time.monotonic() + timeout

        def check() -> None:
            self._check()
            if time.monotonic() > deadline:
                self.shutdown()
                raise WorkerError(f"workers did not load their shards within {timeout:.0f} s")
        return [channel.get(self.store, f"ready/{r}", check) for r in range(self.world_size)]

    def _check(self) -> None:
        """Raises WorkerError (after stopping every worker) if any worker failed."""
        failure = None
        # A dead process is the root cause; the survivors' errors only echo it.
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                failure = f"worker rank {rank} (pid {proc.pid}) exited with code " \
                          f"{proc.returncode}"
                break
        if failure is None and self.store.check(["error"]):
            failure = channel.get(self.store, "error")
        if failure is not None:
            self.shutdown(grace=1.0)  # the others cannot finish their batch anyway
            raise WorkerError(failure)

    def _send(self, kind: str, payload: object) -> int:
        index, self._next = self._next, self._next + 1
        channel.put(self.store, f"msg/{index}", (kind, payload))
        return index

    # ---- the executor interface (executor/base.py) -----------------------------
    def free_memory(self) -> int | None:
        free = [w.free_memory for w in self.workers]
        return None if None in free else min(free)

    def reset_kv(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocates every rank's KV cache; waits until all have done it."""
        assert not self._in_flight, "KV cache reset with batches in flight"
        index = self._send("kv", (num_blocks, block_size))
        for rank in range(self.world_size):
            channel.get(self.store, f"ack/{index}/{rank}", self._check)
            channel.delete(self.store, f"ack/{index}/{rank}")

    def submit(self, output: SchedulerOutput) -> None:
        self._in_flight.append(self._send("run", output))

    def receive(self) -> RunnerOutput:
        """The result of the oldest batch in flight (waits for it)."""
        index = self._in_flight.popleft()
        result: RunnerOutput = channel.get(self.store, f"out/{index}", self._check)
        times = [f"times/{index}/{stage}" for stage in range(self.depth)]
        result.stage_times = [channel.get(self.store, key, self._check) for key in times]
        # Every rank has read msg/index: the last stage could not finish without them.
        channel.delete(self.store, f"msg/{index}", f"out/{index}", *times)
        return result

    def shutdown(self, grace: float = 10.0) -> None:
        if self._finalizer.detach() is not None:
            _stop_workers(self.store, self.procs, grace)


def _stop_workers(store: dist.Store, procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    try:
        store.set("stop", b"1")
    except Exception:  # noqa: BLE001 - the store may be broken; the workers still go
        pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
