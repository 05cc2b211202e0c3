"""Builders and a fake-executor driver shared by the scheduler tests (no torch).

`drive` runs a random workload through any policy, checking after every
iteration what all policies promise, plus each policy's defining rule from
POLICY_CHECKS.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st

from stallfree.config import SchedulerConfig
from stallfree.request import Request, RequestStatus
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler import BlockManager, OrcaScheduler, Scheduler, make_scheduler
from stallfree.scheduler.output import ScheduledChunk, SchedulerOutput


def make_request(rid: str, prompt_len: int, max_tokens: int | None = 16, arrival: float = 0.0,
                 eos: frozenset[int] = frozenset(), **params) -> Request:
    return Request(rid, [100 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, **params), arrival, eos_token_ids=eos)


TOKEN = 7  # what the fake model samples unless a test says otherwise


def new_scheduler(policy: str, budget: int = 16, max_num_seqs: int = 8, max_model_len: int = 128,
                  num_blocks: int = 64, block_size: int = 4, watermark: float = 0.0,
                  prefix_caching: bool = False) -> Scheduler:
    """A scheduler on a fresh cache; prefix caching off unless asked for, as the prompts of
    `make_request` all share a prefix and the shape tests count every token computed."""
    config = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len)
    return make_scheduler(config, BlockManager(num_blocks, block_size, watermark,
                                               enable_caching=prefix_caching))


def step(sched: Scheduler, now: float = 0.0,
         token: int = TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    """One iteration with a fake executor that samples `token` for every finished chunk."""
    out = sched.schedule(now)
    sampled = {c.request_id: token for c in out.chunks if c.samples}
    finished = sched.update(out, sampled, now)
    sched.block_manager.check_invariants()
    return out, finished


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num_tokens) of each chunk, in scheduling order."""
    return [(c.request_id, c.start, c.num_tokens) for c in out.chunks]


def run_until_done(sched: Scheduler, limit: int = 1000) -> list[Request]:
    finished: list[Request] = []
    for i in range(limit):
        if not sched.has_unfinished_requests():
            return finished
        finished += step(sched, float(i))[1]
    raise AssertionError("scheduler did not finish")


# ---- random workloads ------------------------------------------------------------
def fake_token(request: Request) -> int:
    """Deterministic per (request, position), so lost or duplicated outputs show."""
    return (int(request.request_id) * 7 + request.num_output_tokens * 3) % 10


def expected_outcome(rid: int, prompt_len: int, max_len: int, params: SamplingParams,
                     eos: frozenset[int]) -> tuple[list[int], str]:
    """Replays the stop rules on the fake token stream of one request."""
    limit = min(params.max_tokens, max_len - prompt_len)
    out: list[int] = []
    while True:
        token = (rid * 7 + len(out) * 3) % 10
        out.append(token)
        if len(out) >= params.min_tokens and (token in eos or token in params.stop_token_ids):
            return out, "stop"
        if len(out) >= limit:
            return out, "length"


def fits(prompt_len: int, max_tokens: int, sched: Scheduler) -> bool:
    """Whether add_request must accept the request (Scheduler._check_fits, restated)."""
    config, bm = sched.config, sched.block_manager
    if prompt_len >= config.max_model_len:
        return False
    cached = prompt_len + min(max_tokens, config.max_model_len - prompt_len) - 1
    # Without chunking, a recompute after preemption is one whole first chunk.
    first = min(cached, config.token_budget) if sched.chunked_prefill else cached
    return (bm.num_blocks_for(cached) <= bm.num_total_blocks
            and bm.num_blocks_for(first) <= bm.num_total_blocks - bm.num_watermark_blocks)


workloads = st.fixed_dictionaries({
    "budget": st.integers(1, 48),
    "max_num_seqs": st.integers(1, 8),
    "block_size": st.integers(1, 8),
    "num_blocks": st.integers(1, 40),
    "watermark": st.sampled_from([0.0, 0.05, 0.2]),
    "max_model_len": st.integers(2, 96),
    # (arrival iteration, prompt length, max_tokens, min_tokens)
    "requests": st.lists(st.tuples(st.integers(0, 15), st.integers(1, 60), st.integers(1, 24),
                                   st.integers(0, 3)), min_size=1, max_size=12),
    "prefix_caching": st.booleans(),
})


