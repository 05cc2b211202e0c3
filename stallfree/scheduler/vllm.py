"""The 2023 vLLM rule: prefill-prioritizing, prefill-only or decode-only iterations."""
from __future__ import annotations

from ..request import RequestStatus
from .base import Scheduler
from .batch import Batch


class VLLMScheduler(Scheduler):
    """If the head of the queue fits, an iteration of whole prefills only; else all decodes.

    This is vLLM v0's scheduler (2023): as soon as waiting requests fit in
    memory (watermark kept free), max_num_seqs and the token budget
    (`token_budget` plays vLLM's max_num_batched_tokens, default 4096 there;
    we keep our one field and its default), their whole prompts run in a
    prefill-only iteration while every running decode waits: the generation
    stall Sarathi-Serve removes. When no waiting request fits, a decode-only
    iteration of every running request, preempting the newest (recompute)
    for KV room. Prefill and decode never share an iteration.

    vLLM requires max_num_batched_tokens >= max_model_len so every prompt fits
    the budget. We do not: a prompt (or a recompute) longer than the budget is
    admitted alone in its iteration, which then exceeds the budget by design,
    rather than starving.
    """

    chunked_prefill = False

    def _schedule(self, batch: Batch) -> None:
        # (1) Prefill-prioritizing: admit whole prefills in FCFS order; the
        # first one that does not fit stops admission (no skipping ahead).
        while self.waiting and self._try_admit_whole(batch):
            pass
        if batch.chunks:
            return  # a prefill-only iteration: running decodes stall

        # (2) Nothing admissible: one decode for every running request. Over
        # a snapshot, as making KV room may preempt from the tail of `running`.
        for request in self._schedulable():
            if request.status is RequestStatus.RUNNING:
                # Whole prefills complete in one iteration, so all running requests decode.
                assert not request.is_prefill, "a running request with a partial prefill"
                self._schedule_running(batch, request, 1)
