"""One API call's engine requests: submitted together, their outputs in one queue."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ..outputs import RequestOutput, StepOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .engine_commands import Prompt


class Generation:
    """One API call's engine requests (one per prompt, each with n sequences).

    `start()` submits them all or none (the engine thread adds them together);
    `events()` yields (prompt_index, StepOutput | RequestOutput) in the order the
    engine produced them. Leaving `events()` early (client gone,
    task cancelled) aborts whatever is unfinished.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[Prompt],
                 params: SamplingParams, arrival_time: float | None = None) -> None:
        self.engine = engine
        self.prompts = prompts
        self.params = params
        self.request_ids = ([request_id] if len(prompts) == 1 else
                            [f"{request_id}-{i}" for i in range(len(prompts))])
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finals: dict[int, RequestOutput] = {}
        self._submitted: list[str] = []

    async def start(self) -> None:
        # All at once, so that a cancellation mid-add aborts whatever the engine took.
        self._submitted = list(self.request_ids)
        try:
            await self.engine.add_requests(list(zip(self.request_ids, self.prompts)),
                                           self.params, self.queue, self.arrival_time)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for rid in self._submitted:
            if self._index[rid] not in self.finals:
                self.engine.abort(rid)

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.request_ids)

    async def events(self) -> AsyncIterator[tuple[int, StepOutput | RequestOutput]]:
        try:
            while not self.done:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                index = self._index[item.request_id]
                if isinstance(item, RequestOutput):
                    self.finals[index] = item
                yield index, item
        finally:
            if not self.done:
                self.abort()

    async def results(self) -> list[RequestOutput]:
        async for _ in self.events():
            pass
        return [self.finals[i] for i in range(len(self.request_ids))]
