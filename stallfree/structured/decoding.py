"""Each constrained request's grammar matcher, and the bitmask of allowed tokens per batch."""
from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import xgrammar as xgr

from ..request import Request
from ..scheduler.output import SchedulerOutput

logger = logging.getLogger("stallfree.structured")


@dataclass
class _Constrained:
    request: Request
    compiled: Future  # of an xgr.CompiledGrammar
    matcher: xgr.GrammarMatcher | None = None  # once compiled
    num_accepted: int = 0  # output tokens the matcher has taken
    rejected: bool = False


class GrammarMatchers:
    """The matcher of every constrained request (child sequences each have their own).

    The request's own output tokens are the truth: before a mask is filled or a
    stop is decided, the matcher takes whatever outputs it has not seen yet. A
    request preempted by recompute keeps its outputs, so its matcher stays valid
    and simply continues after the recompute. Engine thread only.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._states: dict[str, _Constrained] = {}
        self._compiling: dict[str, _Constrained] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add(self, request: Request, compiled: Future) -> None:
        """Tracks `request`: unready (the scheduler skips it) until `poll` finds its
        grammar compiled (at once if it was cached)."""
        state = _Constrained(request, compiled)
        self._states[request.request_id] = state
        self._compiling[request.request_id] = state
        request.ready = False

    def remove(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        self._compiling.pop(request_id, None)
        if state is not None:
            state.compiled.cancel()  # gives its compile up (stopped if no one else waits)

    def poll(self) -> list[str]:
        """Makes the requests whose grammar has compiled ready; returns the ids of those
        whose compile failed (the caller ends them)."""
        failed = []
        for rid, state in list(self._compiling.items()):
            if not state.compiled.done():
                continue
            del self._compiling[rid]
            try:
                compiled = state.compiled.result()
            except Exception as exc:  # noqa: BLE001 - reported, the request ends alone
                log = logger.warning if isinstance(exc, ValueError) else logger.error
                log("grammar of request %s failed to compile: %s", rid, exc)
                failed.append(rid)
                continue
            stops = set(state.request.eos_token_ids)
            stops.update(state.request.sampling_params.stop_token_ids)
            state.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops))
            state.request.ready = True
        return failed

    def wait(self, timeout: float) -> None:
        """Blocks until a compile finishes or `timeout` passes; at once if none is running.
        For an engine with nothing else to do, instead of spinning."""
        if self._compiling:
            concurrent.futures.wait([s.compiled for s in self._compiling.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def fill_bitmask(self, output: SchedulerOutput) -> None:
        """Sets `output`'s bitmask: a row of allowed next tokens for every constrained
        request that samples in this batch (none for the others)."""
        rows = [self._states[c.request_id] for c in output.chunks
                if c.samples and c.request_id in self._states]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, state in enumerate(rows):
            self._catch_up(state)
            state.matcher.fill_next_token_bitmask(bitmask, i)
        output.token_bitmask = bitmask
        output.bitmask_rows = {s.request.request_id: i for i, s in enumerate(rows)}

    def advance(self, request_id: str) -> bool:
        """Feeds the request's new output tokens to its matcher. True when the request must
        stop: its grammar has ended (a stop token after a complete match), or, which the
        mask prevents, a token broke it."""
        state = self._states.get(request_id)
        if state is None or state.matcher is None:
            return False
        self._catch_up(state)
        return state.rejected or state.matcher.is_terminated()

    def _catch_up(self, state: _Constrained) -> None:
        outputs = state.request.output_token_ids
        while state.num_accepted < len(outputs) and not state.rejected:
            token = outputs[state.num_accepted]
            if not state.matcher.accept_token(token):
                logger.warning("request %s: token %d does not fit its grammar; stopping it",
                               state.request.request_id, token)
                state.rejected = True
            state.num_accepted += 1
