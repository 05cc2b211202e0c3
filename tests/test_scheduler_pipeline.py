"""Scheduling with micro-batches in flight (pipeline parallelism), on a fake executor."""
from __future__ import annotations

from collections import deque

import pytest

from scheduler_helpers import TOKEN, make_request, new_scheduler
from stallfree.config import POLICIES


def _drive_pipelined(sched, depth: int, limit: int = 2000):
    """Keeps up to `depth` batches in flight, applying the oldest one at a time."""
    in_flight: deque = deque()
    overlaps = 0
    for now in range(limit):
        busy = frozenset(c.request_id for out in in_flight for c in out.chunks)
        while len(in_flight) < depth:
            out = sched.schedule(float(now), busy)
            if out.is_empty:
                break
            ids = {c.request_id for c in out.chunks}
            assert not ids & busy, "a request in flight was scheduled again"
            assert not set(out.preempted) & busy, "a request in flight was preempted"
            in_flight.append(out)
            busy |= ids
        overlaps += len(in_flight) > 1
        if not in_flight:
            if not sched.has_unfinished_requests():
                return overlaps
            continue
        out = in_flight.popleft()
        sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.samples}, float(now))
        sched.block_manager.check_invariants()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("policy", POLICIES)
def test_two_micro_batches_in_flight_never_share_a_request(policy):
    sched = new_scheduler(policy, budget=16, max_num_seqs=8, num_blocks=40)
    requests = [make_request(f"r{i}", 3 + 5 * (i % 4), max_tokens=6) for i in range(10)]
    for r in requests:
        sched.add_request(r)
    overlaps = _drive_pipelined(sched, depth=2)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    if policy == "sarathi":
        assert overlaps > 0, "sarathi should fill the pipeline with a second micro-batch"


def test_a_busy_request_is_never_the_preemption_victim():
    # Tiny cache: the decode of r0 needs a block that only preempting r1 could give,
    # but r1 is in flight, so r0 gives way itself.
    sched = new_scheduler("sarathi", budget=8, num_blocks=4, block_size=4)
    r0, r1 = make_request("r0", 8, max_tokens=8), make_request("r1", 8, max_tokens=8)
    sched.add_request(r0)
    sched.add_request(r1)
    first = sched.schedule(0.0)
    sched.update(first, {"r0": TOKEN}, 0.0)
    second = sched.schedule(1.0, frozenset({"r0"}))
    assert [c.request_id for c in second.chunks] == ["r1"]
    third = sched.schedule(2.0, frozenset({"r1"}))
    assert third.preempted == ["r0"] and not third.chunks
    assert r1.status.value == "running"
