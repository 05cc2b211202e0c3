"""`stallfree simulate [capacity|calibrate]`: the bench commands against a simulated replica.

    stallfree simulate --model mistral-7b --gpu a100 --policy sarathi --token-budget 512 \\
        --dataset sharegpt --max-model-len 8192 --request-rate 2 --num-prompts 512
    stallfree simulate capacity --tbt-slo 0.1,0.5 --system sarathi:512 --system vllm:8192 \\
        --system orca:8192:16 --num-prompts 2048 --max-model-len 8192 --result-file cap.json
    stallfree simulate calibrate
    stallfree simulate compare measured.json simulated.json   # validation on this machine
    stallfree simulate --gpu cpu --profile-dir P --model smollm2-135m replay iterations.jsonl

Deployment and workload flags may come before or after `capacity`. The report,
JSON and capacity search are `stallfree bench`'s own code.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from ..bench.cli import _add_workload_args, _floats, _ints, _words, workload_config
from ..config import POLICIES, SchedulerConfig
from .hardware import GPUS, MODELS


def _parse_system(text: str) -> tuple[str, int | None, int | None]:
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or parts[0] not in POLICIES:
        raise argparse.ArgumentTypeError(f"expected POLICY[:BUDGET[:MAX_SEQS]] with POLICY in "
                                         f"{', '.join(POLICIES)}, got {text!r}")
    try:
        nums = [int(p) if p else None for p in parts[1:]] + [None, None]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget and max seqs must be integers: {text!r}") \
            from None
    return parts[0], nums[0], nums[1]


def _add_common(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Flags of every simulate command; under a subcommand they only override (SUPPRESS)."""
    first = len(p._actions)
    d = p.add_argument_group("deployment")
    d.add_argument("--model", default="mistral-7b",
                   help=f"{', '.join(MODELS)}, or a Hugging Face config.json")
    d.add_argument("--gpu", default="a100", choices=[*GPUS, "cpu"])
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    d.add_argument("--pp", type=int, default=1, help="pipeline stages")
    d.add_argument("--node", default=None, help="network profile (default: the GPU's pairwise one)")
    d.add_argument("--profile-dir", default=None,
                   help="profile root (default: shipped profiles; `stallfree profile` writes one)")
    d.add_argument("--roofline", action="store_true", help="ignore compute profiles")
    d.add_argument("--calibration", default="none", choices=["none", "yi34b"],
                   help="add the CPU overhead fitted to the paper's Yi-34B iterations")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--watermark", type=float, default=0.01)
    d.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    d.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV cache bytes per rank, e.g. 1GiB (default: from GPU memory)")
    d.add_argument("--cpu-slowdown", type=float, default=None,
                   help="--gpu cpu: wall seconds per CPU second of the engine (default: the "
                        "profile's host.json; 1 = a core of its own)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--policy", type=_words, default=["sarathi"], help="one (or, for capacity, "
                   "a comma list crossed with --token-budget)")
    s.add_argument("--token-budget", "--max-num-batched-tokens", dest="token_budget",
                   type=_ints, default=[512])
    s.add_argument("--max-num-seqs", type=int, default=128)
    s.add_argument("--system", action="append", type=_parse_system, default=[],
                   metavar="POLICY[:BUDGET[:MAX_SEQS]]",
                   help="a scheduler setup (repeatable); replaces --policy/--token-budget")
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS")
    r.add_argument("--metric-percentiles", type=_floats, default=[50, 90, 99])
    r.add_argument("--label", default=None)
    r.add_argument("--max-duration", type=float, default=None,
                   help="virtual seconds; requests unfinished by then fail (as the client's)")
    r.add_argument("--result-file", default=None)
    _add_workload_args(p)
    if suppress:
        for action in p._actions[first:]:
            action.default = argparse.SUPPRESS


def _size(text: str) -> int:
    from ..config import parse_size

    return parse_size(text)


