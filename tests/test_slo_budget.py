"""The TBT SLO's token budget (scheduler/slo_sarathi.py) and its cost model (cost_fit.py).

A fake executor's iteration time follows a known linear formula plus noise; the
scheduler, the online fit and admission are checked through the scheduler's own
decisions and predictions, never by timing.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_helpers import make_request
from stallfree.attention_plan import split_chunks
from stallfree.config import (
    DEFAULT_TOKEN_BUDGET,
    SLO_TOKEN_BUDGET_CAP,
    EngineConfig,
    SchedulerConfig,
)
from stallfree.request import RequestStatus
from stallfree.scheduler import BlockManager, OnlineCost, make_scheduler
from stallfree.scheduler.cost_fit import (
    FEATURES,
    OVERRUN_MIN_SAMPLES,
    BatchFeatures,
    fit_least_squares,
)
from stallfree.scheduler.slo_sarathi import FIRST_MARGIN, MARGIN_BOUNDS, SloSarathiScheduler

# fixed, per prefill token, per attention pair, per decode, per decode context token
TRUE = (0.004, 2e-5, 3e-8, 3e-4, 2e-7)


def true_time(features: BatchFeatures, coefficients=TRUE) -> float:
    return sum(c * v for c, v in zip(coefficients, features.vector()))


class FakeExecutor:
    """Iteration time = the known formula x (1 + gaussian noise), seeded."""

    def __init__(self, noise: float = 0.01, seed: int = 0, coefficients=TRUE) -> None:
        self.rng = random.Random(seed)
        self.noise, self.coefficients = noise, coefficients

    def time(self, features: BatchFeatures) -> float:
        return true_time(features, self.coefficients) * (1 + self.rng.gauss(0, self.noise))


def random_features(rng: random.Random) -> BatchFeatures:
    f = BatchFeatures()
    for _ in range(rng.randint(0, 3)):
        f.add_chunk(rng.randint(0, 2048), rng.randint(2, 512))
    for _ in range(rng.randint(0, 64)):
        f.add_chunk(rng.randint(0, 2047), 1)
    return f


def assert_close(coefficients, expected=TRUE, tolerance=0.05):
    for name, got, want in zip(FEATURES, coefficients, expected):
        assert abs(got - want) <= tolerance * want, f"{name}: {got:.3g} vs {want:.3g}"


# ---- the cost model --------------------------------------------------------------------
def test_least_squares_recovers_exact_coefficients():
    rng = random.Random(1)
    samples = [(f.vector(), true_time(f)) for f in (random_features(rng) for _ in range(50))]
    assert_close(fit_least_squares(samples), tolerance=1e-3)


def test_least_squares_keeps_coefficients_non_negative():
    # Decodes never vary: their coefficients are unidentifiable and must not go negative.
    samples = [(BatchFeatures(prefill_tokens=n).vector(), 0.01 + 1e-4 * n) for n in (8, 64, 256)]
    coefficients = fit_least_squares(samples)
    assert all(c >= 0 for c in coefficients)
    assert coefficients[1] == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.parametrize("seed_scale", [0.5, 2.0])
def test_online_fit_converges_to_the_true_coefficients(seed_scale):
    cost = OnlineCost(tuple(c * seed_scale for c in TRUE))
    executor, rng = FakeExecutor(), random.Random(2)
    for _ in range(4000):
        f = random_features(rng)
        cost.observe(f, executor.time(f))
    assert_close(cost.coefficients)


@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 300)), max_size=20))
def test_features_split_chunks_as_the_kernel_runs_them(chunks):
    # One rule for what runs as a decode (attention_plan), so the cost model's decodes
    # are exactly the kernel's, a prompt's one-token chunk included.
    features = BatchFeatures.of_chunks(chunks)
    prefills, decode_contexts = split_chunks(chunks)
    assert features.decodes == len(decode_contexts)
    assert features.decode_context == sum(decode_contexts)
    assert features.prefill_tokens == sum(n for n, _ in prefills)


def test_online_fit_follows_drift():
    cost, rng = OnlineCost(TRUE), random.Random(3)
    slower = tuple(c * 1.5 for c in TRUE)  # e.g. another process takes part of the core
    executor = FakeExecutor(coefficients=slower)
    for _ in range(4000):
        f = random_features(rng)
        cost.observe(f, executor.time(f))
    assert_close(cost.coefficients, slower)


# ---- the scheduler under an SLO -----------------------------------------------------
def slo_scheduler(slo: float, cost: OnlineCost | None = None, max_num_seqs: int = 64,
                  num_blocks: int = 4096, budget: int | None = None,
                  margin: float | None = 0.8) -> SloSarathiScheduler:
    """`margin`: None learns it from the cost model's overruns."""
    config = SchedulerConfig(policy="sarathi", token_budget=budget, max_num_seqs=max_num_seqs,
                             max_model_len=2048, tbt_slo=slo, tbt_slo_margin=margin)
    sched = make_scheduler(config, BlockManager(num_blocks, 16, 0.0, enable_caching=False),
                           cost or OnlineCost(TRUE))
    assert isinstance(sched, SloSarathiScheduler)
    return sched


