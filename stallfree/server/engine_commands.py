"""What the event loop asks of the engine thread, one small typed command each, and how
the engine thread answers the awaiting coroutine."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(frozen=True)
class Reply:
    """A future of the event loop, completed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future

    @classmethod
    def new(cls) -> Reply:
        """A reply for the running loop (call from a coroutine)."""
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    @property
    def cancelled(self) -> bool:
        return self.fut.cancelled()

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        """Completes the future (unless its waiter gave up), from any thread."""
        def complete() -> None:
            if self.fut.done():
                return
            if error is not None:
                self.fut.set_exception(error)
            else:
                self.fut.set_result(result)
        try:
            self.loop.call_soon_threadsafe(complete)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


@dataclass(frozen=True)
class AddCall:
    """One API call's requests (request id, prompt), for the engine thread to add all
    together or none: the queue limit weighs the call once, so no call is ever half
    admitted. Their outputs go to `out`."""

    requests: list[tuple[str, Prompt]]
    params: SamplingParams
    out: asyncio.Queue
    arrival: float
    reply: Reply


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class CallEngine:
    """Runs `fn(engine)` between iterations; its result (or error) is the reply."""

    fn: Callable[[Any], Any]
    reply: Reply


@dataclass(frozen=True)
class Stop:
    pass


Command = AddCall | Abort | CallEngine | Stop
