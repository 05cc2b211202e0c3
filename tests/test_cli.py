"""The command line, run as a user would."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stallfree import huge_pages


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
        # The default dtype is auto: the machine's choice, and why, are reported.
        assert row["dtype"] in ("float32", "bfloat16") and row["dtype_reason"].startswith("auto")
        # So is whether torch's big buffers got huge pages (the CLI imports stallfree first).
        on = huge_pages.thp_mode() in ("always", "madvise")
        assert row["huge_pages"].startswith("on" if on else "off"), row["huge_pages"]


def test_bad_flag_value_is_a_clear_error():
    proc = _run("generate", "--temperature", "-1", "hi")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_under_the_vllm_policy():
    proc = _run("generate", "--json", "--policy", "vllm", "--max-tokens", "4", "--ignore-eos",
                "Water boils at")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 4


# ---- flags made from config fields (no subprocess, no model) -----------------------------
def test_setting_flags_take_type_and_switches_from_the_field():
    import argparse
    from dataclasses import dataclass

    from stallfree.cli.args import add_setting_args, settings_from_args
    from stallfree.config import option, setting_fields

    @dataclass
    class Toy:
        limit: int | None = option(None, "an optional integer")
        ratio: float = option(0.5, "50% by default")
        fast: bool = option(False, "a switch that turns it on")
        checked: bool = option(True, "a switch that turns it off", flags=("--no-checked",))
        name: str = option("a", "one of two", choices=("a", "b"))

    parser = argparse.ArgumentParser()
    add_setting_args(parser, setting_fields(Toy))
    assert settings_from_args(Toy, parser.parse_args([])) == {
        "limit": None, "ratio": 0.5, "fast": False, "checked": True, "name": "a"}
    args = parser.parse_args(["--limit", "7", "--fast", "--no-checked", "--name", "b"])
    assert Toy(**settings_from_args(Toy, args)) == Toy(7, 0.5, True, False, "b")


def test_command_defaults_are_the_config_defaults():
    from stallfree.bench.capacity import SearchConfig
    from stallfree.bench.workload import WorkloadConfig
    from stallfree.cli import build_parser
    from stallfree.cli.args import engine_config_from_args, settings_from_args
    from stallfree.config import EngineConfig
    from stallfree.sim.run import Deployment

    parser = build_parser()
    gen = parser.parse_args(["generate", "hi"])
    assert engine_config_from_args(gen) == EngineConfig()
    sim = parser.parse_args(["simulate"])
    assert Deployment(**settings_from_args(Deployment, sim)) == Deployment()
    assert WorkloadConfig(**settings_from_args(WorkloadConfig, sim)) == WorkloadConfig()
    cap = parser.parse_args(["bench", "capacity", "--tbt-slo", "0.1,0.5"])
    assert SearchConfig([0.1, 0.5], **settings_from_args(SearchConfig, cap)) == \
        SearchConfig([0.1, 0.5])
    assert parser.parse_args(["generate", "--max-model-len", "100", "hi"]).max_model_len == 100


def test_a_bad_list_flag_is_a_usage_error(capsys):
    import pytest

    from stallfree.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--token-budget", "512,lots"])
    assert exc.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def _prefix_caching(argv: list[str]) -> bool:
    """enable_prefix_caching as `stallfree ARGV` parses it: serve's engine config, or the
    simulated deployment."""
    from stallfree.cli import build_parser
    from stallfree.cli.args import engine_config_from_args, settings_from_args
    from stallfree.sim.run import Deployment

    args = build_parser().parse_args(argv)
    if argv[0] == "serve":
        return engine_config_from_args(args).cache.enable_prefix_caching
    return Deployment(**settings_from_args(Deployment, args)).enable_prefix_caching


CAPACITY = ["capacity", "--tbt-slo", "1"]


# simulate's deployment flags go before or after its subcommand (capacity).
@pytest.mark.parametrize("before,after", [
    (["serve"], []), (["simulate"], []), (["simulate"], CAPACITY), (["simulate", *CAPACITY], [])],
    ids=["serve", "simulate", "simulate-flag-capacity", "simulate-capacity-flag"])
def test_prefix_caching_is_on_by_default_and_the_no_flag_turns_it_off(before, after):
    assert _prefix_caching(before + after) is True
    assert _prefix_caching(before + ["--no-enable-prefix-caching"] + after) is False
    assert _prefix_caching(before + ["--enable-prefix-caching"] + after) is True
