"""The engine thread and its asyncio bridge.

`LLMEngine` is synchronous and not thread-safe, so one dedicated thread owns it:
it takes commands (add, abort, call) from a thread-safe queue between
iterations, runs `engine.step()` while anything is unfinished, and hands each
request's deltas to that request's asyncio queue with
`loop.call_soon_threadsafe`. The HTTP event loop never touches the engine (`call`
runs a function on the engine thread, e.g. to reset the prefix cache), and
a slow client never slows the batch: its deltas just pile up in its own queue.

Which failure a request or the engine survives, and what a client then sees:
`engine_errors.py`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from ..executor.base import WorkerError
from ..iteration_log import IterationLog
from ..sampling_params import SamplingParams
from .engine_commands import Abort, AddCall, CallEngine, Command, Prompt, Reply, Stop
from .engine_errors import EngineDeadError, QueueFullError, RequestFailedError
from .engine_thread import EngineThread
from .prometheus import ServerMetrics

logger = logging.getLogger("stallfree.server")

# Failed steps in a row after which the engine is declared dead: recovery ends every
# request, so a failure that outlives that is the engine's, not a request's.
MAX_CONSECUTIVE_FAILURES = 3
# Worker restarts in a row (no step completing between them) before giving up.
MAX_WORKER_RESTARTS = 3
IDLE_CHECK_S = 1.0  # how often an idle engine's workers are looked at
IDLE_TURN_S = 0.5  # the longest an idle loop waits for a command before turning again
# The loop turns at least every IDLE_TURN_S when idle and once a step when busy; one
# that has not turned for this long is stuck (a step that never returns, wedged
# workers): /health says so, for the supervisor to restart the server. Long enough for
# the slowest honest step, a worker restart that reloads the weights included.
STALL_TIMEOUT_S = 120.0


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_len: int
    prompt_counted: bool = False


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


Deliveries = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]]


def _add(deliveries: Deliveries, tracked: _Tracked, item: Any) -> None:
    """Queues `item` for `tracked`'s event loop (handed over once per loop and step)."""
    deliveries.setdefault(tracked.loop, []).append((tracked.queue, item))