# ---- per-iteration view and each policy's defining rule -------------------------------
@dataclass
class Step:
    """One iteration as a policy check sees it."""

    sched: Scheduler
    running_before: list[str]  # ids running when schedule() was called, in order
    decodes_before: set[str]  # those of them past their prefill
    waiting_before: list[str]
    head_before: Request | None  # the head of the waiting queue then
    free_before: int  # free KV blocks then
    out: SchedulerOutput
    admitted: list[str]  # ids moved from waiting to running by this schedule() call

    @property
    def ids(self) -> set[str]:
        return {c.request_id for c in self.out.chunks}

    def phase(self, chunk: ScheduledChunk) -> bool:
        """Whether a chunk belongs to the prefill phase: a prefill, or an admission (after a
        cached prefix, a prompt's only uncached token is shaped like a decode)."""
        return chunk.is_prefill or chunk.request_id in self.admitted

    @property
    def kinds(self) -> set[bool]:
        """{True} prefill-only, {False} decode-only, both if mixed, empty if idle."""
        return {self.phase(c) for c in self.out.chunks}

    def all_decoded(self, ids: set[str] | list[str]) -> bool:
        """Every one of `ids` got a decode this iteration, unless it was preempted."""
        return set(ids) <= self.ids | set(self.out.preempted)


def check_sarathi(step: Step, prev: Step | None) -> None:
    # Stall-free: no running decode misses an iteration unless preempted.
    assert step.all_decoded(step.decodes_before), "a running decode was left out"
    kinds = [step.phase(c) for c in step.out.chunks]
    assert kinds == sorted(kinds), "a decode was scheduled after a prefill chunk"


def check_vllm(step: Step, prev: Step | None) -> None:
    assert len(step.kinds) <= 1, "vllm mixed prefill and decode in one iteration"
    if step.kinds == {False}:  # decode-only: all running requests, none admitted
        assert not step.admitted and step.all_decoded(step.running_before)
        # Prefill-prioritizing: decodes run only when the head of the queue
        # could not be admitted (seat, or KV with the watermark kept free).
        head, sched = step.head_before, step.sched
        if head is not None:
            config, bm = sched.config, sched.block_manager
            seat = len(step.running_before) < min(config.max_num_seqs, config.token_budget)
            room = step.free_before - bm.num_blocks_for(head.num_tokens) >= bm.num_watermark_blocks
            assert not (seat and room), "decoded although the head of the queue fit"


def check_orca(step: Step, prev: Step | None) -> None:
    assert not step.out.preempted, "orca preempted despite its KV reservation"
    assert step.all_decoded(step.running_before), "orca left a running decode out"
    kinds = [step.phase(c) for c in step.out.chunks]
    assert kinds == sorted(kinds)
    sched = step.sched
    assert isinstance(sched, OrcaScheduler)
    bm = sched.block_manager
    assert len(sched.running) * sched.reservation_blocks \
        <= bm.num_total_blocks - bm.num_watermark_blocks, "more running than reservations"


def check_request_level(step: Step, prev: Step | None) -> None:
    assert len(step.kinds) <= 1, "request_level mixed prefill and decode"
    if step.running_before:
        assert not step.admitted, "admitted a request while a batch was decoding"
        assert step.all_decoded(step.running_before)


def check_chunked_only(step: Step, prev: Step | None) -> None:
    assert len(step.kinds) <= 1, "chunked_only mixed prefill and decode"
    if step.kinds == {False}:
        assert step.all_decoded(step.decodes_before)
    # Alternation: after a prefill-only iteration, waiting decodes come next.
    if prev is not None and prev.kinds == {True} and step.decodes_before:
        assert step.kinds == {False}, "two prefill-only iterations while decodes waited"


