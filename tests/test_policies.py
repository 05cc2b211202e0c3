"""Each scheduling policy's defining behaviour, on small hand-built cases (no torch)."""
from __future__ import annotations

import pytest

from scheduler_helpers import make_request, new_scheduler, run_until_done, shape, step
from stallfree.config import POLICIES, SchedulerConfig
from stallfree.scheduler import (
    ChunkedOnlyScheduler,
    OrcaScheduler,
    RequestLevelScheduler,
    SarathiScheduler,
    VLLMScheduler,
)


def test_every_policy_is_registered():
    classes = {"sarathi": SarathiScheduler, "vllm": VLLMScheduler, "orca": OrcaScheduler,
               "request_level": RequestLevelScheduler, "chunked_only": ChunkedOnlyScheduler}
    assert set(POLICIES) == set(classes)
    for policy, cls in classes.items():
        assert type(new_scheduler(policy)) is cls
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="fastertransformer")


@pytest.mark.parametrize("policy", ["vllm", "orca", "request_level"])
def test_whole_prefill_policies_need_room_for_a_whole_recompute(policy):
    # 10 one-token blocks, 5 kept free: a request that may grow to 6 cached
    # tokens could not be recomputed in one piece after a preemption.
    kwargs = dict(budget=4, num_blocks=10, block_size=1, watermark=0.5)
    new_scheduler("sarathi", **kwargs).add_request(make_request("A", 4, max_tokens=3))
    with pytest.raises(ValueError, match="watermark"):
        new_scheduler(policy, **kwargs).add_request(make_request("A", 4, max_tokens=3))
    new_scheduler(policy, **kwargs).add_request(make_request("A", 4, max_tokens=2))


# ---- vllm --------------------------------------------------------------------------
def test_vllm_a_fitting_arrival_gets_a_prefill_only_iteration_that_stalls_decodes():
    sched = new_scheduler("vllm", budget=32)
    a = make_request("A", 4, max_tokens=5)
    sched.add_request(a)
    step(sched, 0.0)
    assert shape(step(sched, 1.0)[0]) == [("A", 4, 1)]
    sched.add_request(make_request("B", 20))
    out, _ = step(sched, 2.0)
    assert shape(out) == [("B", 0, 20)] and out.num_decode_tokens == 0  # whole, A stalls
    out, _ = step(sched, 3.0)
    assert shape(out) == [("A", 5, 1), ("B", 20, 1)] and out.num_prefill_tokens == 0
    assert a.token_times == [0.0, 1.0, 3.0]  # the generation stall at 2.0


def test_vllm_budget_and_max_num_seqs_cap_the_prefill_iteration():
    sched = new_scheduler("vllm", budget=10)
    for rid in "ABC":
        sched.add_request(make_request(rid, 4, max_tokens=3))
    assert shape(step(sched)[0]) == [("A", 0, 4), ("B", 0, 4)]  # C: 4 > 2 tokens left
    assert shape(step(sched)[0]) == [("C", 0, 4)]  # C fits now: A and B stall
    assert shape(step(sched)[0]) == [("A", 4, 1), ("B", 4, 1), ("C", 4, 1)]

    sched = new_scheduler("vllm", budget=10, max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, 4, max_tokens=3))
    assert [c.request_id for c in step(sched)[0].chunks] == ["A", "B"]
    assert [c.request_id for c in step(sched)[0].chunks] == ["A", "B"]  # no seat: decode


def test_vllm_runs_a_prompt_longer_than_the_budget_alone():
    sched = new_scheduler("vllm", budget=8)
    sched.add_request(make_request("A", 20, max_tokens=2))
    sched.add_request(make_request("B", 3, max_tokens=2))
    out, _ = step(sched)
    assert shape(out) == [("A", 0, 20)] and out.num_batched_tokens == 20  # the one excess
    assert shape(step(sched)[0]) == [("B", 0, 3)]
    assert shape(step(sched)[0]) == [("A", 20, 1), ("B", 3, 1)]


