"""`simulate` and `simulate capacity` write the bench's own report and capacity JSON."""
from __future__ import annotations

import functools
import json

import pytest

from stallfree.bench.capacity import SLO_BUDGET, Criterion, search_capacity
from stallfree.bench.config import BenchConfig, with_rate
from stallfree.bench.records import RequestResult, RunResult
from stallfree.bench.report import compute_report, report_header
from stallfree.bench.workload import RequestSpec, WorkloadConfig
from stallfree.cli import main
from stallfree.cli.simulate import parse_system
from stallfree.config import SchedulerConfig
from stallfree.sim.cost_model import ConstantCostModel
from stallfree.sim.run import (
    Deployment,
    run_simulated_benchmark,
    scheduler_setups,
    sim_bench_config,
)

SMALL = ["--dataset", "random", "--random-input-len", "600", "--random-output-len", "40",
         "--random-range-ratio", "0.5", "--num-prompts", "30"]


def bench_keys() -> set[str]:
    """Every key `bench serve` writes (header plus report) for a one-request run."""
    r = RequestResult(0, 5, 2, 0.0, 0.0, [0.1, 0.2], [1, 1], 2, success=True,
                      scheduling_delay=0.01)
    spec = RequestSpec(0, 0.0, 5, 2, [1] * 5)
    cfg = sim_bench_config(WorkloadConfig(dataset="random"), Deployment())
    return set(report_header(cfg, [spec], 0.0)) | set(
        compute_report(RunResult([r], 0.2, 0.0), tbt_slo_ms=100.0))


def test_simulate_writes_the_bench_report(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["simulate", "--model", "mistral-7b", "--gpu", "a100", "--policy", "sarathi",
                 "--token-budget", "512", "--request-rate", "2", "--tbt-slo", "0.1",
                 "--result-file", str(out), *SMALL]) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Time Between Tokens" in text
    rep = json.loads(out.read_text())
    assert bench_keys() <= set(rep)
    assert rep["backend"] == "simulator" and rep["completed"] == 30 and rep["failed"] == 0
    assert rep["sched_delay_source"] == "response" and rep["p99_tbt_ms"] < 100
    assert rep["simulation"]["iterations"] > 0
    assert len(rep["token_times"]) == 30


