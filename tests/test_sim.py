"""The simulator on a constant-cost model: hand-computed timelines, the same decisions as a
hand-driven scheduler, pipeline parallelism, and the report it feeds (no torch, no profiles)."""
from __future__ import annotations

import pytest

from stallfree.bench.report import compute_report
from stallfree.bench.workload import RequestSpec, WorkloadConfig, build_workload
from stallfree.config import POLICIES, SchedulerConfig
from stallfree.scheduler import BlockManager, make_scheduler
from stallfree.sim.cost_model import BatchShape, ConstantCostModel
from stallfree.sim.simulator import FAKE_TOKEN, SimConfig, make_request, simulate


def spec(index: int, arrival: float, prompt: int, output: int) -> RequestSpec:
    return RequestSpec(index, arrival, prompt, output, list(range(100, 100 + prompt)))


def sim(specs, policy="sarathi", budget=4, seqs=8, blocks=64, block_size=4, max_len=64,
        cost=None, **kw):
    cfg = SimConfig(SchedulerConfig(policy, budget, seqs, max_len), blocks, block_size, 0.0,
                    keep_outputs=True, **kw)
    return simulate(specs, cfg, cost or ConstantCostModel(base=0.1))


def shapes(out):
    return [(c.request_id, c.start, c.num_tokens) for c in out.chunks]


# ---- hand-computed timelines ---------------------------------------------------------------
def test_sarathi_timeline_by_hand():
    # A: 6-token prompt, 3 outputs, at 0. B: 2-token prompt, 2 outputs, at 0.05. Budget 4,
    # every iteration 0.1 s. A's prompt takes two chunks (4 then 2); B joins the second.
    res = sim([spec(0, 0.0, 6, 3), spec(1, 0.05, 2, 2)])
    assert [shapes(o) for o in res.outputs] == [
        [("0", 0, 4)], [("0", 4, 2), ("1", 0, 2)], [("0", 6, 1), ("1", 2, 1)], [("0", 7, 1)]]
    a, b = res.requests
    assert a.token_times == pytest.approx([0.2, 0.3, 0.4])
    assert b.token_times == pytest.approx([0.2, 0.3])
    rep = compute_report(res.run)
    assert rep["completed"] == 2 and rep["duration"] == pytest.approx(0.4)
    assert rep["mean_ttft_ms"] == pytest.approx((200 + 150) / 2)
    assert rep["mean_sched_delay_ms"] == pytest.approx((0 + 50) / 2)
    assert rep["max_tbt_ms"] == pytest.approx(100)


def test_idle_gap_and_cpu_overhead():
    # Nothing to do between 0.24 and 5.0: the clock jumps to the arrival. Each iteration
    # costs 0.02 s of CPU plus 0.1 s on the device.
    res = sim([spec(0, 0.0, 3, 2), spec(1, 5.0, 3, 1)], cost=ConstantCostModel(0.1, cpu=0.02))
    a, b = res.requests
    assert a.token_times == pytest.approx([0.12, 0.24])
    assert b.token_times == pytest.approx([5.12])
    assert b.first_scheduled_time == pytest.approx(5.0)


def test_vllm_stall_by_hand():
    # vLLM runs B's whole 8-token prefill alone, so A's decode waits: a stall of 2 iterations.
    cost = ConstantCostModel(base=0.1, per_token=0.05)  # 1 token: 0.15 s, 8 tokens: 0.5 s
    res = sim([spec(0, 0.0, 2, 4), spec(1, 0.3, 8, 1)], policy="vllm", budget=16, cost=cost)
    assert [shapes(o) for o in res.outputs] == [
        [("0", 0, 2)], [("0", 2, 1)], [("1", 0, 8)], [("0", 3, 1)], [("0", 4, 1)]]
    a, b = res.requests
    assert a.token_times == pytest.approx([0.2, 0.35, 1.0, 1.15])
    assert b.token_times == pytest.approx([0.85])


# ---- same decisions as the scheduler driven by hand ------------------------------------
def drive_by_hand(specs, config, num_blocks, block_size, cost):
    """The engine's loop (LLMEngine.step) written out, with the same fake sampler."""
    sched = make_scheduler(config, BlockManager(num_blocks, block_size, 0.0))
    pending = sorted(specs, key=lambda s: (s.arrival, s.index))
    reqs, outputs, now = {}, [], 0.0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival <= now:
            s = pending.pop(0)
            reqs[s.index] = make_request(s)
            sched.add_request(reqs[s.index])
        if not sched.has_unfinished_requests():
            now = pending[0].arrival
            continue
        out = sched.schedule(now)
        outputs.append(out)
        now += cost.iteration(BatchShape.from_output(out)).total()
        sched.update(out, {c.request_id: FAKE_TOKEN for c in out.chunks if c.samples}, now)
    return outputs, reqs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_same_decisions_as_hand_driven_scheduler(policy, seed):
    # A tight KV cache (preemptions for the policies that can preempt) and bursty arrivals.
    w = WorkloadConfig(dataset="random", num_prompts=40, request_rate=30.0, seed=seed,
                       random_input_len=24, random_output_len=12, random_range_ratio=0.9,
                       burstiness=0.5)
    specs = build_workload(w)
    config = SchedulerConfig(policy, 32, 6, 128)
    cost = ConstantCostModel(base=0.01, per_token=0.001, per_seq=0.002, cpu=0.003)
    res = sim(specs, policy, 32, 6, 40, 4, 128, cost)
    hand_out, hand_reqs = drive_by_hand(specs, config, 40, 4, cost)
    assert [shapes(o) for o in res.outputs] == [shapes(o) for o in hand_out]
    for s in specs:
        assert res.requests[s.index].token_times == pytest.approx(hand_reqs[s.index].token_times)
        assert len(res.requests[s.index].token_times) == s.output_len
    if policy in ("sarathi", "vllm"):
        assert sum(len(o.preempted) for o in hand_out) > 0 or seed == 1