class AsyncEngine:
    """Owns an `LLMEngine` in a background thread; async methods for the event loop."""

    def __init__(self, engine: Any, model_name: str = "model",
                 max_waiting_requests: int | None = None,
                 metrics: ServerMetrics | None = None,
                 iteration_log: IterationLog | None = None,
                 on_fatal: Callable[[], None] | None = None,
                 thread: EngineThread | None = None,
                 stall_timeout: float | None = STALL_TIMEOUT_S) -> None:
        """`thread`: the thread that built `engine`, so that its steps run where its
        tensors were made (engine_thread.py says why); default, a new one.
        `stall_timeout`: seconds the loop may go without turning before the engine counts
        as stalled (`stalled_for`); None never."""
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if stall_timeout is not None and not stall_timeout > 2 * IDLE_TURN_S:
            # Else an idle loop, waiting for commands between turns, would look stuck.
            raise ValueError(f"stall_timeout must exceed {2 * IDLE_TURN_S} s (or be None), "
                             f"got {stall_timeout!r}")
        self.stall_timeout = stall_timeout
        self._turned_at = time.monotonic()  # when the loop last turned (engine thread writes)
        self.engine = engine
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics or ServerMetrics(model_name)
        self.metrics.set_engine_info(engine.info)
        self.iteration_log = iteration_log
        self.on_fatal = on_fatal  # runs once, on the engine thread, when the engine dies
        self._commands: queue.Queue[Command] = queue.Queue()
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._failures = 0  # failed steps in a row
        self._restarts = 0  # worker restarts in a row
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loop = (thread or EngineThread()).submit(self._run)

    # ---- event-loop side ------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self._death() is not None

    @property
    def crashed(self) -> bool:
        """Dead by a failure (not by shutdown): the process should exit non-zero."""
        return self.is_dead and not self._stopping

    @property
    def dead_reason(self) -> str | None:
        death = self._death()
        return None if death is None else f"{type(death).__name__}: {death}"

    @property
    def stalled_for(self) -> float | None:
        """Seconds since the engine loop last turned, once past `stall_timeout` (a step,
        or a worker restart, that does not return); None while it keeps turning."""
        since = time.monotonic() - self._turned_at
        timeout = self.stall_timeout
        return since if timeout is not None and since > timeout else None

    def _death(self) -> BaseException | None:
        """Why the engine loop is over; None while it runs. A loop that ended without
        recording why (it never ran, or failed outside its own handler) is dead all the
        same: else /health would answer 200 and requests queue for nobody."""
        if self._dead is not None or not self._loop.done():
            return self._dead
        if self._loop.cancelled():
            return EngineDeadError("the engine loop was cancelled")
        return self._loop.exception() or EngineDeadError("the engine loop ended")

    def _put(self, command: Command) -> None:
        with self._lock:
            if self.is_dead:
                raise EngineDeadError(f"the engine has stopped ({self.dead_reason})")
            self._commands.put(command)

    async def add_requests(self, requests: Sequence[tuple[str, Prompt]], params: SamplingParams,
                           out: asyncio.Queue, arrival_time: float | None = None) -> None:
        """Submits one call's requests, (request id, prompt) each, all or none; their
        StepOutputs, then final RequestOutputs, go to `out`. Raises ValueError (a bad
        request), QueueFullError or EngineDeadError. Errors after acceptance arrive in
        `out` as exception objects."""
        reply = Reply.new()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._put(AddCall(list(requests), params, out, arrival, reply))
        await reply.fut

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between iterations; its result (or error).
        Raises EngineDeadError if the engine has stopped."""
        reply = Reply.new()
        self._put(CallEngine(fn, reply))
        return await reply.fut

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks (a no-op once it finished)."""
        try:
            self._put(Abort(request_id))
        except EngineDeadError:
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._dead is None and not self._stopping:
                self._stopping = True
                self._commands.put(Stop())
        futures.wait([self._loop], timeout)

    # ---- engine thread --------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        check_workers = getattr(engine, "check_workers", None)
        next_check = time.monotonic()
        try:
            while True:
                self._turned_at = time.monotonic()  # a float store: atomic for readers
                self._drain(block=not engine.has_unfinished_requests())
                if self._stopping:
                    self._fail_all(EngineDeadError("the server is shutting down"))
                    return
                if check_workers is not None and not engine.has_unfinished_requests() \
                        and time.monotonic() >= next_check:
                    # Idle, nobody would notice a dead worker until the next request:
                    # look now, so that it is restarted (or the server exits) meanwhile.
                    next_check = time.monotonic() + IDLE_CHECK_S
                    try:
                        check_workers()
                    except WorkerError as exc:
                        self._restart_workers(exc)
                if engine.has_unfinished_requests():
                    try:
                        self._step()
                        self._failures = self._restarts = 0
                    except WorkerError as exc:
                        self._restart_workers(exc)
                    except Exception as exc:  # noqa: BLE001 - recover, or die below
                        self._recover(exc)
                self.metrics.observe_stats(self.engine.stats())
        except BaseException as exc:  # noqa: BLE001 - any failure to recover kills the loop
            logger.exception("engine loop failed; failing every request")
            self._fail_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"),
                           cause=exc)
            if self.on_fatal is not None:
                self.on_fatal()

    def _restart_workers(self, exc: WorkerError) -> None:
        """Workers died: start them again and recompute what ran; raises (the engine then
        dies) when they cannot be restarted or keep failing."""
        self._restarts += 1
        if not getattr(self.engine.executor, "restartable", False) \
                or self._restarts > MAX_WORKER_RESTARTS:
            raise RuntimeError(f"workers failed and could not be restarted ({self._restarts - 1} "
                               f"restarts in a row): {exc}") from exc
        logger.error("workers failed (%s); restarting them (%d in a row)", exc, self._restarts)
        try:
            self.engine.restart_executor()
        except Exception as err:  # noqa: BLE001 - the engine dies with this reason
            raise RuntimeError(f"workers failed and could not be restarted: {err}") from err
        self.metrics.worker_restarts.inc()

    def _recover(self, exc: Exception) -> None:
        """After a step failed for no single request's fault: fails the requests the engine
        held, leaves it empty and usable; raises when failures persist."""
        self._failures += 1
        if self._failures > MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"{MAX_CONSECUTIVE_FAILURES} steps in a row failed; "
                               f"the last: {type(exc).__name__}: {exc}") from exc
        logger.exception("an engine step failed; failing the requests it held")
        error = RequestFailedError(f"the engine failed while running this request "
                                   f"({type(exc).__name__}: {exc}); retry it")
        self.engine.abort_all()
        self._fail_tracked(error)

    def _fail_tracked(self, error: BaseException) -> None:
        """Hands `error` to every tracked request and forgets them."""
        deliveries: Deliveries = {}
        for tracked in self._tracked.values():
            _add(deliveries, tracked, error)
        self._tracked.clear()
        self._deliver(deliveries)

    def _write_log(self, record: Any) -> None:
        """One iteration record; a log that cannot be written (disk full) is dropped,
        never the server."""
        try:
            self.iteration_log.write(record)
        except (OSError, ValueError) as exc:
            logger.error("the iteration log failed (%s); it is closed and no longer "
                         "written, serving goes on", exc)
            log, self.iteration_log = self.iteration_log, None
            log.close_quietly()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_TURN_S) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add_call(self, add: AddCall) -> None:
        if add.reply.cancelled:
            return
        engine = self.engine
        limit = self.max_waiting_requests
        waiting = engine.stats().num_waiting
        asked = add.params.n * len(add.requests)
        # Sequences, not requests: n and every prompt of the call count. An empty queue
        # takes any call (--max-sequences bounds it), so that none is refused forever.
        if limit is not None and waiting and waiting + asked > limit:
            add.reply.send(error=QueueFullError(
                f"the server is busy: {waiting} sequences are waiting and this asks for "
                f"{asked} more (--max-waiting-requests {limit}); retry later"))
            return
        added: list[tuple[str, int]] = []
        try:
            for rid, prompt in add.requests:
                ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
                engine.add_request(rid, ids, add.params, arrival_time=add.arrival)
                added.append((rid, len(ids)))
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone, all of it
            for rid, _ in added:
                engine.abort_request(rid)
            add.reply.send(error=exc)
            return
        for rid, prompt_len in added:
            self._tracked[rid] = _Tracked(add.reply.loop, add.out, prompt_len)
        add.reply.send()

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddCall):
            self._add_call(command)
        elif isinstance(command, Abort):
            if self._tracked.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
                self.metrics.aborted.inc()
        elif isinstance(command, CallEngine):
            try:
                result = command.fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                command.reply.send(error=exc)
            else:
                command.reply.send(result)
        elif isinstance(command, Stop):
            self._stopping = True

    def _step(self) -> None:
        metrics = self.metrics
        step = self.engine.step()
        record = step.record
        if record is not None:
            metrics.observe_iteration(record)
            if self.iteration_log is not None:
                self._write_log(record)
        deliveries: Deliveries = {}
        generated = 0
        for out in step.outputs:  # each carries a new token
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            generated += len(out.new_token_ids)
            if not tracked.prompt_counted:
                tracked.prompt_counted = True
                metrics.prompt_tokens.inc(tracked.prompt_len)
            _add(deliveries, tracked, out)
        if generated:
            metrics.generation_tokens.inc(generated)
        for final in step.finished:
            tracked = self._tracked.pop(final.request_id, None)
            if tracked is None:
                continue
            _add(deliveries, tracked, final)
            metrics.observe_finished(final)
        for rid, reason in step.failed.items():  # already released by the engine
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                _add(deliveries, tracked, RequestFailedError(f"this request failed: {reason}"))
        self._deliver(deliveries)

    @staticmethod
    def _deliver(deliveries: Deliveries) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # loop closed
                pass

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        with self._lock:
            self._dead = cause or error
        for rid in self._tracked:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken
                pass
        self._fail_tracked(error)
        # Commands queued before _dead was set: answer them too.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (AddCall, CallEngine)):
                command.reply.send(error=error)
        try:
            self.metrics.observe_stats(self.engine.stats())
        except Exception:  # noqa: BLE001
            pass
