"""The paper's ablation "chunked prefills only": chunks, but no hybrid batches."""
from __future__ import annotations

from ..config import SchedulerConfig
from ..request import RequestStatus
from .base import Scheduler
from .batch import Batch
from .kv_cache import BlockManager


class ChunkedOnlyScheduler(Scheduler):
    """Prefill-only iterations of budget-sized chunks, alternating with decode-only ones.

    Sarathi-Serve's chunked prefills without stall-free (hybrid) batching:
    a prefill iteration fills the token budget with chunks of partial
    prefills (oldest first), then of new requests in FCFS order; the next
    iteration decodes every running request. The two kinds alternate while
    both have work, so decodes stall for one chunk at a time instead of a
    whole prompt, but every chunk costs decodes a full iteration (the paper
    finds TTFT rises). Prefill and decode never share an iteration.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self._prefill_turn = True

    def _schedule(self, batch: Batch) -> None:
        has_decodes = any(not r.is_prefill for r in self._schedulable())
        if self._prefill_turn or not has_decodes:
            self._schedule_prefills(batch)
            if batch.chunks:
                self._prefill_turn = False
                return
        # No prefill work (or its turn is over): decode every running decode.
        for request in self._schedulable():
            if request.status is RequestStatus.RUNNING and not request.is_prefill:
                self._schedule_running(batch, request, 1)
        self._prefill_turn = True

    def _schedule_prefills(self, batch: Batch) -> None:
        # Partial prefills first, oldest first: they hold KV already.
        for request in self._schedulable():
            if batch.budget_left == 0:
                return
            if request.status is RequestStatus.RUNNING and request.is_prefill:
                num_tokens = self._affordable(batch, request, request.num_computed_tokens, min(
                    request.num_tokens_to_compute, batch.budget_left))
                if num_tokens:
                    self._schedule_running(batch, request, num_tokens)
        self._admit_chunked(batch)
