"""benchmarks/soak.py at 500 requests (the default is 10,000; docs/reliability.md):
servers on loopback, on a small random-weight model so the run stays short (the
default model is served end to end in test_server.py)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "soak.py"
POLICIES = ["sarathi", "vllm", "request_level"]


def test_soak_500_requests_loses_nothing(tiny_model, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    soak = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "soak", soak)  # its dataclasses look themselves up
    spec.loader.exec_module(soak)
    report_path = tmp_path / "soak.json"
    code = soak.main(["--requests", "500", "--model", tiny_model, "--policy", *POLICIES,
                      "--time-limit", "900", "--json", str(report_path),
                      "--server-arg=--kv-cache-memory=64MiB",
                      # ~170 requests per policy end inside the native heap's warm-up (it
                      # grew 100-150 MiB over a server's first ~600 requests, then stayed
                      # flat): the leak bound of 64 MiB belongs to the long soak.
                      "--rss-growth-mib", "256"])
    report = json.loads(report_path.read_text())
    assert code == 0 and report["ok"], json.dumps(report, indent=1)[:4000]
    runs = report["policies"]
    assert [r["policy"] for r in runs] == POLICIES
    assert sum(r["requests"] for r in runs) == 500
    for run in runs:
        statuses = {int(k): v for k, v in run["statuses"].items()}
        assert not any(code >= 500 for code in statuses), statuses
        # Every part of the mix really ran: kept, abandoned and bad requests.
        assert run["completed"] > 0 and run["disconnected"] > 0 and run["bad_refused"] > 0
        assert run["completed"] + run["disconnected"] + run["bad_refused"] == run["requests"]
        # Every request has a status but those given up on before any answer, and the
        # server's counters were reconciled with the clients' (soak.reconcile).
        assert sum(statuses.values()) == run["requests"] - run["timed_out"]
        assert run["server"]["sequences"] >= run["answered_choices"] > 0
        assert run["server"]["aborted"] > 0
    assert len(set().union(*(r["bad_kinds"] for r in runs))) >= 20
