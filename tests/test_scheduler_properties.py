"""SarathiScheduler under random workloads (hypothesis): its invariants hold for any input."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.config import SchedulerConfig
from stallfree.request import Request, RequestStatus
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler import (BlockManager, make_scheduler)

from scheduler_helpers import make_request


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


def fits(prompt_len: int, max_tokens: int, config: SchedulerConfig, bm: BlockManager) -> bool:
    if prompt_len >= config.max_model_len:
        return False
    cached = prompt_len + min(max_tokens, config.max_model_len - prompt_len) - 1
    return (bm.num_blocks_for(cached) <= bm.num_total_blocks
            and bm.num_blocks_for(min(cached, config.token_budget))
            <= bm.num_total_blocks - bm.num_watermark_blocks)


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
})


def drive(w: dict, eos: frozenset[int] = frozenset(), stop_ids: tuple[int, ...] = (),
          aborts: dict[int, int] | None = None) -> None:
    """Runs a workload to the end, checking the scheduler's promises every iteration."""
    config = SchedulerConfig(token_budget=w["budget"], max_num_seqs=w["max_num_seqs"],
                             max_model_len=w["max_model_len"])
    bm = BlockManager(w["num_blocks"], w["block_size"], w["watermark"])
    sched = make_scheduler(config, bm)
    arrivals = sorted(enumerate(w["requests"]), key=lambda x: x[1][0])  # stable: FCFS ties
    accepted: list[Request] = []
    aborted: set[str] = set()
    admitted: list[str] = []
    finished: list[str] = []
    last_arrival = max(a for a, *_ in w["requests"])
    # Liveness: the oldest running request is never preempted and gets >= 1
    # token per iteration, so the work bounds the number of iterations.
    limit = last_arrival + 2 + sum(p + t for _, p, t, _ in w["requests"])
    for it in range(limit):
        for rid, (arrival, prompt_len, max_tokens, min_tokens) in arrivals:
            if arrival != it:
                continue
            params = dict(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                          stop_token_ids=list(stop_ids))
            r = make_request(str(rid), prompt_len, arrival=float(it), eos=eos, **params)
            if fits(prompt_len, max_tokens, config, bm):
                sched.add_request(r)
                accepted.append(r)
            else:
                with pytest.raises(ValueError):
                    sched.add_request(r)
        if it > last_arrival and not sched.has_unfinished_requests():
            break
        decodes = {r.request_id for r in sched.running if not r.is_prefill}
        out = sched.schedule(float(it))
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice"
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= w["budget"]
        assert len(sched.running) <= w["max_num_seqs"] and len(ids) <= w["max_num_seqs"]
        assert decodes <= set(ids) | set(out.preempted), "a running decode was left out"
        assert not set(ids) & set(out.preempted)
        kinds = [c.is_prefill for c in out.chunks]
        assert kinds == sorted(kinds), "a decode was scheduled after a prefill chunk"
        if sched.has_unfinished_requests() and not sched.running:
            assert sched.num_waiting == 0, "nothing runs although requests wait"
        for c in out.chunks:
            assert c.request.status is RequestStatus.RUNNING
            assert c.start == c.request.num_computed_tokens
            assert len(c.block_table) >= bm.num_blocks_for(c.start + c.num_tokens)
            if c.request_id not in admitted:
                admitted.append(c.request_id)
        if aborts and it in aborts and accepted:
            victim = accepted[aborts[it] % len(accepted)]
            if sched.abort_request(victim.request_id) is not None:
                aborted.add(victim.request_id)
        sampled = {c.request_id: fake_token(c.request) for c in out.chunks if c.samples}
        finished += [r.request_id for r in sched.update(out, sampled, it + 0.5)]
        bm.check_invariants()
        for r in sched.waiting:
            assert bm.block_table(r.request_id) == [] and r.num_computed_tokens == 0
        held = sum(len(bm.block_table(r.request_id)) for r in sched.running)
        assert bm.num_free_blocks + held == bm.num_total_blocks
    else:
        raise AssertionError(f"not finished after {limit} iterations")

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


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_random_workloads_finish_exactly_once(w):
    drive(w)


@settings(max_examples=60, deadline=None)
@given(workloads, st.frozensets(st.integers(0, 9), max_size=2),
       st.lists(st.integers(0, 9), max_size=2),
       st.dictionaries(st.integers(0, 40), st.integers(0, 100), max_size=4))
def test_random_workloads_with_stops_and_aborts(w, eos, stop_ids, aborts):
    drive(w, eos, tuple(stop_ids), aborts)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12))
def test_tight_cache_preempts_and_still_finishes(num_blocks_extra, n):
    """Many equal requests in a cache that holds barely more than one of them."""
    w = dict(budget=32, max_num_seqs=8, block_size=2, num_blocks=6 + num_blocks_extra,
             watermark=0.0, max_model_len=64,
             requests=[(0, 4, 8, 0) for _ in range(n)])
    drive(w)
