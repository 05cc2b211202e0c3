"""The simulator decides exactly as the real LLMEngine does for the same arrivals and times.

The engine (the session's default model) runs with its clock and its model runner
replaced: the runner samples token 0 and advances the clock by the same constant-cost
model the simulator uses, so only the scheduling loops are compared.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import stallfree.engine as engine_module
from stallfree.bench.workload import WorkloadConfig, build_workload
from stallfree.config import CacheConfig, SchedulerConfig
from stallfree.executor.base import RunnerOutput
from stallfree.model.decoder import kv_cache_bytes_per_token
from stallfree.sampling_params import SamplingParams
from stallfree.sim.cost_model import BatchShape, ConstantCostModel
from stallfree.sim.simulator import FAKE_TOKEN, SimConfig, simulate


def shapes(out):
    return [(c.request_id, c.start, c.num_tokens) for c in out.chunks]


@pytest.mark.parametrize("policy, shared", [("sarathi", 0), ("vllm", 0), ("orca", 0),
                                            ("sarathi", 24), ("vllm", 24)])
def test_simulator_matches_the_engine(default_llm, monkeypatch, policy, shared):
    """With `shared`, every prompt starts with the same tokens: the prefix cache hits alike."""
    engine = default_llm.engine
    saved = engine.config.scheduler, engine.config.cache
    block_size, num_blocks = 4, 48
    block_bytes = kv_cache_bytes_per_token(engine.model_config, engine.dtype) * block_size
    sched = SchedulerConfig(policy, token_budget=32, max_num_seqs=6, max_model_len=128)
    engine.reconfigure(sched, CacheConfig(block_size, num_blocks * block_bytes, watermark=0.0))
    assert engine.block_manager.num_total_blocks == num_blocks
    cost = ConstantCostModel(base=0.01, per_token=0.001, per_seq=0.002)
    clock = SimpleNamespace(now=0.0)
    engine_outputs = []

    def execute(out):
        engine_outputs.append(out)
        clock.now += cost.iteration(BatchShape.from_output(out)).total()
        return RunnerOutput({c.request_id: FAKE_TOKEN for c in out.chunks if c.samples})

    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: clock.now,
                                                              thread_time=lambda: 0.0))
    monkeypatch.setattr(engine.executor.runner, "execute", execute)
    specs = build_workload(WorkloadConfig(dataset="random", num_prompts=24, request_rate=25.0,
                                          seed=7, random_input_len=20, random_output_len=10,
                                          random_range_ratio=0.8, burstiness=0.5,
                                          shared_prefix_len=shared))
    try:
        pending, token_times = list(specs), {}
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].arrival <= clock.now:
                s = pending.pop(0)
                engine.add_request(str(s.index), s.prompt_token_ids,
                                   SamplingParams(max_tokens=s.output_len, ignore_eos=True,
                                                  temperature=0.0), arrival_time=s.arrival)
            if not engine.has_unfinished_requests():
                clock.now = pending[0].arrival
                continue
            for out in engine.step().finished:
                token_times[out.request_id] = out.outputs[0].token_times
    finally:
        for s in specs:  # a failure must not leave the shared engine busy
            engine.abort_request(str(s.index))
        engine.reconfigure(*saved)

    res = simulate(specs, SimConfig(sched, num_blocks, block_size, 0.0, keep_outputs=True),
                   cost)
    assert [shapes(o) for o in res.outputs] == [shapes(o) for o in engine_outputs]
    cached = [res.requests[s.index].num_cached_tokens for s in specs]
    assert (sum(cached) > 0) == bool(shared)
    for s in specs:
        assert res.requests[s.index].token_times == pytest.approx(token_times[str(s.index)])
