"""`stallfree simulate [capacity|calibrate|compare|replay]`: the bench commands against a
simulated replica.

    stallfree simulate --model mistral-7b --gpu a100 --policy sarathi --token-budget 512 \\
        --dataset sharegpt --max-model-len 8192 --request-rate 2 --num-prompts 512
    stallfree simulate capacity --tbt-slo 0.1,0.5 --system sarathi:512 --system vllm:8192 \\
        --system orca:8192:16 --system sarathi:slo --num-prompts 2048 --max-model-len 8192 \\
        --result-file cap.json
    stallfree simulate calibrate
    stallfree simulate compare measured.json simulated.json   # validation on this machine
    stallfree simulate --gpu cpu --profile-dir P --model smollm2-135m replay iterations.jsonl

Deployment and workload flags may come before or after `capacity`. The report,
JSON and capacity search are `stallfree bench`'s own code.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..bench.capacity import SLO_BUDGET, Budget, check_slo_budget, parse_budget
from ..bench.config import BenchConfig, SLOs
from ..bench.workload import WorkloadConfig
from ..config import DEFAULT_TOKEN_BUDGET, POLICIES, SchedulerConfig, setting_fields
from ..sim.calibrate import DEFAULT_TOLERANCE
from ..sim.run import Deployment, Setup, scheduler_setups
from .args import (
    add_setting_args,
    add_workload_args,
    budgets,
    flag_type,
    floats,
    pick,
    settings_from_args,
    words,
    workload_config_from_args,
)
from .bench import add_report_args, add_search_args, search_config_from_args


def parse_system(text: str) -> tuple[str, Budget | None, int | None]:
    """POLICY[:BUDGET[:MAX_SEQS]] -> (policy, budget, max seqs); None where not given. A
    BUDGET of `slo` (sarathi only) targets the TBT SLO under test."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or parts[0] not in POLICIES:
        raise ValueError(f"expected POLICY[:BUDGET[:MAX_SEQS]] with POLICY in "
                         f"{', '.join(POLICIES)}, got {text!r}")
    budget, seqs = (parts[1:] + ["", ""])[:2]
    try:
        parsed = (parse_budget(budget) if budget else None, int(seqs) if seqs else None)
    except ValueError:
        raise ValueError(f"budget must be an integer or {SLO_BUDGET!r} and max seqs an "
                         f"integer: {text!r}") from None
    check_slo_budget(parts[0], parsed[0])
    return parts[0], *parsed