POLICY_CHECKS: dict[str, Callable[[Step, Step | None], None]] = {
    "sarathi": check_sarathi, "vllm": check_vllm, "orca": check_orca,
    "request_level": check_request_level, "chunked_only": check_chunked_only,
}


def iteration_limit(sched: Scheduler, w: dict) -> int:
    """A bound on iterations, from each policy's progress argument."""
    last_arrival = max(a for a, *_ in w["requests"])
    if not sched.chunked_prefill:
        # Every iteration samples a token for at least one request (the oldest
        # running one is never preempted) and outputs survive preemption.
        return last_arrival + 2 + sum(t for _, _, t, _ in w["requests"])
    # The oldest running request is never preempted and gets >= 1 token per
    # iteration (chunked_only: per two, prefill and decode turns alternate).
    per_token = 2 if sched.config.policy == "chunked_only" else 1
    return last_arrival + 2 + per_token * sum(p + t for _, p, t, _ in w["requests"])


class KVOracle:
    """What the fake executor wrote into each physical block: every chunk must attend to KV
    written, by a completed iteration, for exactly the tokens before it, and never write into
    a block another request shares."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        # block id -> the token ids from position 0 up to the last one written into it
        self.written: dict[int, tuple[int, ...]] = {}

    def check_scheduled(self, chunk: ScheduledChunk) -> None:
        bs, tokens = self.bm.block_size, chunk.request.all_token_ids
        for i in range(self.bm.num_blocks_for(chunk.start)):
            end = min((i + 1) * bs, chunk.start)
            held = self.written.get(chunk.block_table[i], ())
            assert held[:end] == tuple(tokens[:end]), (
                f"{chunk.request_id}: block {chunk.block_table[i]} does not hold the KV of its "
                f"tokens up to position {end}")
        for i in range(chunk.start // bs, self.bm.num_blocks_for(chunk.start + chunk.num_tokens)):
            assert self.bm.blocks[chunk.block_table[i]].ref_count == 1, (
                f"{chunk.request_id} writes into shared block {chunk.block_table[i]}")

    def completed(self, chunks: list[ScheduledChunk]) -> None:
        """The iteration of `chunks` completed: their KV is written (whatever became of
        their requests meanwhile: the executor ran them)."""
        bs = self.bm.block_size
        for c in chunks:
            tokens, end = c.request.all_token_ids, c.start + c.num_tokens
            for i in range(c.start // bs, self.bm.num_blocks_for(end)):
                self.written[c.block_table[i]] = tuple(tokens[:min((i + 1) * bs, end)])


def drive(w: dict, policy: str = "sarathi", eos: frozenset[int] = frozenset(),
          stop_ids: tuple[int, ...] = (), aborts: dict[int, int] | None = None,
          prefix_caching: bool | None = None) -> None:
    """Runs a workload to the end, checking the scheduler's promises every iteration.
    Every prompt starts with the same tokens, so with prefix caching (the workload's
    "prefix_caching" unless given) most admissions hit."""
    if prefix_caching is None:
        prefix_caching = w.get("prefix_caching", False)
    config = SchedulerConfig(policy=policy, token_budget=w["budget"],
                             max_num_seqs=w["max_num_seqs"], max_model_len=w["max_model_len"])
    bm = BlockManager(w["num_blocks"], w["block_size"], w["watermark"],
                      enable_caching=prefix_caching)
    sched = make_scheduler(config, bm)
    oracle = KVOracle(bm)
    check_policy = POLICY_CHECKS[policy]
    arrivals = sorted(enumerate(w["requests"]), key=lambda x: x[1][0])  # stable: FCFS ties
    accepted: list[Request] = []
    aborted: set[str] = set()
    admitted: list[str] = []
    finished: list[str] = []
    last_arrival = max(a for a, *_ in w["requests"])
    prev: Step | None = None
    limit = iteration_limit(sched, w)
    for it in range(limit):
        for rid, (arrival, prompt_len, max_tokens, min_tokens) in arrivals:
            if arrival != it:
                continue
            params = dict(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                          stop_token_ids=list(stop_ids))
            r = make_request(str(rid), prompt_len, arrival=float(it), eos=eos, **params)
            if fits(prompt_len, max_tokens, sched):
                sched.add_request(r)
                accepted.append(r)
            else:
                with pytest.raises(ValueError):
                    sched.add_request(r)
        if it > last_arrival and not sched.has_unfinished_requests():
            break
        running_before = [r.request_id for r in sched.running]
        decodes = {r.request_id for r in sched.running if not r.is_prefill}
        waiting_before = [r.request_id for r in sched.waiting]
        head, free_before = (sched.waiting[0] if sched.waiting else None), bm.num_free_blocks
        out = sched.schedule(float(it))
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice"
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
        prefills = [c for c in out.chunks if c.is_prefill or c.request_id in waiting_before]
        if out.num_batched_tokens > w["budget"]:
            # The one documented excess: a lone whole prefill longer than the budget.
            assert not sched.chunked_prefill and len(prefills) == 1
            assert prefills[0].num_tokens > w["budget"]
        assert len(sched.running) <= w["max_num_seqs"] and len(ids) <= w["max_num_seqs"]
        assert not set(ids) & set(out.preempted)
        if not sched.chunked_prefill:  # whole prefills only, each sampling a token
            assert all(c.samples for c in prefills), "a prefill was chunked"
        if sched.has_unfinished_requests() and not sched.running:
            assert sched.num_waiting == 0, "nothing runs although requests wait"
        new = [rid for rid in ids if rid in waiting_before]
        # FCFS: an iteration admits a prefix of the queue, in queue order.
        assert new == waiting_before[:len(new)], "admission skipped the head of the queue"
        for c in out.chunks:
            assert c.request.status is RequestStatus.RUNNING
            assert c.start == c.request.num_computed_tokens
            if c.request_id in new:  # admitted after its cached prefix, whole blocks of it
                assert c.start % bm.block_size == 0 and (prefix_caching or c.start == 0)
                assert c.start < c.request.num_tokens
            oracle.check_scheduled(c)
            assert len(c.block_table) >= bm.num_blocks_for(c.start + c.num_tokens)
            if c.request_id not in admitted:
                admitted.append(c.request_id)
        step = Step(sched, running_before, decodes, waiting_before, head, free_before, out, new)
        check_policy(step, prev)
        prev = step
        if aborts and it in aborts and accepted:
            victim = accepted[aborts[it] % len(accepted)]
            if sched.abort_request(victim.request_id) is not None:
                aborted.add(victim.request_id)
        sampled = {c.request_id: fake_token(c.request) for c in out.chunks if c.samples}
        oracle.completed(out.chunks)
        finished += [r.request_id for r in sched.update(out, sampled, it + 0.5)]
        bm.check_invariants()  # includes: no negative ref count, free + held = all
        for r in sched.waiting:
            assert bm.block_table(r.request_id) == [] and r.num_computed_tokens == 0
        held = {b for r in sched.running for b in bm.block_table(r.request_id)}
        assert bm.num_free_blocks + len(held) == bm.num_total_blocks
        if not prefix_caching:
            assert bm.num_cached_blocks == 0
    else:
        raise AssertionError(f"{policy}: not finished after {limit} iterations")

    # FCFS across iterations: first admissions in arrival order.
    assert admitted == [r.request_id for r in accepted if r.request_id in admitted]
    assert len(finished) == len(set(finished)), "a request finished twice"
    assert set(finished) | aborted == {r.request_id for r in accepted}
    assert not set(finished) & aborted
    for r in accepted:
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
            continue
        tokens, reason = expected_outcome(int(r.request_id), r.num_prompt_tokens,
                                          w["max_model_len"], r.sampling_params, eos)
        assert r.output_token_ids == tokens and r.finish_reason == reason
        assert len(r.token_times) == len(tokens)
    assert bm.num_free_blocks == bm.num_total_blocks and not sched.running
    bm.reset_prefix_cache()
    assert bm.num_evictable_blocks == bm.num_cached_blocks == 0
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants()
