"""Sarathi-Serve's stall-free batching with chunked prefills (OSDI 2024)."""
from __future__ import annotations

from ..request import RequestStatus
from .base import Scheduler
from .batch import Batch


class SarathiScheduler(Scheduler):
    """Each iteration: every running decode, then partial prefill chunks, then new requests.

    Decodes go first so that no prefill ever stalls them (the paper's
    generation stall); prefills only use the budget the decodes leave, cut
    into chunks, so every iteration costs about one budget's worth.
    """

    def _schedule(self, batch: Batch) -> None:
        # (1) Every running decode, one token each. Iterate over a snapshot:
        # making KV room may preempt requests from the tail of `running`.
        for request in self._schedulable():
            if request.status is RequestStatus.RUNNING and not request.is_prefill:
                # Admission keeps len(running) <= token_budget, so this holds.
                assert batch.budget_left >= 1, "token budget smaller than the running decodes"
                self._schedule_running(batch, request, 1)

        # (2) Chunks of partially prefilled running requests, oldest first.
        for request in self._schedulable():
            if batch.budget_left == 0:
                break
            if (request.status is RequestStatus.RUNNING and request.is_prefill
                    and request.request_id not in batch.chunks):
                start = request.num_computed_tokens
                num_tokens = self._affordable(batch, request, start, self._chunk_size(
                    batch, start, request.num_tokens_to_compute))
                if num_tokens == 0:
                    break
                self._schedule_running(batch, request, num_tokens)

        # (3) New (or preempted) requests.
        self._admit_chunked(batch)