def _add_common(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Flags of every simulate command; under a subcommand they only override (SUPPRESS)."""
    first = len(p._actions)
    add_setting_args(p.add_argument_group("deployment"), setting_fields(Deployment))
    s = p.add_argument_group("scheduler")
    s.add_argument("--policy", type=words, default=[SchedulerConfig.policy],
                   help="one (or, for capacity, a comma list crossed with --token-budget)")
    s.add_argument("--token-budget", "--max-num-batched-tokens", dest="token_budget",
                   type=budgets, default=[DEFAULT_TOKEN_BUDGET],
                   help="comma list; slo: sarathi with the TBT SLO under test as its target")
    s.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    s.add_argument("--system", action="append", type=flag_type(parse_system), default=[],
                   metavar="POLICY[:BUDGET[:MAX_SEQS]]",
                   help="a scheduler setup (repeatable); replaces --policy/--token-budget; "
                        "sarathi:slo targets the TBT SLO under test")
    r = p.add_argument_group("report")
    add_report_args(r)
    add_setting_args(r, pick(BenchConfig, "label"))
    r.add_argument("--max-duration", type=float, default=None,
                   help="virtual seconds; requests unfinished by then fail (as the client's)")
    r.add_argument("--result-file", default=None)
    add_workload_args(p)
    if suppress:
        for action in p._actions[first:]:
            action.default = argparse.SUPPRESS


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `simulate` (with capacity, calibrate, compare, replay) to `add_subparsers()`."""
    sim = subparsers.add_parser("simulate", help="predict bench results on simulated GPUs")
    _add_common(sim, suppress=False)
    add_setting_args(sim, pick(WorkloadConfig, "request_rate"))
    sim.add_argument("--tbt-slo", type=floats, default=None, metavar="SECONDS",
                     help="also count the TBT gaps over this (and the target of a "
                          "budget of slo)")
    add_setting_args(sim, pick(BenchConfig, "detail"))
    sub = sim.add_subparsers(dest="simulate_command")
    cap = sub.add_parser("capacity", help="the bench capacity search on the simulator")
    _add_common(cap, suppress=True)
    add_search_args(cap)
    sub.add_parser("calibrate", help="cost model vs the paper's measured Yi-34B iterations")
    cmp_ = sub.add_parser("compare", help="a measured bench report vs its simulation")
    cmp_.add_argument("measured")
    cmp_.add_argument("simulated")
    cmp_.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    rep = sub.add_parser("replay", help="a served run's iterations (serve --iteration-log) "
                         "vs the cost model, in CPU seconds")
    _add_common(rep, suppress=True)
    rep.add_argument("iteration_log")
    return sim


def _deployment(args: argparse.Namespace) -> Deployment:
    return Deployment(**settings_from_args(Deployment, args))


def _setups(args: argparse.Namespace) -> list[Setup]:
    return scheduler_setups(args.system, args.policy, args.token_budget, args.max_num_seqs,
                            args.max_model_len)


def _run(args: argparse.Namespace) -> int:
    from ..bench.report import format_report, save_json
    from ..sim.run import run_simulated_benchmark, sim_bench_config, simulation_line

    setups = _setups(args)
    if len(setups) != 1:
        raise ValueError("simulate runs one scheduler setup; use `simulate capacity` for several")
    slo = args.tbt_slo[0] if args.tbt_slo else None
    label, sched = setups[0].label, setups[0].at_slo(slo)
    dep = _deployment(args)
    cfg = sim_bench_config(workload_config_from_args(args, args.request_rate), dep,
                           args.label or label, SLOs.parse(args.goodput),
                           None if slo is None else slo * 1e3, tuple(args.metric_percentiles),
                           args.detail, args.max_duration)
    report = run_simulated_benchmark(cfg, sched, dep)
    print(format_report(report, cfg.percentiles))
    print(simulation_line(report["simulation"]))
    if args.result_file:
        save_json(args.result_file, report)
        print(f"saved {args.result_file}")
    return 0 if report["completed"] else 1


def _capacity(args: argparse.Namespace) -> int:
    from ..sim.capacity import simulate_capacity

    doc = simulate_capacity(workload_config_from_args(args), _deployment(args), _setups(args),
                            search_config_from_args(args), SLOs.parse(args.goodput),
                            tuple(args.metric_percentiles), args.max_duration, args.result_file)
    print(json.dumps(doc["summary"], indent=1))
    return 0 if doc["summary"] else 1


def _replay(args: argparse.Namespace) -> int:
    from ..sim.replay import format_replay, replay_log

    result, warning = replay_log(args.iteration_log, _deployment(args))
    if warning:
        print(f"stallfree simulate: warning: {warning}", file=sys.stderr)
    print(format_replay(result))
    if getattr(args, "result_file", None):
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from ..sim.calibrate import table

    print(table())
    return 0


def _compare(args: argparse.Namespace) -> int:
    from ..sim.calibrate import compare

    with open(args.measured) as f, open(args.simulated) as g:
        text, ok = compare(json.load(f), json.load(g), args.tolerance)
    print(text)
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """Runs the parsed `simulate` command; returns the exit status."""
    commands = {"calibrate": _calibrate, "compare": _compare, "capacity": _capacity,
                "replay": _replay, None: _run}
    try:
        return commands[args.simulate_command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"stallfree simulate: error: {err}", file=sys.stderr)
        return 2