def add_simulate_args(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `simulate` (with capacity and calibrate) to an `add_subparsers()` object."""
    sim = subparsers.add_parser("simulate", help="predict bench results on simulated GPUs")
    _add_common(sim, suppress=False)
    sim.add_argument("--request-rate", type=float, default=math.inf)
    sim.add_argument("--tbt-slo", type=_floats, default=None, metavar="SECONDS",
                     help="also count the TBT gaps over this")
    sim.add_argument("--no-detail", dest="detail", action="store_false")
    sub = sim.add_subparsers(dest="simulate_command")
    cap = sub.add_parser("capacity", help="the bench capacity search on the simulator")
    _add_common(cap, suppress=True)
    cap.add_argument("--tbt-slo", type=_floats, required=True, metavar="SECONDS[,SECONDS]")
    cap.add_argument("--tbt-percentile", type=float, default=99.0)
    cap.add_argument("--max-sched-delay", type=float, default=2.0, metavar="SECONDS")
    cap.add_argument("--start-rate", type=float, default=1.0)
    cap.add_argument("--precision", type=float, default=0.025)
    cap.add_argument("--min-rate", type=float, default=0.01)
    cap.add_argument("--max-rate", type=float, default=math.inf)
    cap.add_argument("--max-trials", type=int, default=20)
    sub.add_parser("calibrate", help="cost model vs the paper's measured Yi-34B iterations")
    cmp_ = sub.add_parser("compare", help="a measured bench report vs its simulation")
    cmp_.add_argument("measured")
    cmp_.add_argument("simulated")
    cmp_.add_argument("--tolerance", type=float, default=0.15)
    rep = sub.add_parser("replay", help="a served run's iterations (serve --iteration-log) "
                         "vs the cost model, in CPU seconds")
    _add_common(rep, suppress=True)
    rep.add_argument("iteration_log")
    return sim


# ---- commands ------------------------------------------------------------------------------
def _deployment(args: argparse.Namespace) -> Any:
    from .runner import Deployment

    return Deployment(args.model, args.gpu, args.tp, args.pp, args.node, args.profile_dir,
                      args.roofline, args.calibration, args.block_size, args.watermark,
                      args.gpu_memory_utilization, args.kv_cache_memory, args.cpu_slowdown)


def _systems(args: argparse.Namespace) -> list[tuple[str, SchedulerConfig]]:
    from .runner import default_max_model_len

    max_len = default_max_model_len(args.max_model_len)
    specs = args.system or [(p, b, None) for p, b in itertools.product(args.policy,
                                                                        args.token_budget)]
    out = []
    for policy, budget, seqs in specs:
        # vLLM and Orca run whole prefills: their budget defaults to max_model_len (vLLM's rule).
        budget = budget or (args.token_budget[0] if policy in ("sarathi", "chunked_only")
                            else max_len)
        cfg = SchedulerConfig(policy, budget, seqs or args.max_num_seqs, max_len)
        out.append((f"sim-{cfg.policy}-b{cfg.token_budget}-s{cfg.max_num_seqs}", cfg))
    return out


def _run(args: argparse.Namespace) -> int:
    from ..bench.metrics import SLOs, format_report
    from ..bench.runner import save_json
    from .runner import run_simulated_benchmark, sim_bench_config

    systems = _systems(args)
    if len(systems) != 1:
        raise ValueError("simulate runs one scheduler setup; use `simulate capacity` for several")
    label, sched = systems[0]
    dep = _deployment(args)
    slo = args.tbt_slo[0] if args.tbt_slo else None
    cfg = sim_bench_config(workload_config(args, args.request_rate), dep, args.label or label,
                           SLOs.parse(args.goodput), None if slo is None else slo * 1e3,
                           tuple(args.metric_percentiles), args.detail, args.max_duration)
    report = run_simulated_benchmark(cfg, sched, dep)
    print(format_report(report, cfg.percentiles))
    s = report["simulation"]
    print(f"simulated {s['iterations']} iterations in {s['wall_s']:.1f} s; {s['num_kv_blocks']} "
          f"KV blocks; {s['num_preemptions']} preemptions; stages busy "
          f"{s['stage_busy_fraction']:.0%}, idle while in flight (bubbles) "
          f"{s['pipeline_bubble_fraction']:.0%}")
    if args.result_file:
        save_json(args.result_file, report)
        print(f"saved {args.result_file}")
    return 0 if report["completed"] else 1


def _capacity(args: argparse.Namespace) -> int:
    from ..bench.capacity import Criterion, search_capacity
    from ..bench.capacity_cli import _sources
    from ..bench.metrics import SLOs
    from ..bench.runner import save_json
    from .runner import sim_bench_config

    dep = _deployment(args)
    cost = dep.cost_model()
    workload = workload_config(args)
    out: dict[str, Any] = {
        "kind": "capacity", "date": time.strftime("%Y%m%d-%H%M%S"), "simulated": True,
        "deployment": dep.describe(), "cost_model": cost.describe(),
        "workload": dataclasses.asdict(workload) | {"request_rate": None},
        "search": {"start_rate": args.start_rate, "precision": args.precision,
                   "min_rate": args.min_rate, "max_rate": args.max_rate,
                   "max_trials": args.max_trials, "max_duration_per_trial": args.max_duration},
        "tbt_slos_s": args.tbt_slo, "systems": [], "summary": [],
    }
    for label, sched in _systems(args):
        base = sim_bench_config(workload, dep, label, SLOs.parse(args.goodput), None,
                                tuple(args.metric_percentiles), False, args.max_duration)
        trial = _cached_trials(base, sched, dep, cost)  # the SLO searches share trials
        results = []
        for slo in args.tbt_slo:
            crit = Criterion(slo, args.tbt_percentile, args.max_sched_delay, "response")
            res = search_capacity(trial, crit, args.start_rate, args.precision, args.min_rate,
                                  args.max_rate, args.max_trials,
                                  on_trial=functools.partial(_print_trial, label))
            print(f"[{label}] capacity {res.capacity_qps:.4g} req/s at P99 TBT <= "
                  f"{slo * 1e3:g} ms {res.note}", flush=True)
            results.append(res.to_dict())
        out["systems"].append({"label": label, "command": None, "base_url": dep.url,
                               "scheduler": dataclasses.asdict(sched), "baseline": None,
                               "results": results})
        for res in results:
            out["summary"].append({"label": label, "tbt_slo_s": res["criterion"]["tbt_slo_s"],
                                   "capacity_qps": res["capacity_qps"],
                                   "sched_delay_source": _sources(res),
                                   "converged": res["converged"], "note": res["note"]})
        if args.result_file:
            save_json(args.result_file, _headline(out))
    print(json.dumps(out["summary"], indent=1))
    return 0 if out["summary"] else 1


def _cached_trials(base: Any, sched: SchedulerConfig, dep: Any,
                   cost: Any) -> Callable[[float], dict[str, Any]]:
    from ..bench.capacity_cli import _summary
    from .runner import run_simulated_benchmark, with_rate

    cache: dict[float, dict[str, Any]] = {}

    def trial(rate: float) -> dict[str, Any]:
        if rate not in cache:
            cache[rate] = _summary(run_simulated_benchmark(with_rate(base, rate), sched, dep,
                                                           cost))
        return cache[rate]

    return trial


def _replay(args: argparse.Namespace) -> int:
    from ..iteration_log import read_iteration_log
    from .replay import format_replay, replay

    settings, records = read_iteration_log(args.iteration_log)
    if settings.get("threads", 1) > 1 or settings.get("pipeline_depth", 1) > 1:
        print("stallfree simulate: warning: the server ran with "
              f"{settings.get('threads')} compute threads and pipeline depth "
              f"{settings.get('pipeline_depth')}; its cpu_time counts the engine thread's "
              "own work only, so the comparison holds for one thread in-process",
              file=sys.stderr)
    # The log's times are CPU seconds: predict them without the host's slowdown.
    deployment = dataclasses.replace(_deployment(args), cpu_slowdown=1.0,
                                     block_size=settings.get("block_size", args.block_size))
    result = replay(records, deployment.cost_model())
    print(format_replay(result))
    if getattr(args, "result_file", None):
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print_trial(label: str, trial: Any) -> None:
    from ..bench.capacity_cli import _trial_line

    print(_trial_line(label, trial), flush=True)


def _headline(out: dict[str, Any]) -> dict[str, Any]:
    """`capacity_qps` at the top when there is one result, as `bench capacity` writes it."""
    if len(out["summary"]) == 1:
        return out | {"capacity_qps": out["summary"][0]["capacity_qps"],
                      "criterion": out["systems"][0]["results"][0]["criterion"]}
    return out


def run_simulate(args: argparse.Namespace) -> int:
    """Runs the parsed `simulate` command; returns the exit status."""
    try:
        if args.simulate_command == "calibrate":
            from .calibrate import table

            print(table())
            return 0
        if args.simulate_command == "compare":
            from .calibrate import compare

            with open(args.measured) as f, open(args.simulated) as g:
                text, ok = compare(json.load(f), json.load(g), args.tolerance)
            print(text)
            return 0 if ok else 1
        if args.simulate_command == "capacity":
            return _capacity(args)
        if args.simulate_command == "replay":
            return _replay(args)
        return _run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"stallfree simulate: error: {err}", file=sys.stderr)
        return 2