def test_vllm_decodes_when_the_head_does_not_fit_and_never_skips_it():
    sched = new_scheduler("vllm", budget=100, num_blocks=20, block_size=1)
    sched.add_request(make_request("A", 15, max_tokens=5))
    step(sched)
    sched.add_request(make_request("B", 10, max_tokens=1))
    sched.add_request(make_request("C", 2, max_tokens=1))  # would fit, but B is first
    assert shape(step(sched)[0]) == [("A", 15, 1)]
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    assert [r.request_id for r in run_until_done(sched)] == ["A", "B", "C"]


def test_vllm_preempts_in_decode_iterations_and_recomputes_whole():
    sched = new_scheduler("vllm", budget=16, num_blocks=6, block_size=2)
    reqs = [make_request(rid, 4, max_tokens=5) for rid in "ABC"]
    sched.add_request(reqs[0])
    sched.add_request(reqs[1])
    step(sched)
    sched.add_request(reqs[2])
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched, float(len(outs)))[0])
    assert any(o.preempted for o in outs)
    for o in outs:
        assert o.num_prefill_tokens == 0 or o.num_decode_tokens == 0
        assert not (o.preempted and o.num_prefill_tokens)  # only decodes need room
    # A recompute is one whole prefill of the prompt plus the outputs kept.
    recomputes = [c for o in outs for c in o.chunks if c.start == 0 and c.num_tokens > 4]
    assert recomputes and all(c.samples for c in recomputes)
    assert len(recomputes) == sum(r.num_preemptions for r in reqs)
    assert all(r.num_output_tokens == 5 for r in reqs)


# ---- orca --------------------------------------------------------------------------
def test_orca_mixes_every_decode_with_whole_prefills():
    sched = new_scheduler("orca", budget=32, max_model_len=64)
    sched.add_request(make_request("A", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("B", 20))
    out, _ = step(sched)
    assert shape(out) == [("A", 4, 1), ("B", 0, 20)]  # hybrid, unchunked: A waits for B
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 20)


def test_orca_reservation_limits_the_batch_and_never_preempts():
    # max_model_len 32 = 8 blocks of 4 reserved per request: 20 blocks seat 2.
    sched = new_scheduler("orca", budget=32, max_model_len=32, num_blocks=20)
    assert isinstance(sched, OrcaScheduler) and sched.reservation_blocks == 8
    for rid in "ABC":
        sched.add_request(make_request(rid, 2, max_tokens=3))
    assert shape(step(sched)[0]) == [("A", 0, 2), ("B", 0, 2)]
    assert sched.block_manager.num_free_blocks == 18  # C waits although memory is free
    assert shape(step(sched)[0]) == [("A", 2, 1), ("B", 2, 1)]
    out, finished = step(sched)
    assert shape(out) == [("A", 3, 1), ("B", 3, 1)] and len(finished) == 2
    assert shape(step(sched)[0]) == [("C", 0, 2)]
    # The same requests under vllm all run at once.
    vllm = new_scheduler("vllm", budget=32, max_model_len=32, num_blocks=20)
    for rid in "ABC":
        vllm.add_request(make_request(rid, 2, max_tokens=3))
    assert len(step(vllm)[0].chunks) == 3


def test_orca_reservation_is_capped_at_the_cache():
    # 16 blocks cannot hold one max_model_len (128 tokens): one request at a time.
    sched = new_scheduler("orca", max_model_len=128, num_blocks=16)
    assert isinstance(sched, OrcaScheduler) and sched.reservation_blocks == 16
    sched.add_request(make_request("A", 4, max_tokens=2))
    sched.add_request(make_request("B", 4, max_tokens=2))
    assert shape(step(sched)[0]) == [("A", 0, 4)]
    assert shape(step(sched)[0]) == [("A", 4, 1)]
    assert shape(step(sched)[0]) == [("B", 0, 4)]