def test_capacity_command_writes_capacity_json(tmp_path):
    out = tmp_path / "cap.json"
    # Flags before and after the subcommand both count.
    # 60 prompts of ~2000 tokens take ~10 s to prefill at budget 256: queues build up.
    assert main(["simulate", "--model", "mistral-7b", "capacity", "--tbt-slo", "0.05",
                 "--system", "sarathi:256", "--start-rate", "2", "--precision", "0.2",
                 "--max-trials", "12", "--result-file", str(out), "--dataset", "random",
                 "--random-input-len", "2000", "--random-output-len", "20",
                 "--num-prompts", "60"]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "capacity" and res["capacity_qps"] > 0
    (system,) = res["systems"]
    assert system["label"] == "sim-sarathi-b256-s128"
    assert system["results"][0]["converged"]
    assert res["deployment"]["model"] == "mistral-7b"


def test_bad_setups_are_errors(capsys):
    assert main(["simulate", "--policy", "sarathi,vllm", *SMALL]) == 2
    assert main(["simulate", "--model", "llama-2-70b", *SMALL]) == 2  # one A100 is too small
    assert "does not fit" in capsys.readouterr().err


def test_calibrate_prints_the_table(capsys):
    assert main(["simulate", "calibrate"]) == 0
    assert "| fig2 decode x128 |" in capsys.readouterr().out


def _trial(base: BenchConfig, sched: SchedulerConfig, dep: Deployment, cost: ConstantCostModel,
           rate: float) -> dict:
    return run_simulated_benchmark(with_rate(base, rate), sched, dep, cost)


def test_capacity_search_on_the_simulator_separates_policies():
    # A prefill-heavy constant model: a whole 1200-token prefill costs 1.2 s, a decode
    # iteration 0.03 s. Under a 0.25 s TBT SLO, vLLM's stalls cap its capacity far below
    # Sarathi's chunked, stall-free iterations.
    cost = ConstantCostModel(base=0.02, per_token=0.001)
    dep = Deployment(kv_cache_memory=8 << 30)  # 64k tokens of Mistral KV: no preemption
    workload = WorkloadConfig(dataset="random", num_prompts=40, random_input_len=1200,
                              random_output_len=60, random_range_ratio=0.3)
    caps = {}
    for policy, budget in (("sarathi", 200), ("vllm", 4096)):
        sched = SchedulerConfig(policy, budget, 64, 4096)
        base: BenchConfig = sim_bench_config(workload, dep, detail=False)
        trial = functools.partial(_trial, base, sched, dep, cost)
        res = search_capacity(trial, Criterion(0.25, sched_delay_source="response"),
                              start_rate=0.5, precision=0.15)
        assert res.converged
        caps[policy] = res.capacity_qps
        for t in res.trials:  # the verdicts agree with the SLO
            assert t.passed == (t.tbt_s <= 0.25 and t.sched_delay_s <= 2.0)
    assert caps["sarathi"] > 1.5 * caps["vllm"] > 0


def test_deployment_kv_blocks_and_cost_model():
    dep = Deployment("yi-34b", "a100", tp=2)
    sched = SchedulerConfig("sarathi", 512, 128, 8192)
    assert 15_000 < dep.num_blocks(sched) < 25_000
    assert dep.url == "sim://yi-34b/a100/tp2-pp1"
    cal = Deployment("yi-34b", "a100", tp=2, calibration="yi34b").cost_model()
    assert cal.extra_cpu[1] > 0
    with pytest.raises(ValueError):
        Deployment(calibration="bogus")


def test_compare_reports(tmp_path, capsys):
    real = {"median_tbt_ms": 100.0, "p99_tbt_ms": 200.0, "median_ttft_ms": 50.0}
    (tmp_path / "real.json").write_text(json.dumps(real))
    (tmp_path / "sim.json").write_text(json.dumps({k: v * 1.1 for k, v in real.items()}))
    (tmp_path / "off.json").write_text(json.dumps({k: v * 1.3 for k, v in real.items()}))
    assert main(["simulate", "compare", str(tmp_path / "real.json"),
                 str(tmp_path / "sim.json")]) == 0
    assert "+10.0%" in capsys.readouterr().out
    assert main(["simulate", "compare", str(tmp_path / "real.json"),
                 str(tmp_path / "off.json")]) == 1


def test_validation_errors_have_none_where_no_error_can_be_computed():
    from stallfree.sim.calibrate import validation_errors

    rows = validation_errors({"median_tbt_ms": 10.0, "p99_tbt_ms": 0.0, "median_ttft_ms": 4.0},
                             {"median_tbt_ms": 12.0, "p99_tbt_ms": 3.0})
    assert [(name, err) for name, _, _, err in rows] == [
        ("median TBT", pytest.approx(0.2)), ("P99 TBT", None), ("median TTFT", None)]


def test_parse_system_takes_a_budget_of_slo():
    assert parse_system("sarathi:slo") == ("sarathi", SLO_BUDGET, None)
    assert parse_system("sarathi:slo:64") == ("sarathi", SLO_BUDGET, 64)
    assert parse_system("vllm::16") == ("vllm", None, 16)
    for bad in ("vllm:slo", "sarathi:fast", "sarathi:512:x"):
        with pytest.raises(ValueError):
            parse_system(bad)
    by_system = scheduler_setups([("sarathi", SLO_BUDGET, None)], [], [], 128, None)
    (crossed,) = scheduler_setups([], ["sarathi"], [SLO_BUDGET], 128, None)
    assert by_system == [crossed] and crossed.label == "sim-sarathi-slo-s128"
    assert crossed.targets_slo and crossed.scheduler.tbt_slo is None
    assert crossed.at_slo(0.2).tbt_slo == 0.2 and crossed.at_slo(0.2).token_budget == 8192


def test_an_slo_system_is_searched_once_per_slo_with_it_as_target(tmp_path):
    out = tmp_path / "cap.json"
    assert main(["simulate", "--model", "mistral-7b", "capacity", "--tbt-slo", "0.05,0.2",
                 "--system", "sarathi:slo", "--system", "sarathi:256", "--start-rate", "2",
                 "--precision", "0.2", "--max-trials", "12", "--result-file", str(out),
                 "--dataset", "random", "--random-input-len", "2000",
                 "--random-output-len", "20", "--num-prompts", "60"]) == 0
    res = json.loads(out.read_text())
    entries = [(s["label"], s["tbt_slo_target_s"], s["scheduler"]["tbt_slo"],
                [r["criterion"]["tbt_slo_s"] for r in s["results"]]) for s in res["systems"]]
    assert entries == [("sim-sarathi-slo-s128", 0.05, 0.05, [0.05]),
                       ("sim-sarathi-slo-s128", 0.2, 0.2, [0.2]),
                       ("sim-sarathi-b256-s128", None, None, [0.05, 0.2])]
    caps = {(s["label"], s["tbt_slo_s"]): s["capacity_qps"] for s in res["summary"]}
    assert len(caps) == 4 and all(c > 0 for c in caps.values())
    for s in res["systems"][:2]:  # each trial ran the SLO scheduler under its own target
        assert all(t["metrics"]["simulation"]["scheduler"]["tbt_slo"] == s["tbt_slo_target_s"]
                   for t in s["results"][0]["trials"])


def test_one_run_of_an_slo_system_targets_its_tbt_slo(tmp_path, capsys):
    out = tmp_path / "run.json"
    run = ["simulate", "--system", "sarathi:slo", "--request-rate", "2", *SMALL]
    assert main([*run, "--tbt-slo", "0.1", "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["simulation"]["scheduler"]["tbt_slo"] == 0.1
    assert main(run) == 2
    assert "give --tbt-slo" in capsys.readouterr().err
