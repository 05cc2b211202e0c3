"""What a failure in the engine thread means for a request (server/async_engine.py).

Failure rules: a request the engine refuses (ValueError) fails alone; a full
waiting queue refuses at once (`QueueFullError`); a request that fails on its own
in a step (its sampling, its detokenizing) gets `RequestFailedError` and the batch
goes on. Workers that fail (`WorkerError`) are restarted and every running request
recomputed, so clients see a delay, not an error (up to `MAX_WORKER_RESTARTS` in a
row). A step that fails for no one request's fault fails the requests it held
(`RequestFailedError`) and the engine goes on with the next ones; a failing
iteration log is closed and serving goes on. Only when steps keep failing
(`MAX_CONSECUTIVE_FAILURES` in a row) or recovery itself fails is the engine dead:
every in-flight request and every later submission gets `EngineDeadError`, /health
answers 503, and `on_fatal` runs (the server then exits non-zero, for its
supervisor to restart it), so nobody waits forever on a process that cannot serve.
An engine stuck without failing (a step that never returns, wedged workers) cannot be
interrupted from outside its thread: once its loop has not turned for `stall_timeout`
seconds, /health answers 503 `engine_stalled` (200 again if it moves), for the
supervisor to restart the server.
"""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has failed (or shut down); nothing more will be generated."""


class QueueFullError(RuntimeError):
    """The waiting queue holds --max-waiting-requests sequences already."""


class RequestFailedError(RuntimeError):
    """This request failed in the engine (the engine itself goes on)."""