def features_of(chunks) -> BatchFeatures:
    return BatchFeatures.of_chunks((c.start, c.num_tokens) for c in chunks)


def run_checked(sched: SloSarathiScheduler, arrivals: list[tuple[int, int, int]],
                executor: FakeExecutor, learn: bool, limit: int = 3000) -> list[int]:
    """Runs (arrival iteration, prompt length, max_tokens) requests to the end, checking
    every iteration; returns the number of running requests after each."""
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    running_counts = []
    for it in range(limit):
        while pending and pending[0][1][0] <= it:
            rid, (_, prompt_len, max_tokens) = pending.pop(0)
            sched.add_request(make_request(str(rid), prompt_len, max_tokens))
        if not pending and not sched.has_unfinished_requests():
            return running_counts
        decoding = {r.request_id for r in sched.running if not r.is_prefill}
        partial = [r for r in sched.running if r.is_prefill]
        out = sched.schedule(float(it))
        assert not out.preempted  # the cache is ample: every decode must be there
        assert decoding <= {c.request_id for c in out.chunks}, "a running decode was left out"
        decodes = features_of(c for c in out.chunks if not c.is_prefill)
        predicted = sched.cost.predict(features_of(out.chunks))
        assert out.predicted_time == pytest.approx(predicted)
        assert out.target_time == sched.target  # one SLO for all: its margin's share
        if sched.cost.predict(decodes) <= sched.target and decodes.decodes:
            assert predicted <= sched.target + 1e-12, "the iteration's prediction overruns"
        if partial and sched.cost.predict(
                decodes.with_chunk(partial[0].num_computed_tokens, 1)) <= sched.target:
            assert any(c.is_prefill for c in out.chunks), "a prefill starved"
        assert out.num_batched_tokens <= sched.config.token_budget
        took = executor.time(features_of(out.chunks))
        if learn:
            sched.cost.observe(features_of(out.chunks), took)
        sampled = {c.request_id: 7 for c in out.chunks if c.samples}
        sched.update(out, sampled, float(it))
        running_counts.append(sched.num_running)
    raise AssertionError("requests left unfinished: something starved")


def test_a_last_token_costing_as_a_decode_is_checked_as_one():
    # Found by the property test: 12 tokens would fit as a prefill chunk, but the prompt
    # of one token runs as a decode, which costs more than the room left.
    arrivals = [(0, 1, 6), (0, 1256, 1), (0, 1, 1)]
    run_checked(slo_scheduler(0.015625), arrivals, FakeExecutor(), learn=False)


def test_decodes_kept_prefills_fit_and_progress():
    arrivals = [(i // 3, 40 + 37 * i % 900, 20 + i % 30) for i in range(30)]
    run_checked(slo_scheduler(0.05), arrivals, FakeExecutor(), learn=False)


def test_with_the_online_fit_in_the_loop():
    cost = OnlineCost(tuple(c * 0.7 for c in TRUE))  # a poor seed, corrected as it runs
    arrivals = [(i, 300 + 53 * i % 700, 40) for i in range(40)]
    run_checked(slo_scheduler(0.05, cost), arrivals, FakeExecutor(seed=4), learn=True)
    assert cost.num_observed > 0


@settings(max_examples=30, deadline=None)
@given(arrivals=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 1500),
                                   st.integers(1, 40)), min_size=1, max_size=25),
       slo=st.floats(0.01, 0.5), learn=st.booleans(), seed=st.integers(0, 3))
def test_random_arrivals(arrivals, slo, learn, seed):
    # 0.01 s x 0.8 is above the formula's one-token iteration (~4.3 ms): every request fits.
    run_checked(slo_scheduler(slo), arrivals, FakeExecutor(seed=seed), learn)


def decode_batch(decodes: int = 8) -> BatchFeatures:
    return BatchFeatures.of_chunks((300 + 17 * i, 1) for i in range(decodes))


def test_the_overrun_tail_is_read_from_iterations_that_decoded():
    cost = OnlineCost(TRUE, forget=1.0)
    prefill = BatchFeatures.of_chunks([(0, 256)])
    for _ in range(300):  # no decode in them: no token waited on these
        cost.observe(prefill, 3 * cost.predict(prefill))
    assert cost.overrun(0.99) is None
    for _ in range(OVERRUN_MIN_SAMPLES - 1):
        cost.observe(decode_batch(), cost.predict(decode_batch()))
    assert cost.overrun(0.99) is None  # too few yet
    rng = random.Random(0)
    for i in range(900):  # 3% of the iterations take 1.6x their prediction
        f = decode_batch(rng.randint(1, 32))
        cost.observe(f, cost.predict(f) * (1.6 if i % 33 == 0 else 1.0))
    assert cost.overrun(0.99) == pytest.approx(1.6, rel=0.1)
    assert cost.overrun(0.5) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("noise, margin", [(0.001, MARGIN_BOUNDS[1]), (0.1, None)])
