"""Request-level batching (FasterTransformer, Triton): a batch runs to its end."""
from __future__ import annotations

from ..request import RequestStatus
from .base import Scheduler
from .batch import Batch


class RequestLevelScheduler(Scheduler):
    """Admit a batch with whole prefills, decode it until every member finishes, then admit.

    Only when nothing is running does one prefill-only iteration admit a new
    batch: whole prompts in FCFS order, up to max_num_seqs, the token budget
    and the KV cache (watermark kept free). Then decode-only iterations until
    the last member finishes; the batch shrinks as members finish, and new
    arrivals wait meanwhile. A member preempted for KV room (recompute) waits
    at the front of the queue for the next batch. A prompt longer than the
    budget is admitted alone (the budget stretches for it) rather than starving.
    """

    chunked_prefill = False

    def _schedule(self, batch: Batch) -> None:
        if not self.running:
            # A new batch: whole prefills only.
            while self.waiting and self._try_admit_whole(batch):
                pass
            return
        # The batch decodes; a snapshot, as making KV room may preempt its tail.
        for request in self._schedulable():
            if request.status is RequestStatus.RUNNING:
                assert not request.is_prefill, "a running request with a partial prefill"
                self._schedule_running(batch, request, 1)
