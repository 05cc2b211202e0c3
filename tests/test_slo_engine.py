"""The TBT SLO in the real engine, on the tiny random-weight model (float32)."""
from __future__ import annotations

import dataclasses

import pytest

from stallfree import LLM, SamplingParams
from stallfree.iteration_log import IterationLog, read_iteration_log

PROMPTS = [[1 + i for i in range(n)] for n in (3, 40, 90, 7)]
SETTINGS = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 20, block_size=8)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def test_greedy_tokens_are_the_same_with_an_slo(tiny_model, tmp_path):
    with LLM(tiny_model, **SETTINGS) as plain:
        expected = generate(plain)
    # A generous SLO (nothing else runs in the test), so only the batching changes.
    with LLM(tiny_model, tbt_slo=5.0, **SETTINGS) as llm:
        assert generate(llm) == expected
        engine = llm.engine
        records = list(engine.iterations)
        assert records and all(r.predicted_time is not None and r.token_budget >= 1
                               and 0 < r.target_time < 5.0 for r in records)
        assert engine.cost.num_observed == len(records)  # refined by every iteration
        log = IterationLog(tmp_path / "iterations.jsonl")
        log.write(records[0])
        log.close()
        _, (back,) = read_iteration_log(tmp_path / "iterations.jsonl")
        assert back == dataclasses.replace(records[0], request_ids=())  # ids: not logged


def test_the_model_learns_each_iterations_period(tiny_model):
    # A decode waits from one iteration's start to the next's: that is what is learnt,
    # unless the engine sat idle in between (then the iteration's own time).
    with LLM(tiny_model, tbt_slo=5.0, **SETTINGS) as llm:
        cost, seen = llm.engine.cost, []
        observe = cost.observe
        cost.observe = lambda features, seconds: (seen.append(seconds),
                                                  observe(features, seconds))
        generate(llm)
        records = list(llm.engine.iterations)
    assert len(seen) == len(records) > 1
    for record, after, seconds in zip(records, records[1:], seen):
        busy = after.start - record.end < record.end - record.start
        assert seconds == pytest.approx(after.start - record.start if busy
                                        else record.end - record.start)
    assert seen[-1] == pytest.approx(records[-1].end - records[-1].start)
    assert sum(seen[:-1]) > sum(r.end - r.start for r in records[:-1])


def test_an_unreachable_slo_fails_at_start_up(tiny_model):
    with pytest.raises(ValueError, match="tbt_slo=1e-09 s is unreachable"):
        LLM(tiny_model, tbt_slo=1e-9, **SETTINGS)


def test_the_iteration_log_leaves_the_slo_fields_out_without_one(tmp_path):
    from stallfree.outputs import IterationRecord

    log = IterationLog(tmp_path / "plain.jsonl")
    log.write(IterationRecord(0.0, 1.0, 4, 0, 1, 0, prefill_chunks=((4, 0),)))
    log.close()
    text = (tmp_path / "plain.jsonl").read_text()
    assert "predicted_time" not in text and "token_budget" not in text


# ---- metrics and the simulator (no model) ---------------------------------------------
def test_metrics_record_budget_and_predicted_vs_measured():
    from stallfree.outputs import IterationRecord
    from stallfree.server.prometheus import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.observe_iteration(IterationRecord(0.0, 0.04, 30, 2, 3, 0, token_budget=40,
                                              predicted_time=0.035))
    metrics.observe_iteration(IterationRecord(0.0, 0.04, 30, 2, 3, 0))  # no SLO: not counted
    text = metrics.render().decode()
    assert 'stallfree:iteration_token_budget_sum{model_name="m"} 40.0' in text
    assert 'stallfree:iteration_predicted_seconds_sum{model_name="m"} 0.035' in text
    assert 'stallfree:iteration_measured_seconds_count{model_name="m"} 1.0' in text


def test_the_simulator_runs_the_slo_scheduler_on_its_cost_model():
    from stallfree.bench.workload import RequestSpec
    from stallfree.config import SchedulerConfig
    from stallfree.scheduler.cost_fit import BatchFeatures
    from stallfree.sim.cost_model import BatchShape, ConstantCostModel
    from stallfree.sim.simulator import SimConfig, simulate

    cost = ConstantCostModel(base=0.01, per_token=2e-4)  # linear: the fit is exact
    slo = 0.05  # x 0.8: 0.04 s, i.e. 150 tokens an iteration
    specs = [RequestSpec(i, 0.1 * i, 300 + 20 * i, 20, [100 + j for j in range(300 + 20 * i)])
             for i in range(12)]
    config = SchedulerConfig("sarathi", None, 64, 1024, tbt_slo=slo)
    result = simulate(specs, SimConfig(config, 4096, 16, 0.0, keep_outputs=True), cost)
    assert all(r.is_finished for r in result.requests)
    for out in result.outputs:
        simulated = cost.iteration(BatchShape.from_output(out)).total()
        assert out.predicted_time == pytest.approx(simulated, rel=1e-6)  # the fit is exact
        assert simulated <= 0.8 * slo + 1e-9
        assert out.token_budget == 150
        features = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in out.chunks)
        assert features.decodes + features.prefill_tokens == out.num_batched_tokens
    assert max(out.num_batched_tokens for out in result.outputs) == 150


def test_the_cost_model_starts_from_a_profile_folder(tmp_path):
    from argparse import Namespace

    from stallfree.cli.args import slo_cost_seed
    from stallfree.config import EngineConfig
    from stallfree.scheduler.cost_fit import BatchFeatures
    from test_sim_cpu_profile import write_cpu_profile

    write_cpu_profile(tmp_path, "stallfree.paged_attention")
    args = Namespace(profile=str(tmp_path))
    cost = slo_cost_seed(args, EngineConfig.from_kwargs(tbt_slo=0.5, max_model_len=2048))
    assert all(c >= 0 for c in cost.coefficients)
    small, large = BatchFeatures(prefill_tokens=16), BatchFeatures(prefill_tokens=1024)
    assert 0 < cost.predict(small) < cost.predict(large)
    with pytest.raises(ValueError, match="--tbt-slo"):
        slo_cost_seed(args, EngineConfig.from_kwargs(max_model_len=2048))


def test_the_engine_reports_the_margin_it_learns(tiny_model):
    from stallfree.scheduler.slo_sarathi import FIRST_MARGIN, MARGIN_BOUNDS, OVERRUN_QUANTILE

    with LLM(tiny_model, **SETTINGS) as plain:
        assert plain.engine.stats().tbt_slo_margin is None  # no SLO, no margin
    with LLM(tiny_model, tbt_slo=5.0, tbt_slo_margin=0.7, **SETTINGS) as fixed:
        assert fixed.engine.stats().tbt_slo_margin == 0.7
    with LLM(tiny_model, tbt_slo=5.0, **SETTINGS) as llm:
        assert llm.engine.stats().tbt_slo_margin == FIRST_MARGIN
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        llm.generate([PROMPTS[0]], params)  # 120 iterations that decode
        overrun = llm.engine.cost.overrun(OVERRUN_QUANTILE)
        assert overrun is not None
        low, high = MARGIN_BOUNDS
        assert llm.engine.stats().tbt_slo_margin == min(high, max(low, 1 / overrun))
