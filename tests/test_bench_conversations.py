"""Workloads that repeat: a shared system prompt and multi-turn conversations, built, sent
by the client (against a fake-engine server) and simulated with the prefix cache."""
from __future__ import annotations

import numpy as np
import pytest

from server_utils import FakeEngine, ThreadServer
from stallfree.bench.client import run
from stallfree.bench.config import ClientConfig
from stallfree.bench.conversations import conversations
from stallfree.bench.records import RequestResult, RunResult
from stallfree.bench.report import compute_report
from stallfree.bench.workload import WorkloadConfig, build_workload
from stallfree.config import SchedulerConfig
from stallfree.server.api import build_app
from stallfree.sim.cost_model import ConstantCostModel
from stallfree.sim.simulator import SimConfig, simulate


def _turns(**changes) -> WorkloadConfig:
    base = dict(dataset="random", num_prompts=12, random_input_len=20, random_output_len=6,
                random_range_ratio=0.5, turns=3, think_time=0.5, request_rate=2.0,
                vocab_size=1000, min_token_id=10, seed=3)
    return WorkloadConfig(**(base | changes))


# ---- building -----------------------------------------------------------------------------
def test_each_turn_resends_the_history_and_follows_the_previous_one():
    specs = build_workload(_turns())
    assert len(specs) == 12 and [s.index for s in specs] == list(range(12))
    for s in specs:
        assert len(s.prompt_token_ids) == s.prompt_len
        if s.turn == 0:
            assert s.follows is None and s.think_time == 0.0
            continue
        prev = specs[s.follows]
        assert prev.turn == s.turn - 1 and prev.arrival == s.arrival and s.think_time > 0
        # The previous prompt, then its reply (output length) and a new message.
        assert s.prompt_token_ids[:prev.prompt_len] == prev.prompt_token_ids
        assert s.prompt_len > prev.prompt_len + prev.output_len
    assert sum(s.turn == 0 for s in specs) == 4
    starts = sorted({s.arrival for s in specs})
    assert len(starts) == 4 and starts[0] == 0.0  # conversations start at the request rate


def test_shared_prefix_starts_every_prompt_and_follows_the_salt():
    cfg = WorkloadConfig(dataset="random", num_prompts=5, random_input_len=8,
                         random_output_len=2, shared_prefix_len=32, max_model_len=64)
    specs = build_workload(cfg)
    head = specs[0].prompt_token_ids[:32]
    assert all(s.prompt_token_ids[:32] == head and s.prompt_len == 40 for s in specs)
    assert len({tuple(s.prompt_token_ids[32:]) for s in specs}) == 5
    salted = build_workload(cfg, token_salt=1)
    assert salted[0].prompt_token_ids[:32] != head
    # Without a shared prefix the prompts are drawn as before it existed: one draw each
    # from the tokens stream, so earlier runs' workloads are unchanged.
    plain = build_workload(WorkloadConfig(dataset="random", num_prompts=5, random_input_len=8,
                                          random_output_len=2))
    rng = np.random.default_rng([0, 2, 0])
    assert [s.prompt_token_ids for s in plain] == [
        rng.integers(100, 49152, size=8).tolist() for _ in range(5)]
    with pytest.raises(ValueError, match="shared prefix"):
        WorkloadConfig(shared_prefix_len=63, max_model_len=64)


def test_a_conversation_ends_before_it_outgrows_the_model():
    draws = iter(range(1000))
    sessions = conversations([(4, 2)] * 6, turns=3, shared=[9, 9],
                             draw=lambda n: [next(draws) for _ in range(n)], max_model_len=16)
    # First conversation: 2 + 4 (+2 reply) -> 2 + 4 + 2 + 4 = 12 (+2) fits; the third
    # turn would need 12 + 2 + 4 + 2 = 20 > 16.
    assert [[(len(p), d) for p, d in s] for s in sessions] == [[(6, 2), (12, 2)]] * 2
    assert sessions[0][1][0][:6] == sessions[0][0][0]
    with pytest.raises(ValueError, match="turns"):
        WorkloadConfig(turns=0)


# ---- the client -------------------------------------------------------------------------------
def test_the_client_sends_each_turn_a_think_time_after_the_last_reply():
    server = ThreadServer(build_app(FakeEngine(step_delay=0.005), "fake"))
    try:
        # The fake engine takes prompts under 64 tokens: each third turn (66) gets a 400,
        # and the fourth is never sent.
        specs = build_workload(_turns(num_prompts=8, turns=4, random_input_len=18,
                                      random_output_len=6, random_range_ratio=0.0,
                                      vocab_size=256, think_time=0.05, request_rate=50.0))
        result = run(specs, ClientConfig(base_url=server.url, progress=False))
    finally:
        server.stop()
    by_index = {r.index: r for r in result.results}
    assert [s.turn for s in specs] == [0, 1, 2, 3] * 2
    for s in specs:
        r = by_index[s.index]
        assert r.turn == s.turn and r.success == (s.turn < 2), r.error
        if s.turn in (1, 2):  # sent, after the previous reply and the think time
            prev = by_index[s.follows]
            assert r.send_time >= prev.chunk_times[-1] + s.think_time - 1e-3
        if s.turn == 2:
            assert r.error.startswith("HTTP 400")
        if s.turn == 3:
            assert r.error == "previous turn failed" and r.send_time is None


# ---- the simulator and the report -------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_simulated_turns_find_the_previous_prompt_cached(caching):
    specs = build_workload(_turns(num_prompts=9, random_input_len=40, random_output_len=8))
    cfg = SimConfig(SchedulerConfig("sarathi", 64, 8, 512), num_blocks=200, block_size=16,
                    watermark=0.0, keep_outputs=True, enable_prefix_caching=caching)
    res = simulate(specs, cfg, ConstantCostModel(base=0.05, per_token=0.001))
    results = {r.index: r for r in res.run.results}
    assert all(r.success for r in res.run.results)
    computed = 0
    for s in specs:
        r = results[s.index]
        # Sent its think time after the previous turn's last token.
        if s.follows is not None:
            assert r.send_time == pytest.approx(results[s.follows].chunk_times[-1]
                                                + s.think_time)
        # The previous prompt's whole blocks are cached (its reply differs from the one the
        # next turn resends); first turns share nothing.
        expected = specs[s.follows].prompt_len // 16 * 16 if s.follows is not None else 0
        assert r.usage_cached_tokens == (expected if caching else 0)
        computed += s.prompt_len - r.usage_cached_tokens
    prompt_work = sum(c.num_tokens for out in res.outputs for c in out.chunks
                      if c.start < c.request.num_prompt_tokens)
    assert prompt_work == computed
    rep = compute_report(res.run)
    assert rep["num_followup_turns"] == 6 and rep["median_followup_ttft_ms"] is not None
    total_prompt = sum(s.prompt_len for s in specs)
    assert rep["prefix_cache_hit_rate"] == pytest.approx((total_prompt - computed) / total_prompt)
    assert rep["mean_computed_prompt_tokens"] == pytest.approx(computed / len(specs))
    assert (rep["prefix_cache_hit_rate"] > 0) == caching


def test_report_without_usage_details_has_no_hit_rate():
    r = RequestResult(0, 10, 2, 0.0, send_time=0.0, chunk_times=[0.1, 0.2],
                      chunk_tokens=[1, 1], output_len=2, success=True, usage_prompt_tokens=10)
    rep = compute_report(RunResult([r], 0.2, 0.0))
    assert rep["prefix_cache_hit_rate"] is None and "median_followup_ttft_ms" not in rep