def test_refused_request_fails_like_a_400():
    res = sim([spec(0, 0.0, 70, 2), spec(1, 0.0, 3, 2)], max_len=64)
    rep = compute_report(res.run)
    assert (rep["completed"], rep["failed"]) == (1, 1)
    assert res.run.results[0].error.startswith("HTTP 400")


def test_max_duration_fails_unfinished_and_unsent():
    res = sim([spec(0, 0.0, 3, 50), spec(1, 10.0, 3, 2)], max_duration=1.0)
    r0, r1 = res.run.results
    assert not r0.success and r0.output_len == 10 and "time limit" in r0.error
    assert not r1.success and r1.send_time is None


# ---- pipeline parallelism --------------------------------------------------------------
def test_pp_timeline_by_hand():
    # Two stages of 1 s, two requests of 4 prompt tokens at 0, budget 4: they alternate in
    # micro-batches, each request waiting for its previous micro-batch to come back.
    res = sim([spec(0, 0.0, 4, 2), spec(1, 0.0, 4, 2)], cost=ConstantCostModel(1.0, pp=2))
    assert [shapes(o) for o in res.outputs] == [
        [("0", 0, 4)], [("1", 0, 4)], [("0", 4, 1)], [("1", 4, 1)]]
    assert [it.stages for it in res.iterations] == [
        [(0, 1), (1, 2)], [(1, 2), (2, 3)], [(2, 3), (3, 4)], [(3, 4), (4, 5)]]
    a, b = res.requests
    assert a.token_times == [2.0, 4.0] and b.token_times == [3.0, 5.0]


def in_flight_overlaps(res):
    """Requests in two micro-batches in flight at once (must be none), unless preempted
    meanwhile: then the first micro-batch's chunk of it is discarded."""
    its = list(zip(res.iterations, res.outputs))
    bad = []
    for i, (it1, o1) in enumerate(its):
        for j in range(i + 1, len(its)):
            it2, o2 = its[j]
            if it2.scheduled >= it1.end:
                break
            shared = {c.request_id for c in o1.chunks} & {c.request_id for c in o2.chunks}
            preempted = {r for _, o in its[i + 1:j + 1] for r in o.preempted}
            if shared - preempted:
                bad.append((i, j, shared - preempted))
    return bad


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca"])
def test_pp_keeps_in_flight_requests_out_and_finishes(policy):
    w = WorkloadConfig(dataset="random", num_prompts=30, request_rate=40.0, seed=3,
                       random_input_len=20, random_output_len=10, random_range_ratio=0.8)
    specs = build_workload(w)
    res = sim(specs, policy, 32, 8, 48, 4, 64, ConstantCostModel(0.01, per_token=0.002, pp=4))
    assert not in_flight_overlaps(res)
    for s in specs:
        assert len(res.requests[s.index].token_times) == s.output_len
    assert max(o.num_seqs for o in res.outputs) <= 8


def test_pp_bubbles_from_uneven_batches():
    # Requests at 0 fill the first micro-batch, a later one the second. Micro-batches of
    # 3 and 1 decodes cost 0.031 and 0.011 s: each stage idles while the big one runs on
    # the other. Two and two: hardly any bubble.
    cost = ConstantCostModel(0.001, per_token=0.01, pp=2)

    def run(first: int, second: int):
        specs = [spec(i, 0.0, 2, 30) for i in range(first)]
        specs += [spec(first + i, 1e-4, 2, 30) for i in range(second)]
        return sim(specs, budget=64, cost=cost)

    uneven, even = run(3, 1), run(2, 2)
    assert uneven.stage_busy_fraction() < 0.75 and even.stage_busy_fraction() > 0.95
    # Each cycle of 0.062 s leaves each stage idle for 0.02 s: a third of the time.
    assert uneven.bubble_fraction() == pytest.approx(0.02 / 0.062, abs=0.02)
    assert even.bubble_fraction() < 0.05


def test_pp_preempting_an_in_flight_request_discards_its_chunk():
    # 10 blocks of 4 tokens: growing decodes must preempt, sometimes a request in flight.
    specs = [spec(i, 0.0, 6, 12) for i in range(4)]
    res = sim(specs, "sarathi", 8, 4, 10, 4, 64, ConstantCostModel(0.01, pp=2))
    assert sum(len(o.preempted) for o in res.outputs) > 0
    assert all(len(r.token_times) == 12 for r in res.requests)
    assert not in_flight_overlaps(res)
