"""`bench serve`, `bench capacity` and `bench plot` end to end over HTTP, on a fake engine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from server_utils import FakeEngine, ThreadServer
from stallfree.bench import capacity_run
from stallfree.bench.capacity import SLO_BUDGET
from stallfree.bench.systems import build_systems
from stallfree.cli import main as cli_main
from stallfree.server.api import build_app


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine(step_delay=0.002)
    engine.max_model_len = 4096
    engine.model_config.vocab_size = 50000
    server = ThreadServer(build_app(engine, "fake"))
    yield server
    server.stop()


COMMON = ["--dataset", "sharegpt", "--length-scale", "0.01", "--max-model-len", "256",
          "--disable-tqdm"]


def test_serve_writes_a_complete_report(fake_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = cli_main(["bench", "serve", "--base-url", fake_server.url, "--model", "fake",
                   "--num-prompts", "5", "--request-rate", "50", "--tbt-slo", "0.5",
                   "--goodput", "tbt:500", "--label", "fake", "--result-file", str(out),
                   *COMMON])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["completed"] == 5 and rep["failed"] == 0
    assert rep["output_lens"] == [len(t) for t in rep["token_times"]]
    assert rep["output_len_mismatch_requests"] == 0 and rep["token_count_inexact_requests"] == 0
    assert rep["server_queue_time"]["count"] == 5  # read from the fake server's /metrics
    for key in ("duration", "request_throughput", "output_throughput", "mean_ttft_ms",
                "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms", "p99_tbt_ms", "max_tbt_ms",
                "longest_stall_ms", "request_goodput", "ttfts", "itls", "input_lens"):
        assert rep[key] is not None, key


def test_failed_requests_are_counted(fake_server, tmp_path):
    out = tmp_path / "bad.json"
    rc = cli_main(["bench", "serve", "--base-url", fake_server.url, "--model", "no-such-model",
               "--num-prompts", "2", "--result-file", str(out), *COMMON])
    rep = json.loads(out.read_text())
    assert rc == 1 and rep["failed"] == 2 and rep["completed"] == 0
    assert any("404" in e for e in rep["error_counts"])


def test_capacity_and_plots(fake_server, tmp_path):
    out = tmp_path / "cap.json"
    rc = cli_main(["bench", "capacity", "--base-url", fake_server.url, "--system-label", "fake",
               "--tbt-slo", "0.5,1.0", "--num-prompts", "3", "--start-rate", "20",
               "--max-trials", "2", "--warmup-prompts", "1", "--result-file", str(out),
               "--trial-detail-dir", str(tmp_path / "trials"), *COMMON])
    assert rc == 0
    cap = json.loads(out.read_text())
    assert cap["kind"] == "capacity" and len(cap["summary"]) == 2
    fake = cap["systems"][0]
    assert fake["label"] == "fake"
    for res in fake["results"]:
        assert res["capacity_qps"] >= 20.0  # a fake engine at 2 ms per step never stalls
        assert res["trials"] and all(t["passed"] for t in res["trials"])
        # Our server reports the scheduling delay per request.
        assert res["trials"][0]["sched_delay_source"] == "response"
        assert "P99 TBT <=" in res["criterion"]["text"]
    trials = sorted((tmp_path / "trials").iterdir())
    assert trials
    pngs = tmp_path / "png"
    assert cli_main(["bench", "plot", str(out), str(trials[0]), "--out-dir", str(pngs)]) == 0
    names = {p.name for p in pngs.iterdir()}
    assert {"tbt_cdf.png", "vs_rate.png", "capacity.png"} <= names
    assert any(n.startswith("timeline_") for n in names)


class StartedCommands:
    """In place of `ServerProcess`: records each command and points at the fake server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.commands: list[list[str]] = []

    def __call__(self, system, startup_timeout, log_dir):
        self.commands.append(system.command)
        return SimpleNamespace(base_url=self.url, log_path="server.log",
                               proc=SimpleNamespace(pid=0), stop=lambda: None)


