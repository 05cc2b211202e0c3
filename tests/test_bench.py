"""Benchmark tooling without a model: metrics on hand-made timelines, workloads, capacity search."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.bench.capacity import Criterion, SearchConfig, search_capacity
from stallfree.bench.capacity_report import (
    add_system,
    cached_trials,
    headline,
    new_document,
    search_slos,
)
from stallfree.bench.client import ResponseStream
from stallfree.bench.config import SLOs
from stallfree.bench.prom import parse_histogram
from stallfree.bench.records import RequestResult, RunResult
from stallfree.bench.report import compute_report, format_report
from stallfree.bench.workload import (
    TRACES,
    WorkloadConfig,
    arrival_times,
    build_workload,
    cap_lengths,
    load_trace,
    scale_lengths,
    trace_path,
)


# ---- metrics on hand-made token timelines ------------------------------------------------
def _req(index, send, chunk_times, chunk_tokens=None, prompt_len=10, expected=None):
    tokens = chunk_tokens or [1] * len(chunk_times)
    n = sum(tokens)
    return RequestResult(index, prompt_len, expected or n, send, send, list(chunk_times),
                         tokens, n, success=True)


@pytest.fixture()
def run():
    # r0: a 1 s stall before its 4th token. r1: its last chunk carries 2 tokens.
    r0 = _req(0, 0.0, [1.0, 1.1, 1.2, 2.2])
    r1 = _req(1, 0.5, [0.7, 0.8], [1, 2], prompt_len=20)
    r2 = RequestResult(2, 30, 5, 0.6, 0.6, error="HTTP 503: queue full")
    return RunResult([r0, r1, r2], duration=2.2, start_unix=0.0)


def test_tbt_stall_and_vllm_metrics(run):
    rep = compute_report(run, SLOs(tbt=500.0), tbt_slo_ms=500.0)
    assert (rep["completed"], rep["failed"]) == (2, 1)
    assert rep["total_input_tokens"] == 30 and rep["total_output_tokens"] == 7
    assert rep["request_throughput"] == pytest.approx(2 / 2.2)
    assert rep["output_throughput"] == pytest.approx(7 / 2.2)
    # TBT: every token gap, tokens of one chunk 0 apart: [0.1, 0.1, 1.0] + [0.1, 0.0].
    assert rep["num_tbt_gaps"] == 5
    gaps = np.array([0.0, 0.1, 0.1, 0.1, 1.0]) * 1000
    assert rep["median_tbt_ms"] == pytest.approx(100.0)
    assert rep["p90_tbt_ms"] == pytest.approx(np.percentile(gaps, 90)) == pytest.approx(640.0)
    assert rep["p99_tbt_ms"] == pytest.approx(964.0)
    assert rep["max_tbt_ms"] == pytest.approx(1000.0)
    assert rep["longest_stall"] == pytest.approx({"ms": 1000.0, "request": 0, "token": 3,
                                                  "at_s": 2.2})
    assert rep["num_tbt_gaps_over_slo"] == 1
    # vLLM's ITL is per chunk: [0.1, 0.1, 1.0] + [0.1].
    assert rep["mean_itl_ms"] == pytest.approx(325.0)
    assert rep["mean_ttft_ms"] == pytest.approx((1000.0 + 200.0) / 2)
    assert rep["median_e2el_ms"] == pytest.approx((2200.0 + 300.0) / 2)
    # TPOT = (E2E - TTFT) / (n - 1): r0 1.2/3, r1 0.1/2.
    assert rep["mean_tpot_ms"] == pytest.approx((400.0 + 50.0) / 2)
    # Goodput: only r1 has every gap <= 500 ms.
    assert rep["good_requests"] == 1
    assert rep["request_goodput"] == pytest.approx(1 / 2.2)
    assert rep["error_counts"] == {"HTTP 503: queue full": 1}
    assert rep["max_concurrent_requests"] == 2
    assert rep["token_times"][1] == [0.7, 0.8, 0.8]
    text = format_report(rep)
    assert "Serving Benchmark Result" in text and "Max TBT (longest stall) (ms):" in text


def test_goodput_slos_parse_and_combine(run):
    assert SLOs.parse(["ttft:500", "tpot:100"]) == SLOs(ttft=500.0, tpot=100.0)
    with pytest.raises(ValueError):
        SLOs.parse(["itl:5"])
    rep = compute_report(run, SLOs(ttft=1500.0, tpot=420.0))
    assert rep["good_requests"] == 2
    rep = compute_report(run, SLOs(ttft=1500.0, tpot=300.0))  # r0's TPOT is 400 ms
    assert rep["good_requests"] == 1


def test_empty_run_has_null_statistics():
    rep = compute_report(RunResult([RequestResult(0, 5, 5, 0.0, error="x")], 1.0, 0.0))
    assert rep["completed"] == 0 and rep["median_tbt_ms"] is None and rep["max_tbt_ms"] is None
    assert "n/a" in format_report(rep)


# ---- token counting from SSE chunks ------------------------------------------------------
def _chunk(text="x", finish=None, usage=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}


def test_one_chunk_per_token_and_llamacpp_closing_chunk():
    r = RequestResult(0, 5, 3, 0.0, 0.0)
    s = ResponseStream(r)
    for t, c in enumerate([_chunk(), _chunk(""), _chunk(), _chunk("", "length")]):
        s.chunk(c, float(t))
    s.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}, 4.0)
    s.finish()
    assert r.chunk_tokens == [1, 1, 1] and r.output_len == 3 and r.token_count_exact
    # The same empty closing chunk is a token when usage says one is missing.
    r = RequestResult(0, 5, 2, 0.0, 0.0)
    s = ResponseStream(r)
    s.chunk(_chunk(), 1.0)
    s.chunk(_chunk("", "length"), 2.0)
    s.chunk({"choices": [], "usage": {"completion_tokens": 2}}, 2.1)
    s.finish()
    assert r.chunk_times == [1.0, 2.0] and r.token_count_exact


def test_final_usage_on_the_closing_chunk_is_not_continuous_usage():
    # llama-server (b1-0c1e570) puts the final usage on its closing chunk, beside choices.
    r = RequestResult(0, 4, 3, 0.0, 0.0)
    s = ResponseStream(r)
    for t in range(3):
        s.chunk(_chunk(), float(t))
    s.chunk(_chunk("", "length", usage={"prompt_tokens": 4, "completion_tokens": 3}), 3.0)
    s.finish()
    assert r.chunk_times == [0.0, 1.0, 2.0] and r.chunk_tokens == [1, 1, 1]
    assert r.output_len == 3 and r.token_count_exact and r.usage_prompt_tokens == 4


def test_continuous_usage_counts_tokens_per_chunk():
    r = RequestResult(0, 5, 6, 0.0, 0.0)
    s = ResponseStream(r)
    for t, cum in [(1.0, 1), (2.0, 4), (2.5, 4), (3.0, 6)]:
        s.chunk(_chunk(usage={"completion_tokens": cum}), t)
    s.finish()
    assert r.chunk_times == [1.0, 2.0, 3.0] and r.chunk_tokens == [1, 3, 2]
    assert r.token_times == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0] and r.output_len == 6


def test_coalesced_chunks_without_usage_per_chunk_are_flagged():
    r = RequestResult(0, 5, 4, 0.0, 0.0)
    s = ResponseStream(r)
    s.chunk(_chunk("ab"), 1.0)
    s.chunk(_chunk("cd", "length"), 2.0)
    s.chunk({"choices": [], "usage": {"completion_tokens": 4}}, 2.0)
    s.finish()
    assert r.output_len == 4 and not r.token_count_exact


# ---- workloads ---------------------------------------------------------------------------
def test_poisson_mean_rate_and_seeding():
    t = np.array(arrival_times(20000, rate=5.0, seed=3))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert arrival_times(100, 5.0, seed=3) == t[:100].tolist()
    assert arrival_times(100, 5.0, seed=4) != t[:100].tolist()
    # A different rate keeps the pattern, scaled.
    np.testing.assert_allclose(arrival_times(100, 10.0, seed=3), t[:100] / 2)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_gamma_burstiness_keeps_the_mean_rate():
    gaps = np.diff(arrival_times(20000, rate=2.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(B)


def test_length_scaling_and_capping():
    assert scale_lengths(1000, 200, 0.125) == (125, 25)
    assert scale_lengths(3, 2, 0.01) == (1, 1)
    assert cap_lengths(3000, 1000, 2048) == (1536, 512)
    assert cap_lengths(100, 50, 2048) == (100, 50)
    assert cap_lengths(5000, 1, 100) == (99, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 5000), st.integers(2, 8192))
def test_capping_properties(p, d, cap):
    p2, d2 = cap_lengths(p, d, cap)
    assert p2 >= 1 and d2 >= 1 and p2 + d2 <= cap and p2 < cap
    if p + d <= cap:
        assert (p2, d2) == (p, d)
    else:
        assert p2 <= p and d2 <= d
        assert abs(p2 - p * cap / (p + d)) <= 1.0 and abs(d2 - d * cap / (p + d)) <= 1.0


def test_traces_are_shipped_and_parse():
    for name in TRACES:
        rows = load_trace(trace_path(name))
        assert len(rows) > 1000 and all(p > 0 and d > 0 for p, d in rows[:100])
    assert (trace_path("sharegpt").parent / "SOURCES.md").is_file()


def test_workload_from_trace():
    cfg = WorkloadConfig("sharegpt", num_prompts=50, request_rate=4.0, seed=7,
                         length_scale=0.25, max_model_len=512, vocab_size=1000,
                         min_token_id=100)
    specs = build_workload(cfg)
    assert len(specs) == 50
    for s in specs:
        assert s.prompt_len + s.output_len <= 512 and s.output_len >= 1
        assert len(s.prompt_token_ids) == s.prompt_len
        assert all(100 <= t < 1000 for t in s.prompt_token_ids)
    again = build_workload(cfg)
    assert [s.prompt_token_ids for s in again] == [s.prompt_token_ids for s in specs]
    salted = build_workload(cfg, token_salt=1)
    assert [(s.arrival, s.prompt_len, s.output_len) for s in salted] == \
        [(s.arrival, s.prompt_len, s.output_len) for s in specs]
    assert salted[0].prompt_token_ids != specs[0].prompt_token_ids
    # Unscaled sharegpt rows: the paper's median prompt of about 1730 tokens.
    full = build_workload(WorkloadConfig("sharegpt", num_prompts=2000, seed=0))
    assert 1500 < np.median([s.prompt_len for s in full]) < 2000


def test_random_dataset_lengths():
    cfg = WorkloadConfig("random", num_prompts=200, random_input_len=100,
                         random_output_len=20, random_range_ratio=0.5)
    specs = build_workload(cfg)
    assert all(50 <= s.prompt_len <= 150 and 10 <= s.output_len <= 30 for s in specs)
    with pytest.raises(ValueError):
        WorkloadConfig("nope")


# ---- capacity search on fake trials ------------------------------------------------------
def _fake(tbt_ms_at, delay_s_at=lambda r: 0.0, ttft_ms_at=lambda r: 100.0):
    calls = []

    def trial(rate):
        calls.append(rate)
        return {"failed": 0, "p99_tbt_ms": tbt_ms_at(rate),
                "median_sched_delay_ms": delay_s_at(rate) * 1000.0,
                "median_ttft_ms": ttft_ms_at(rate)}
    return trial, calls


@pytest.mark.parametrize("start", [0.3, 1.0, 5.0, 40.0])
def test_capacity_finds_a_tbt_threshold(start):
    trial, calls = _fake(lambda r: 50.0 + 20.0 * r)  # P99 TBT meets 150 ms up to 5 req/s
    res = search_capacity(trial, Criterion(0.150), start_rate=start, precision=0.02)
    assert res.converged
    assert 5.0 / 1.02 <= res.capacity_qps <= 5.0 < res.upper_qps <= res.capacity_qps * 1.02
    assert len(res.trials) == len(set(calls)) == len(calls)
    assert [t.rate for t in res.trials] == calls
    assert all(t.passed == (t.rate <= 5.0) for t in res.trials)
    assert res.criterion["text"].startswith("P99 TBT <= 150 ms")


def test_capacity_limited_by_scheduling_delay():
    trial, _ = _fake(lambda r: 10.0, delay_s_at=lambda r: max(0.0, r - 3.0))
    res = search_capacity(trial, Criterion(0.150), start_rate=1.0, precision=0.01)
    assert 5.0 / 1.01 <= res.capacity_qps <= 5.0
    assert "scheduling delay" in next(t.reason for t in res.trials if not t.passed)


def test_capacity_ttft_source_uses_a_low_rate_baseline():
    def trial(rate):
        return {"failed": 0, "p99_tbt_ms": 10.0, "median_ttft_ms": 300.0 + 1000.0 * rate}

    measured = []
    crit = Criterion(0.150, sched_delay_source="auto",
                     baseline=lambda: measured.append(1) or 0.3)
    res = search_capacity(trial, crit, start_rate=1.0, precision=0.01)
    assert 2.0 / 1.01 <= res.capacity_qps <= 2.0  # TTFT excess reaches 2 s at 2 req/s
    assert measured == [1]  # measured once, lazily
    assert {t.sched_delay_source for t in res.trials} == {"ttft"}
    assert res.criterion["baseline_ttft_s"] == 0.3


def test_capacity_prometheus_source_and_failures():
    def trial(rate):
        ok = rate <= 3.0
        return {"failed": 0 if rate <= 6 else 2, "p99_tbt_ms": 10.0,
                "server_queue_time": {"count": 10, "frac_le_2s": 0.9 if ok else 0.2,
                                      "median_upper_s": 0.3 if ok else 5.0}}
    res = search_capacity(trial, Criterion(0.1), start_rate=1.0, precision=0.05)
    assert 3.0 / 1.05 <= res.capacity_qps <= 3.0
    assert {t.sched_delay_source for t in res.trials} == {"prometheus"}
    res = search_capacity(trial, Criterion(0.1, sched_delay_source="response"), start_rate=1.0)
    assert res.capacity_qps == 0.0 and not res.converged


def test_capacity_bounds():
    trial, _ = _fake(lambda r: 1.0)
    res = search_capacity(trial, Criterion(0.1), start_rate=1.0, max_rate=8.0)
    assert res.capacity_qps == 8.0 and not res.converged and "max_rate" in res.note
    trial, _ = _fake(lambda r: 1e6)
    res = search_capacity(trial, Criterion(0.1), start_rate=1.0, min_rate=0.1)
    assert res.capacity_qps == 0.0 and "every rate" in res.note


def test_slos_share_cached_trials_and_one_result_heads_the_document(capsys):
    runs = []

    def run(rate):
        runs.append(rate)
        return {"failed": 0, "completed": 5, "p99_tbt_ms": 50.0 + 20.0 * rate,
                "median_sched_delay_ms": 0.0, "median_ttft_ms": 100.0, "ttfts": [0.1] * 5}

    trial = cached_trials(run)
    search = SearchConfig([0.150, 0.250], start_rate=1.0, precision=0.05)
    results = search_slos("toy", trial, search.criteria(), search)
    assert len(set(runs)) == len(runs)  # every rate ran once over both searches
    assert "ttfts" not in trial(runs[0])  # trials keep the summary only
    assert [r.capacity_qps for r in results] == pytest.approx([5.0, 10.0], rel=0.05)
    assert "[toy] capacity" in capsys.readouterr().out
    doc = new_document(WorkloadConfig(num_prompts=3), search.describe(), search.tbt_slos)
    add_system(doc, {"label": "toy", "results": [results[0].to_dict()]})
    assert headline(doc)["capacity_qps"] == results[0].capacity_qps
    assert doc["workload"]["request_rate"] is None
    assert doc["summary"][0]["sched_delay_source"] == ["response"]
    add_system(doc, {"label": "other", "results": [results[1].to_dict()]})
    assert "capacity_qps" not in headline(doc)


def test_prometheus_histogram_diff():
    def page(n_fast, n_slow):
        return "\n".join([
            "# TYPE vllm:request_queue_time_seconds histogram",
            f'vllm:request_queue_time_seconds_bucket{{le="0.3",model_name="m"}} {n_fast}',
            f'vllm:request_queue_time_seconds_bucket{{le="2.0",model_name="m"}} {n_fast}',
            f'vllm:request_queue_time_seconds_bucket{{le="5.0",model_name="m"}} {n_fast + n_slow}',
            f'vllm:request_queue_time_seconds_bucket{{le="+Inf",model_name="m"}} {n_fast + n_slow}',
            f'vllm:request_queue_time_seconds_count{{model_name="m"}} {n_fast + n_slow}',
            f'vllm:request_queue_time_seconds_sum{{model_name="m"}} {0.1 * n_fast + 3 * n_slow}',
        ])
    before, after = parse_histogram(page(4, 0)), parse_histogram(page(7, 3))
    run = after.minus(before).summary()
    assert run["count"] == 6 and run["frac_le_2s"] == 0.5
    assert run["mean_s"] == pytest.approx((0.3 + 9.0) / 6)
    assert run["median_upper_s"] == 0.3
    assert parse_histogram("other_metric 1") is None


def test_the_min_rate_floor_counts_conversations_not_turns():
    from stallfree.bench.capacity_run import with_min_rate_floor
    from stallfree.bench.config import BenchConfig, CapacityConfig, ClientConfig

    def floor(turns: int) -> float:
        bench = BenchConfig(WorkloadConfig(num_prompts=60, turns=turns),
                            ClientConfig(base_url="", max_duration=300.0))
        cfg = CapacityConfig(bench, SearchConfig([1.0], min_rate=0.01))
        return with_min_rate_floor(cfg).search.min_rate

    # 60 requests, or 10 six-turn conversations, must arrive within 200 s.
    assert floor(1) == pytest.approx(0.3)
    assert floor(6) == pytest.approx(0.05)


def test_a_server_log_dir_is_made_when_missing(tmp_path):
    from stallfree.bench.systems import ServerProcess, System

    log_dir = tmp_path / "new" / "logs"
    command = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(RuntimeError):
        ServerProcess(System("quits", command=command), startup_timeout=20, log_dir=str(log_dir))
    assert len(list(log_dir.glob("quits-*.log"))) == 1