def test_the_learned_margin_covers_the_overrun_tail(noise, margin):
    """An SLO divided by the 99th percentile overrun: a precise model earns the upper
    bound, a noisy one (sigma 10%: its 99th percentile near 1.23x) about 1 / 1.23."""
    sched = slo_scheduler(0.05, OnlineCost(TRUE), margin=None)
    fixed = slo_scheduler(0.05, OnlineCost(TRUE))
    assert sched.margin == FIRST_MARGIN and sched.target == pytest.approx(0.05 * FIRST_MARGIN)
    executor, rng = FakeExecutor(noise=noise, seed=2), random.Random(1)
    for cost in (sched.cost, fixed.cost):
        for _ in range(1000):
            f = decode_batch(rng.randint(1, 32))
            cost.observe(f, executor.time(f))
    expected = margin or 1 / sched.cost.overrun(0.99)
    assert sched.margin == pytest.approx(expected)
    assert margin is not None or 0.75 < sched.margin < 0.87
    sched.schedule(0.0)  # an iteration takes the margin learned so far
    assert sched.target == pytest.approx(0.05 * sched.margin)
    assert fixed.margin == 0.8  # a margin that was set is kept


def test_a_learned_margin_keeps_decodes_and_the_prediction_within_its_target():
    arrivals = [(4 * i, 200 + 71 * i % 900, 120) for i in range(60)]
    sched = slo_scheduler(0.05, margin=None)
    run_checked(sched, arrivals, FakeExecutor(noise=0.1, seed=5), learn=True)
    assert sched.margin != FIRST_MARGIN  # learned along the way


def test_admission_stops_the_decode_batch_at_the_slo():
    # 10 ms per iteration + 1 ms per decode, target 0.8 x 23.75 ms = 19 ms: 9 decodes fit.
    cost = OnlineCost((0.010, 1e-6, 0.0, 0.001, 0.0))
    sched = slo_scheduler(0.02375, cost)
    for i in range(40):
        sched.add_request(make_request(str(i), 8, max_tokens=500))
    counts = []
    for it in range(30):
        out = sched.schedule(float(it))
        sched.update(out, {c.request_id: 7 for c in out.chunks if c.samples}, float(it))
        counts.append(sched.num_running)
    assert max(counts) == counts[-1] == 9
    assert sched.num_waiting == 31
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)


def test_the_budget_is_capped_by_max_num_batched_tokens():
    cost = OnlineCost((0.001, 1e-6, 0.0, 1e-5, 0.0))  # a generous SLO: the cap binds
    sched = slo_scheduler(10.0, cost, budget=64)
    sched.add_request(make_request("a", 1000, max_tokens=4))
    out = sched.schedule(0.0)
    assert out.num_batched_tokens == out.token_budget == 64


def test_token_budget_defaults():
    assert SchedulerConfig().token_budget == DEFAULT_TOKEN_BUDGET
    assert SchedulerConfig(tbt_slo=0.1).token_budget == SLO_TOKEN_BUDGET_CAP
    assert SchedulerConfig(tbt_slo=0.1, token_budget=256).token_budget == 256


@pytest.mark.parametrize("value", [-1.0, 0, 0.0, "abc", "0.1", float("nan"), float("inf"),
                                   True])
def test_bad_slo_values_are_rejected_naming_the_field(value):
    with pytest.raises(ValueError, match="tbt_slo"):
        SchedulerConfig(tbt_slo=value)
    with pytest.raises(ValueError, match="tbt_slo"):
        EngineConfig.from_kwargs(tbt_slo=value)


@pytest.mark.parametrize("margin", [0, -0.5, 1.5, "x"])
def test_bad_margins_are_rejected(margin):
    with pytest.raises(ValueError, match="tbt_slo_margin"):
        SchedulerConfig(tbt_slo=0.1, tbt_slo_margin=margin)


def test_slo_needs_sarathi_and_a_cost_model():
    with pytest.raises(ValueError, match="sarathi"):
        SchedulerConfig(policy="vllm", tbt_slo=0.1)
    config = SchedulerConfig(tbt_slo=0.1, max_model_len=64)
    with pytest.raises(ValueError, match="cost model"):
        make_scheduler(config, BlockManager(16, 16, 0.0))


def test_the_command_line_rejects_a_non_numeric_slo(capsys):
    from stallfree.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--tbt-slo", "fast", "hi"])
    assert "--tbt-slo" in capsys.readouterr().err
