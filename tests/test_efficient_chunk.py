"""The efficient chunk: the SLO budget's cap at the size past which a larger iteration
computes no faster per token, measured at start-up (engine) or read from a cost model
(simulator, --profile)."""
from __future__ import annotations

import pytest

from stallfree.executor import cost_probe
from stallfree.scheduler import OnlineCost
from stallfree.scheduler.cost_fit import BatchFeatures, efficient_chunk
from stallfree.scheduler.output import SchedulerOutput
from stallfree.sim.cost_model import BatchShape, IterationCost
from test_slo_budget import TRUE, FakeExecutor, run_checked, slo_scheduler


def per_token_seconds(knee: int, n: int) -> float:
    """A lone chunk's time: 1e-4 s per token up to `knee` tokens, 3e-4 past it, + 2 ms."""
    return 0.002 + 1e-4 * min(n, knee) + 3e-4 * max(0, n - knee)


def test_the_largest_size_within_the_tolerance_of_the_best_is_efficient():
    # Seconds per chunk as this project's CPU measured them (per token: 620, 454, 356,
    # 349, 346, 359 us): flat from 256 on, the lowest at 768.
    measured = {64: 64 * 620e-6, 128: 128 * 454e-6, 256: 256 * 356e-6, 512: 512 * 349e-6,
                768: 768 * 346e-6, 1024: 1024 * 359e-6}
    assert efficient_chunk(measured) == 768
    measured[768] = 768 * 354e-6  # now 512 is the best, and 768 1.4% above it
    assert efficient_chunk(measured) == 512
    assert efficient_chunk(measured, tolerance=0.03) == 1024
    with pytest.raises(ValueError, match="at least one"):
        efficient_chunk({})


@pytest.mark.parametrize("budget, cap", [(None, 96), (64, 64)])
def test_no_iteration_runs_past_the_efficient_chunk(budget, cap):
    # A generous SLO would allow thousands of tokens: the efficient chunk (or a smaller
    # --max-num-batched-tokens) binds instead, and every request still finishes.
    sched = slo_scheduler(10.0, OnlineCost(TRUE, efficient_tokens=96), budget=budget)
    assert sched.config.token_budget == cap
    arrivals = [(i // 2, 30 + 41 * i % 400, 5 + i % 9) for i in range(20)]
    run_checked(sched, arrivals, FakeExecutor(), learn=True)


class ClockedExecutor:
    """Runs nothing: each batch advances a fake clock by its lone chunk's time."""

    depth, restartable = 1, False

    def __init__(self, knee: int) -> None:
        self.knee, self.now, self.sizes = knee, 0.0, []

    def submit(self, output: SchedulerOutput) -> None:
        features = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in output.chunks)
        n = features.prefill_tokens + features.decodes
        if len(output.chunks) == 1 and features.prefill_tokens:
            self.sizes.append(n)
        self.now += per_token_seconds(self.knee, n)

    def receive(self) -> None:
        return None


# longest: the longest lone chunk timed (512 is also a chunk of the coefficients' probes)
@pytest.mark.parametrize("knee, budget, expected, longest", [
    (512, 8192, 512, 1024), (512, 300, 300, 512), (3000, 8192, 2048, 2048)])
def test_start_up_calibration_finds_the_knee(monkeypatch, knee, budget, expected, longest):
    # Per token: 2 ms / n + 0.1 ms to the knee, so the lowest at the knee, or at the most
    # tokens probed (the budget of 300; the longest context, 2048).

    executor = ClockedExecutor(knee)
    monkeypatch.setattr(cost_probe.time, "perf_counter", lambda: executor.now)
    cost = cost_probe.calibrate(executor, num_blocks=1024, block_size=16, max_model_len=2049,
                                token_budget=budget)
    assert cost.efficient_tokens == expected
    # Probing stops two sizes past the knee, not at the longest context.
    assert max(executor.sizes) == longest


class KneeCostModel:
    """The simulator's cost model interface with the knee of `per_token_seconds`."""

    pp = 1

    def __init__(self, knee: int) -> None:
        self.knee = knee

    def iteration(self, batch: BatchShape) -> IterationCost:
        return IterationCost(0.0, per_token_seconds(self.knee, batch.num_tokens))

    def describe(self) -> dict[str, str]:
        return {"kind": "knee"}


def test_the_simulator_caps_iterations_at_the_cost_models_efficient_chunk():
    from stallfree.bench.workload import RequestSpec
    from stallfree.config import SchedulerConfig
    from stallfree.sim.simulator import SimConfig, simulate
    from stallfree.sim.slo_fit import fit_cost_model

    cost = KneeCostModel(knee=384)
    assert fit_cost_model(cost, 8192, 1024).efficient_tokens == 384
    specs = [RequestSpec(i, 0.0, 200 + 30 * i, 8, [100 + j for j in range(200 + 30 * i)])
             for i in range(12)]
    config = SchedulerConfig("sarathi", None, 64, 1024, tbt_slo=5.0)  # the SLO never binds
    result = simulate(specs, SimConfig(config, 4096, 16, 0.0, keep_outputs=True), cost)
    assert all(r.is_finished for r in result.requests)
    assert max(out.num_batched_tokens for out in result.outputs) == 384