def test_slo_budget_is_our_server_with_the_slo_under_test():
    fixed, slo = build_systems([], [], [], ["sarathi"], [64, SLO_BUDGET])
    assert (fixed.label, slo.label) == ("stallfree-sarathi-64", "stallfree-sarathi-slo")
    assert not fixed.targets_slo and fixed.at_slo(0.5) is fixed
    assert slo.targets_slo and "--token-budget" not in slo.command
    cmd = slo.at_slo(0.25).command
    assert cmd[cmd.index("--tbt-slo") + 1] == "0.25"
    with pytest.raises(ValueError, match="sarathi"):
        build_systems([], [], [], ["vllm"], [SLO_BUDGET])


def test_capacity_starts_an_slo_system_once_per_slo(fake_server, tmp_path, monkeypatch):
    started = StartedCommands(fake_server.url)
    monkeypatch.setattr(capacity_run, "ServerProcess", started)
    out = tmp_path / "cap.json"
    rc = cli_main(["bench", "capacity", "--policy", "sarathi", "--token-budget", "64,slo",
                   "--server-cmd", "peer --port {port} --slo {tbt_slo}", "--system-label",
                   "peer", "--tbt-slo", "0.5,1.0", "--num-prompts", "2", "--start-rate", "20",
                   "--max-trials", "1", "--warmup-prompts", "0", "--result-file", str(out),
                   *COMMON])
    assert rc == 0
    slos = [c[c.index(flag) + 1] for c in started.commands
            for flag in ("--tbt-slo", "--slo") if flag in c]
    assert slos == ["0.5", "1.0", "0.5", "1.0"]  # the peer, then our server, once per SLO
    cap = json.loads(out.read_text())
    entries = [(s["label"], s["tbt_slo_target_s"], [r["criterion"]["tbt_slo_s"]
                                                    for r in s["results"]])
               for s in cap["systems"]]
    assert entries == [("peer", 0.5, [0.5]), ("peer", 1.0, [1.0]),
                       ("stallfree-sarathi-64", None, [0.5, 1.0]),
                       ("stallfree-sarathi-slo", 0.5, [0.5]),
                       ("stallfree-sarathi-slo", 1.0, [1.0])]
    assert len(cap["summary"]) == 6 and all(s["capacity_qps"] >= 20 for s in cap["summary"])
    pngs = tmp_path / "png"  # a line per target on the rate plot
    assert cli_main(["bench", "plot", str(out), "--out-dir", str(pngs)]) == 0
    assert {"vs_rate.png", "capacity.png"} <= {p.name for p in pngs.iterdir()}


def test_plot_of_an_iteration_log_under_a_tbt_slo(tmp_path):
    from stallfree.bench.plot import plot_budget
    from stallfree.iteration_log import IterationLog
    from stallfree.outputs import IterationRecord

    def write(path, budgets):
        log = IterationLog(path)
        log.header(block_size=16, threads=1, pipeline_depth=1, tbt_slo=0.2, tbt_slo_margin=0.8)
        for i, budget in enumerate(budgets):
            log.write(IterationRecord(start=i * 0.1, end=i * 0.1 + 0.05, num_prefill_tokens=0,
                                      num_decode_tokens=2, num_seqs=2, num_preempted=0,
                                      decode_contexts=(5, 9), num_sampled=2,
                                      token_budget=budget,
                                      predicted_time=None if budget is None else 0.04,
                                      target_time=None if budget is None else 0.16 - i / 100))
        log.close()

    write(tmp_path / "slo.jsonl", [64, 80, 96])
    pngs = tmp_path / "png"
    assert cli_main(["bench", "plot", str(tmp_path / "slo.jsonl"), "--out-dir", str(pngs)]) == 0
    assert (pngs / "budget_slo.png").stat().st_size > 0
    write(tmp_path / "fixed.jsonl", [None, None])
    with pytest.raises(ValueError, match="no iteration has a token budget"):
        plot_budget(str(tmp_path / "fixed.jsonl"), str(pngs / "x.png"))


def test_capacity_bar_labels_say_which_bound_a_search_found():
    from stallfree.bench.plot import capacity_label

    assert capacity_label({"capacity_qps": 0.5063, "upper_qps": 0.5906}) == "0.51"
    assert capacity_label({"capacity_qps": 2.0, "upper_qps": None}) == ">=2.00"  # never failed
    assert capacity_label({"capacity_qps": 0.0, "upper_qps": 0.1875}) == "<0.19"  # never passed
