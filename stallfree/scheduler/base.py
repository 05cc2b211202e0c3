"""What every policy shares: queues, KV accounting, preemption and the update step.

A policy subclasses `Scheduler` and implements `_schedule(batch)`: it only
decides which requests catch up (num_computed_tokens -> num_tokens) by how many
tokens this iteration, using `_schedule_running`, `_try_admit` (a chunk) and
`_try_admit_whole` (a whole prefill, for policies without chunking). Everything
that must stay consistent whatever the policy (block tables, preemption by
recompute, stop conditions, timestamps) lives here.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .batch import Batch
from .kv_cache import BlockManager
from .output import ScheduledChunk, SchedulerOutput
from .prefix_cache import PrefixHit
from .siblings import HeldSiblings


def prompt_length_error(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt this long is refused (None: it is not): the one rule, for the engine,
    the simulator and the server's check before a long prompt's ids are validated."""
    if num_prompt_tokens < max_model_len:
        return None
    return (f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len}: "
            f"it must be shorter to leave room for output")


class Scheduler:
    """Shared machinery; `schedule` delegates the choice of chunks to `_schedule`."""

    # False for policies that only run whole prefills: a (re)computed sequence
    # must then fit the KV cache in one go, and may exceed the token budget.
    chunked_prefill: ClassVar[bool] = True
    # What one prompt position whose logprobs were asked for costs, in budget tokens: its
    # logits row (a matmul with the vocabulary) on top of the layers. Set per model by
    # make_scheduler; 1.0 charges it as a plain token.
    prompt_logprob_cost: float = 1.0

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len is unset: resolve it against the model first "
                             "(SchedulerConfig.resolved)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.unready: list[Request] = []  # not ready to run yet: join `waiting` once ready
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._busy: frozenset[str] = frozenset()  # in flight in a pipeline: not schedulable
        self._held = HeldSiblings()  # n > 1: siblings waiting for their leader's prompt KV

    # ---- requests -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_new(request)
        (self.waiting if request.ready else self.unready).append(request)
        self._requests[request.request_id] = request

    def add_group(self, requests: Sequence[Request]) -> None:
        """The n sequences of one prompt (all or none are added).

        With prefix caching, the first computes the prompt and the others are held
        back until its full blocks are cached; then they join the front of the queue
        and share those blocks, so the prompt is prefilled once.
        """
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids repeat within the group: {ids}")
        for request in requests:
            self._check_new(request)
        leader, *others = requests
        self.add_request(leader)
        bm = self.block_manager
        if others and bm.enable_caching and leader.num_prompt_tokens > bm.block_size:
            self._held.hold(leader, others)
            self._requests.update((r.request_id, r) for r in others)
        else:
            for request in others:
                self.add_request(request)

    def _release_held(self, leader: Request) -> None:
        # The front of the queue: they arrived with a request already admitted.
        released = self._held.release(leader, self.block_manager.block_size)
        self.unready.extend(r for r in released if not r.ready)
        self.waiting.extendleft(reversed([r for r in released if r.ready]))

    def _check_new(self, request: Request) -> None:
        """Raises ValueError unless the request can be added."""
        rid = request.request_id
        # The one check of a prompt's length, for the engine and the simulator alike.
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must not be empty")
        too_long = prompt_length_error(request.num_prompt_tokens, self.config.max_model_len)
        if too_long is not None:
            raise ValueError(too_long)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {rid!r} is not new (status {request.status.value}, "
                             f"{request.num_computed_tokens} tokens computed)")
        self._check_slo(request.sampling_params.tbt_slo)
        self._check_fits(request)

    def _check_slo(self, tbt_slo: float | None) -> None:
        if tbt_slo is not None:  # only the SLO policy can keep a request's own SLO
            raise ValueError("tbt_slo on a request needs an engine started with --tbt-slo")

    def _check_fits(self, request: Request) -> None:
        """Rejects a request the cache could never carry to its end.

        Accepting one would livelock: it would be preempted (or refused admission)
        forever. A request alone with every block free must reach its longest length,
        and its first chunk must be admissible with the watermark kept free. Without
        chunking, the first "chunk" can be a whole recompute: prompt plus outputs.
        """
        bm, rid = self.block_manager, request.request_id
        max_output = self.config.max_model_len - request.num_prompt_tokens
        if request.sampling_params.max_tokens is not None:
            max_output = min(max_output, request.sampling_params.max_tokens)
        # The last sampled token is never fed back, so it needs no KV slot.
        max_cached = request.num_prompt_tokens + max_output - 1
        largest_chunk = min(max_cached, self.config.token_budget) if self.chunked_prefill \
            else max_cached
        need = bm.most_blocks_held(max_cached, largest_chunk)
        if need > bm.num_total_blocks:
            raise ValueError(f"request {rid!r} may grow to {max_cached} cached tokens "
                             f"({need} KV blocks) but the KV cache has only "
                             f"{bm.num_total_blocks} blocks of {bm.block_size} tokens; lower "
                             f"max_tokens or max_model_len, or enlarge the KV cache")
        first = bm.num_blocks_for(largest_chunk)
        if first > bm.num_total_blocks - bm.num_watermark_blocks:
            raise ValueError(f"request {rid!r}: a first chunk needs {first} KV blocks, more than "
                             f"the {bm.num_total_blocks - bm.num_watermark_blocks} the cache "
                             f"may fill on admission (watermark keeps "
                             f"{bm.num_watermark_blocks} free)")

    def abort_request(self, request_id: str) -> Request | None:
        """Stops a request wherever it is; None if it is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is not None:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Ends a request (e.g. on a stop string); a no-op if it already finished."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.unready:
            self.unready.remove(request)
        elif not self._held.discard(request):  # else a sibling held for its leader
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        self._release_held(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.unready)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._held)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one iteration --------------------------------------------------------
    def schedule(self, now: float, busy: frozenset[str] = frozenset()) -> SchedulerOutput:
        """The next iteration. `busy`: ids of requests still in flight in earlier
        micro-batches (pipeline parallelism); they are neither scheduled nor preempted
        until `update` has applied their batch, as in Sarathi-Serve."""
        # Admission only happens while budget is left after serving every
        # running request, so each running request can always get a token.
        assert len(self.running) <= self.config.token_budget, "more running requests than budget"
        self._queue_ready()
        batch = Batch(self.config.token_budget)
        self._busy = busy
        try:
            self._schedule(batch)
        finally:
            self._busy = frozenset()
        for chunk in batch.chunks.values():
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        if batch.stretched:
            # The one documented excess: a lone whole prefill longer than the budget.
            assert not self.chunked_prefill
            assert sum(c.is_prefill for c in batch.chunks.values()) == 1
        else:
            assert batch.num_tokens <= self.config.token_budget
        assert len(self.running) <= self.config.max_num_seqs
        return SchedulerOutput(list(batch.chunks.values()), batch.preempted)

    def _queue_ready(self) -> None:
        """Requests that became ready join the waiting queue, behind those already there:
        a request is skipped, never waited for, while it is not ready."""
        if any(r.ready for r in self.unready):
            self.waiting.extend(r for r in self.unready if r.ready)
            self.unready = [r for r in self.unready if not r.ready]

    def _schedule(self, batch: Batch) -> None:
        """The policy: fill `batch` with chunks of running and waiting requests."""
        raise NotImplementedError

    def _schedulable(self) -> list[Request]:
        """A snapshot of the running requests not in flight, in admission order. A
        snapshot, as making KV room may preempt from the tail of `running`."""
        return [r for r in self.running if r.request_id not in self._busy]

    def _schedule_running(self, batch: Batch, request: Request, num_tokens: int) -> bool:
        """Schedules `num_tokens` of a running request, preempting from the tail for KV room.

        Returns False if the request itself had to be preempted. Requests in
        flight are never victims: their blocks are being written.
        """
        bm = self.block_manager
        while not bm.can_allocate(request, num_tokens, use_watermark=False):
            victim = next(r for r in reversed(self.running) if r.request_id not in self._busy)
            self._preempt(batch, victim)
            if victim is request:
                return False
        bm.allocate(request, num_tokens)
        start = request.num_computed_tokens
        batch.add(ScheduledChunk(request, start, num_tokens, bm.block_table(request.request_id)),
                  self._charge(request, start, num_tokens))
        return True

    def _charge(self, request: Request, start: int, num_tokens: int) -> int:
        """The budget a chunk costs: its tokens, plus the logits rows of prompt logprobs at
        their extra cost."""
        rows = request.num_prompt_logprob_rows(start, num_tokens)
        return num_tokens + int(rows * (self.prompt_logprob_cost - 1.0))

    def _affordable(self, batch: Batch, request: Request, start: int, num_tokens: int) -> int:
        """`num_tokens` cut down until the chunk's charge fits the budget left. Charging a
        scoring request's logits keeps an iteration's cost, and so every other request's
        time between tokens, what it would be without them. One token always passes
        while budget is left: with a small budget or a small model (whose LM head may
        cost dozens of tokens' layers), an iteration overruns by one logits row rather
        than the request never running."""
        wanted = num_tokens
        while num_tokens > 0 and self._charge(request, start, num_tokens) > batch.budget_left:
            over = self._charge(request, start, num_tokens) - batch.budget_left
            num_tokens -= max(1, int(over / self.prompt_logprob_cost))
        return max(num_tokens, 1 if wanted > 0 and batch.budget_left > 0 else 0)

    def _try_admit(self, batch: Batch, num_tokens: int, hit: PrefixHit) -> bool:
        """Moves the head of the waiting queue to running with a first chunk of `num_tokens`
        after its cached prefix `hit`, if it fits. Cached tokens cost no budget."""
        request = self.waiting[0]
        if num_tokens > batch.budget_left or not self._can_admit(request, num_tokens, hit):
            return False
        self.waiting.popleft()
        self.block_manager.allocate(request, num_tokens, hit)
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        batch.num_admitted += 1
        batch.add(ScheduledChunk(request, request.num_computed_tokens, num_tokens,
                                 self.block_manager.block_table(request.request_id)),
                  self._charge(request, hit.num_tokens, num_tokens))
        return True

    def _admit_chunked(self, batch: Batch) -> None:
        """New (or preempted) requests in strict FCFS order, each with as much of its
        prefill as the budget left allows. Skipped after a preemption: memory is
        short, and re-admitting the victim at once would only recompute what was
        just thrown away."""
        if batch.preempted:
            return
        while self.waiting and batch.budget_left > 0:
            head = self.waiting[0]
            hit = self.block_manager.find_cached_prefix(head)
            num_tokens = self._affordable(batch, head, hit.num_tokens, self._chunk_size(
                batch, hit.num_tokens, head.num_tokens - hit.num_tokens))
            if num_tokens == 0 or not self._try_admit(batch, num_tokens, hit):
                return  # no skipping: a large request at the head must not starve

    def _chunk_size(self, batch: Batch, start: int, wanted: int) -> int:
        """How many of `wanted` tokens a prefill chunk starting at position `start` gets in
        `batch`: as many as the budget left allows, unless a policy limits it further
        (the TBT SLO's budget); 0 if none."""
        return min(wanted, batch.budget_left)

    def _try_admit_whole(self, batch: Batch) -> bool:
        """Admits the head of the waiting queue with its whole prefill (no chunking), if it fits.

        A prefill longer than the token budget itself could never fit; it runs
        as the only prefill of an iteration (the budget stretches for it) so
        that it cannot starve.
        """
        request = self.waiting[0]
        hit = self.block_manager.find_cached_prefix(request)
        num_tokens = request.num_tokens - hit.num_tokens
        # Counted by admissions, not by is_prefill: a recompute whose cached prefix leaves
        # one token looks like a decode, yet it is an admission of this iteration too.
        charge = self._charge(request, hit.num_tokens, num_tokens)
        if (charge > self.config.token_budget and not batch.num_admitted
                and self._can_admit(request, num_tokens, hit)):
            batch.stretch(charge)
        return charge <= batch.budget_left and self._try_admit(batch, num_tokens, hit)

    def _can_admit(self, request: Request, num_tokens: int, hit: PrefixHit) -> bool:
        """Limits on admission other than the token budget; policies may add their own."""
        # Capping running requests at the budget too keeps a decode of every
        # one of them within one iteration, whatever the policy.
        if len(self.running) >= min(self.config.max_num_seqs, self.config.token_budget):
            return False
        # The watermark leaves running requests room to grow before preempting. With none
        # running it protects nobody, and a cached prefix shared from evictable blocks could
        # need more than the cache less the watermark: waiving it then keeps admission live.
        return self.block_manager.can_allocate(request, num_tokens,
                                               use_watermark=bool(self.running), hit=hit)

    def _preempt(self, batch: Batch, request: Request) -> None:
        """Preemption by recompute: drop the KV cache, requeue at the front, keep outputs.
        Its cached blocks stay cached, so with prefix caching the recompute mostly hits."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        # Front of the queue: it was admitted before anything still waiting.
        self.waiting.appendleft(request)
        batch.remove(request.request_id)
        batch.preempted.append(request.request_id)

    def preempt_all(self) -> list[str]:
        """Requeues every running request for recompute, in admission order, at the front
        of the queue (their KV cache is lost: the workers holding it were restarted);
        returns their ids."""
        batch = Batch(self.config.token_budget)
        for request in reversed(list(self.running)):  # the tail first: the head ends up first
            self._preempt(batch, request)
        return batch.preempted

    # ---- after the executor ---------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, int],
               now: float) -> list[Request]:
        """Applies one executed iteration; returns the requests that finished in it."""
        finished: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            # The server may abort (or a stop string finish) between schedule and update.
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(f"request {request.request_id!r} has "
                                   f"{request.num_computed_tokens} computed tokens, the chunk "
                                   f"starts at {chunk.start}: was this output applied twice?")
            request.num_computed_tokens += chunk.num_tokens
            # Its KV is written now (the iteration completed): full blocks can be shared.
            self.block_manager.cache_computed_blocks(request)
            self.block_manager.release_out_of_window(request)
            self._release_held(request)
            if not chunk.samples:
                continue
            if request.sampling_params.max_tokens == 0:  # the prompt was all it asked for
                self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
                continue
            if request.request_id not in sampled:
                raise KeyError(f"no sampled token for request {request.request_id!r}, "
                               f"whose chunk completes its sequence")
            request.output_token_ids.append(sampled[request.request_id])
            request.token_times.append(now)
            status = self._stop_status(request)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """Stop conditions checked after each sampled token (stop strings are the engine's)."""
        params = request.sampling_params
        token = request.output_token_ids[-1]
        # As in vLLM, stop tokens count once min_tokens tokens exist (the stop
        # token included); a natural stop wins over hitting a length limit.
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
