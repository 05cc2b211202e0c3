"""The engine's side of tensor/pipeline parallelism: start workers, send batches, collect tokens.

The engine process holds no weights. It runs the TCPStore that is both the
torch.distributed rendezvous and the message board: batch k goes under msg/k,
every rank reads it, and TP rank 0 of the last stage answers under out/k. Every
message is typed, encrypted and signed, and a forged one is ignored (channel.py).
The store listens on loopback only when every rank is local, else on MASTER_ADDR's
interface alone. With PP = M, up to M
batches are in flight: stage 0 starts batch k+1 while stage 1 still computes batch
k. A rank whose heartbeat stops for HEARTBEAT_DEADLINE_S fails the engine
(`WorkerError`) instead of leaving it waiting. A chunk whose values cannot be sent
fails its request alone, and the batch index advances only once a batch is written,
so the workers never wait for a message that was not sent.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
import weakref
from collections import deque

import torch.distributed as dist

from ..config import ParallelConfig
from ..executor.base import RunnerOutput, WorkerError
from ..executor.hardware import available_cores
from ..scheduler.output import SchedulerOutput
from .channel import SECRET_ENV, Channel, new_secret, secret_from_env
from .messages import (
    STOP_KEY,
    KvMessage,
    RunResult,
    WorkerConfig,
    WorkerInfo,
    run_message,
    runner_output,
    without_unsendable,
)

# A rank silent this long is taken for dead (it posts every 0.5 s; a busy rank too,
# from its own thread).
HEARTBEAT_DEADLINE_S = 10.0
LOOPBACK = "127.0.0.1"


def threads_per_worker(world_size: int, requested: int | None = None) -> int | None:
    """CPU threads per local worker: the ones asked for, else (unless OMP_NUM_THREADS is
    set) an even share of the cores this process may use, each used once, since
    oversubscribed OpenMP threads collapse."""
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, available_cores() // world_size)


def _listening_socket(addr: str, port: int) -> socket.socket:
    """A socket listening on `addr` only (TCPStore alone would listen on every interface)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class DistributedExecutor:
    def __init__(self, worker_config: WorkerConfig, parallel: ParallelConfig) -> None:
        self.depth = parallel.pipeline_parallel_size  # micro-batches in flight at most
        self.world_size = parallel.world_size
        self._worker_config, self._parallel = worker_config, parallel
        self._start()

    @property
    def restartable(self) -> bool:
        """Only workers this process started can be started again."""
        return self._num_local == self.world_size

    def restart(self) -> None:
        """Stops whatever is left of the workers and starts them all afresh (a new store,
        so nothing of the old run's messages remains); the KV cache must be reset after."""
        if not self.restartable:
            raise WorkerError("workers on other machines cannot be restarted from here: "
                              "restart them and the server")
        self.shutdown(grace=1.0)
        self._start()

    def _start(self) -> None:
        worker_config, parallel = self._worker_config, self._parallel
        local = self.world_size if parallel.num_local_workers is None \
            else parallel.num_local_workers
        self._num_local = local
        all_local = local == self.world_size
        # Every rank here: nothing needs to reach the store from outside this machine.
        addr = LOOPBACK if all_local else os.environ.get("MASTER_ADDR", LOOPBACK)
        secret = secret_from_env()
        if secret is None:
            if not all_local:
                raise ValueError(f"workers on other machines need the run's secret: set "
                                 f"{SECRET_ENV} (e.g. `openssl rand -hex 32`) here and there "
                                 f"(docs/parallelism.md)")
            secret = new_secret()
        self._secret = secret
        # Port 0: the socket binds a free port itself (no pick-then-bind race).
        sock = _listening_socket(addr, int(os.environ.get("MASTER_PORT") or 0))
        port = sock.getsockname()[1]
        self.store = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60),
                                   master_listen_fd=sock.detach())
        self.channel = Channel(self.store, secret)
        self.channel.put("config", worker_config)
        self.procs = [self._launch(rank, addr, port, local, all_local) for rank in range(local)]
        # Stops the workers when the engine is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self.channel, self.procs)
        self._next = 0  # index of the next message
        # Per batch submitted: its index (None if nothing of it was sent) and the requests
        # that failed to send, answered with its result.
        self._in_flight: deque[tuple[int | None, dict[str, str]]] = deque()
        self._heartbeats: dict[int, tuple[int, float]] = {}  # rank -> (last count, seen at)
        self.workers: list[WorkerInfo] = self._wait_ready(parallel.startup_timeout)

    def _launch(self, rank: int, addr: str, port: int, local: int,
                all_local: bool) -> subprocess.Popen:
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(local), **{SECRET_ENV: self._secret.hex()})
        if all_local:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too
        return subprocess.Popen([sys.executable, "-m", "stallfree", "worker"], env=env)

    def _wait_ready(self, timeout: float) -> list[WorkerInfo]:
        deadline = time.monotonic() + timeout

        def check() -> None:
            self._check()
            if time.monotonic() > deadline:
                self.shutdown()
                raise WorkerError(f"workers did not load their shards within {timeout:.0f} s")
        return [self.channel.get(f"ready/{r}", WorkerInfo, check)
                for r in range(self.world_size)]

    def _check(self) -> None:
        """Raises WorkerError (after stopping every worker) if any worker failed."""
        failure = None
        # A dead process is the root cause; the survivors' errors only echo it. A killed
        # rank's peers may exit on their own (gloo's broken connection) before this check
        # sees either, so every dead rank is named, those killed by a signal first.
        dead = [(rank, proc) for rank, proc in enumerate(self.procs) if proc.poll() is not None]
        if dead:
            dead.sort(key=lambda item: item[1].returncode >= 0)
            failure = "; ".join(f"worker rank {rank} (pid {proc.pid}) exited with code "
                                f"{proc.returncode}" for rank, proc in dead)
        if failure is None:  # a forged error is no failure: only a rank's signed one is
            failure = self.channel.read_genuine("error", str)
        if failure is None:
            failure = self._silent_rank()
        if failure is not None:
            self.shutdown(grace=1.0)  # the others cannot finish their batch anyway
            raise WorkerError(failure)

    def check(self) -> None:
        """Raises WorkerError if a worker died, failed or went silent (when idle too)."""
        self._check()

    def _silent_rank(self) -> str | None:
        """Why a rank counts as dead: its heartbeat stopped (a rank that never sent one is
        still starting; the startup timeout covers it)."""
        now = time.monotonic()
        for rank in range(self.world_size):
            count = self.channel.read_genuine(f"hb/{rank}", int)  # a forged one is none
            if count is None:
                continue
            last = self._heartbeats.get(rank)
            # Only a higher count is a beat: an old signed one, replayed, is not.
            if last is None or count > last[0]:
                self._heartbeats[rank] = (count, now)
            elif now - last[1] > HEARTBEAT_DEADLINE_S:
                return (f"worker rank {rank} sent no heartbeat for {now - last[1]:.0f} s "
                        f"(its machine or process hangs, or the network is cut)")
        return None

    def _send(self, message: object) -> int:
        index = self._next
        self.channel.put(f"msg/{index}", message)  # raises having written nothing
        self._next = index + 1  # only now: the workers wait for msg/<index> next
        return index

    # ---- the executor interface (executor/base.py) -----------------------------
    def free_memory(self) -> int | None:
        free = [w.free_memory for w in self.workers]
        return None if None in free else min(free)

    def reset_kv(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        """(Re)allocates every rank's KV cache (of the `kv_cache_dtype` setting); waits until
        all have done it."""
        assert not self._in_flight, "KV cache reset with batches in flight"
        index = self._send(KvMessage(num_blocks, block_size, kv_cache_dtype))
        for rank in range(self.world_size):
            self.channel.get(f"ack/{index}/{rank}", bool, self._check)
            self.channel.delete(f"ack/{index}/{rank}")

    def submit(self, output: SchedulerOutput) -> None:
        message, failed = run_message(output), {}
        try:
            index = self._send(message)
        except (OverflowError, TypeError, ValueError):
            # A request's own values: it fails alone (rare, so only now is each checked).
            message, failed = without_unsendable(message)
            index = self._send(message) if message.chunks else None
        self._in_flight.append((index, failed))

    def receive(self) -> RunnerOutput:
        """The result of the oldest batch in flight (waits for it)."""
        index, failed = self._in_flight.popleft()
        if index is None:  # every chunk failed to send: the workers never saw it
            now = time.monotonic()
            return RunnerOutput(failed=failed, stage_times=[(now, now)] * self.depth)
        result = runner_output(self.channel.get(f"out/{index}", RunResult, self._check))
        result.failed.update(failed)
        times = [f"times/{index}/{stage}" for stage in range(self.depth)]
        result.stage_times = [self.channel.get(key, tuple[float, float], self._check)
                              for key in times]
        # Every rank has read msg/index: the last stage could not finish without them.
        self.channel.delete(f"msg/{index}", f"out/{index}", *times)
        return result

    def shutdown(self, grace: float = 10.0) -> None:
        if self._finalizer.detach() is not None:
            _stop_workers(self.channel, self.procs, grace)


def _stop_workers(channel: Channel, procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    try:
        channel.put(STOP_KEY, True)
    except Exception:  # noqa: BLE001 - the store may be broken; the workers still go
        pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
