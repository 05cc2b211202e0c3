"""The command line, run as a user would."""
from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stallfree", *args], capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})


def test_generate_json_lines():
    proc = _run("generate", "--json", "--max-tokens", "6", "--ignore-eos", "--token-budget", "32",
                "The capital of France is", "def add(a, b):")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "def add(a, b):"]
    for row in rows:
        assert {"text", "token_ids", "finish_reason", "ttft", "tbt"} <= row.keys()
        assert len(row["token_ids"]) == 6 and len(row["tbt"]) == 5 and row["ttft"] > 0


def test_bad_flag_value_is_a_clear_error():
    proc = _run("generate", "--temperature", "-1", "hi")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_under_the_vllm_policy():
    proc = _run("generate", "--json", "--policy", "vllm", "--max-tokens", "4", "--ignore-eos",
                "Water boils at")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4
