"""Orca (OSDI 2022): iteration-level batching of whole prefills with decodes, KV reserved."""
from __future__ import annotations

from ..request import Request, RequestStatus
from .base import Scheduler
from .batch import Batch
from .prefix_cache import PrefixHit


class OrcaScheduler(Scheduler):
    """Every running decode plus whole prefills of new requests, in one hybrid iteration.

    No chunking: a new request's whole prompt runs in the iteration that
    admits it, next to the decodes, which therefore stall for its length.
    Orca allocates KV memory for the maximum sequence length when it admits
    a request; we model that as an admission check: a request is admitted
    only if every running request plus it could each hold `max_model_len`
    tokens (not prompt + max_tokens: Orca does not trust an output length it
    cannot know), keeping the watermark free. Its batch is small, and it can
    never preempt: each request's blocks stay within its reservation.

    If the cache cannot hold one `max_model_len` sequence, the reservation
    is capped at the cache (less the watermark): requests then run one at a
    time, which `_check_fits` guarantees is enough for any accepted request.
    A prompt longer than the token budget runs as the only prefill of its
    iteration, beside the decodes (the budget stretches for it).
    """

    chunked_prefill = False

    @property
    def reservation_blocks(self) -> int:
        """KV blocks reserved per running request."""
        bm = self.block_manager
        return min(bm.num_blocks_for(self.config.max_model_len),
                   bm.num_total_blocks - bm.num_watermark_blocks)

    def _can_admit(self, request: Request, num_tokens: int, hit: PrefixHit) -> bool:
        # Every running request holds at most its reservation, so this bound
        # keeps all of them able to grow to max_model_len with no preemption.
        bm = self.block_manager
        reserved = (len(self.running) + 1) * self.reservation_blocks
        return (reserved <= bm.num_total_blocks - bm.num_watermark_blocks
                and super()._can_admit(request, num_tokens, hit))

    def _schedule(self, batch: Batch) -> None:
        # (1) Every running decode, one token each.
        for request in self._schedulable():
            if request.status is RequestStatus.RUNNING:
                assert not request.is_prefill, "a running request with a partial prefill"
                self._schedule_running(batch, request, 1)
        assert not batch.preempted, "the KV reservation must make preemption impossible"
        # (2) Whole prefills of new requests in FCFS order, in what budget is left.
        while self.waiting and self._try_admit_whole(batch):
            pass