def test_orca_runs_a_prompt_longer_than_the_budget_beside_the_decodes():
    sched = new_scheduler("orca", budget=8, max_model_len=64)
    sched.add_request(make_request("A", 2, max_tokens=5))
    step(sched)
    sched.add_request(make_request("B", 12))
    sched.add_request(make_request("C", 3))
    out, _ = step(sched)
    assert shape(out) == [("A", 2, 1), ("B", 0, 12)] and out.num_batched_tokens == 13
    assert shape(step(sched)[0]) == [("A", 3, 1), ("B", 12, 1), ("C", 0, 3)]


# ---- request_level ---------------------------------------------------------------------
def test_request_level_admits_nothing_while_a_batch_decodes():
    sched = new_scheduler("request_level")
    sched.add_request(make_request("A", 4, max_tokens=2))
    sched.add_request(make_request("B", 4, max_tokens=6))
    assert shape(step(sched, 0.0)[0]) == [("A", 0, 4), ("B", 0, 4)]
    c = make_request("C", 3, max_tokens=1)
    sched.add_request(c)
    _, finished = step(sched, 1.0)
    assert [r.request_id for r in finished] == ["A"]
    for now in (2.0, 3.0, 4.0, 5.0):  # the batch shrank to B; C still waits
        out, _ = step(sched, now)
        assert [x.request_id for x in out.chunks] == ["B"]
    assert not sched.running and c.first_scheduled_time is None
    out, _ = step(sched, 6.0)
    assert shape(out) == [("C", 0, 3)] and c.first_scheduled_time == 6.0


def test_request_level_batch_is_capped_by_max_num_seqs_and_budget():
    sched = new_scheduler("request_level", budget=10, max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    assert [x.request_id for x in step(sched)[0].chunks] == ["A", "B"]
    sched = new_scheduler("request_level", budget=10)
    for rid in "ABC":
        sched.add_request(make_request(rid, 4, max_tokens=2))
    assert [x.request_id for x in step(sched)[0].chunks] == ["A", "B"]  # C: 4 > 2 left
    assert [x.request_id for x in step(sched)[0].chunks] == ["A", "B"]
    assert [x.request_id for x in step(sched)[0].chunks] == ["C"]


# ---- chunked_only ----------------------------------------------------------------------
def test_chunked_only_alternates_prefill_chunks_with_decodes():
    sched = new_scheduler("chunked_only", budget=8)
    sched.add_request(make_request("A", 2, max_tokens=10))
    assert shape(step(sched)[0]) == [("A", 0, 2)]
    sched.add_request(make_request("B", 20))
    shapes = [shape(step(sched)[0]) for _ in range(8)]
    assert shapes == [[("A", 2, 1)], [("B", 0, 8)], [("A", 3, 1)], [("B", 8, 8)],
                      [("A", 4, 1)], [("B", 16, 4)],
                      [("A", 5, 1), ("B", 20, 1)], [("A", 6, 1), ("B", 21, 1)]]


def test_chunked_only_runs_prefills_back_to_back_when_nothing_decodes():
    sched = new_scheduler("chunked_only", budget=8)
    sched.add_request(make_request("A", 20, max_tokens=2))
    sched.add_request(make_request("B", 3, max_tokens=2))
    shapes = [shape(step(sched)[0]) for _ in range(4)]
    assert shapes == [[("A", 0, 8)], [("A", 8, 8)], [("A", 16, 4), ("B", 0, 3)],
                      [("A", 20, 1), ("B", 3, 1)]]


# ---- hybrid-only ablation: sarathi with token_budget = max_model_len -------------------------
def test_hybrid_only_is_sarathi_with_a_max_model_len_budget():
    chunked = new_scheduler("sarathi", budget=8, max_model_len=64)
    hybrid = new_scheduler("sarathi", budget=64, max_model_len=64)
    for sched in (chunked, hybrid):
        sched.add_request(make_request("A", 2, max_tokens=5))
        step(sched)
        sched.add_request(make_request("B", 40))
    assert shape(step(chunked)[0]) == [("A", 2, 1), ("B", 0, 7)]
    assert shape(step(hybrid)[0]) == [("A", 2, 1), ("B", 0, 40)]  # a whole prompt: a stall
