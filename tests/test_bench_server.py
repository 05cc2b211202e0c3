"""The benchmark against our real server on the default model (a few short requests)."""
from __future__ import annotations

import json
import os

import pytest

from server_utils import ServerProcess
from stallfree.cli import main as cli_main
from stallfree.iteration_log import read_iteration_log

SHORT = ["--dataset", "sharegpt", "--length-scale", "0.05", "--max-model-len", "512",
         "--disable-tqdm"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("iterations") / "iterations.jsonl"
    proc = ServerProcess("--max-model-len", "512", "--iteration-log", str(log))
    proc.iteration_log = log
    yield proc
    proc.stop()


def test_serve_against_our_server(server, tmp_path):
    out = tmp_path / "serve.json"
    rc = cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                   "--request-rate", "4", "--tbt-slo", "1.0", "--goodput", "ttft:60000",
                   "--label", "stallfree", "--result-file", str(out), *SHORT])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 4 and rep["failed"] == 0 and rep["error_counts"] == {}
    # ignore_eos: every request generated exactly its (scaled) trace length, one token per chunk.
    assert rep["output_len_mismatch_requests"] == 0 and rep["token_count_inexact_requests"] == 0
    assert rep["output_lens"] == [len(t) for t in rep["token_times"]]
    assert sum(rep["output_lens"]) == rep["total_output_tokens"] > 4
    assert all(p + o <= 512 for p, o in zip(rep["input_lens"], rep["output_lens"]))
    assert rep["num_tbt_gaps"] == rep["total_output_tokens"] - 4
    assert rep["server_queue_time"]["count"] == 4
    for key in ("duration", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "p99_e2el_ms", "p50_tbt_ms", "p90_tbt_ms", "p99_tbt_ms",
                "max_tbt_ms", "longest_stall_ms", "longest_stall"):
        assert rep[key] is not None, key
    # The server logged every iteration of this run, and each one's batch adds up.
    settings, records = read_iteration_log(server.iteration_log)
    assert settings["block_size"] == 16 and settings["pipeline_depth"] == 1
    assert sum(r.num_sampled for r in records) == rep["total_output_tokens"]
    assert sum(r.num_prefill_tokens for r in records) == sum(rep["input_lens"])
    for r in records:  # the reader checked that each record's chunks add up
        assert 0 < r.cpu_time and r.start < r.end


def test_capacity_starts_and_stops_our_server(tmp_path):
    out = tmp_path / "cap.json"
    rc = cli_main(["bench", "capacity", "--policy", "sarathi", "--token-budget", "64",
                   "--tbt-slo", "5", "--num-prompts", "2", "--start-rate", "2", "--max-trials", "1",
                   "--warmup-prompts", "0", "--startup-timeout", "240", "--log-dir", str(tmp_path),
                   "--result-file", str(out), *SHORT])
    assert rc == 0
    cap = json.loads(out.read_text())
    entry = cap["systems"][0]
    assert entry["label"] == "stallfree-sarathi-64" and "error" not in entry
    assert "--policy" in entry["command"] and "--max-model-len" in entry["command"]
    assert cap["capacity_qps"] == 2.0 and cap["criterion"]["tbt_slo_s"] == 5.0
    (trial,) = entry["results"][0]["trials"]
    assert trial["passed"] and trial["metrics"]["completed"] == 2
    assert trial["sched_delay_source"] == "response"  # our server reports it per request
    with pytest.raises(ProcessLookupError):  # stopped by its PID
        os.kill(entry["pid"], 0)
