"""`stallfree bench {serve,capacity,plot}`.

Flag names follow `vllm bench serve` where the meaning is the same. Building
the parser imports nothing heavy; each command imports what it needs.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from typing import Any

from ..bench.capacity import SearchConfig
from ..bench.config import PERCENTILES, BenchConfig, CapacityConfig, ClientConfig, SLOs
from ..bench.workload import WorkloadConfig
from ..config import DEFAULT_TOKEN_BUDGET
from .args import (
    add_setting_args,
    add_workload_args,
    budgets,
    floats,
    ints,
    pick,
    settings_from_args,
    words,
    workload_config_from_args,
)


def add_client_args(p: argparse.ArgumentParser) -> None:
    """How requests are sent, and what the report holds."""
    g = p.add_argument_group("client")
    add_setting_args(g, pick(ClientConfig, "model", "endpoint", "api_key", "max_concurrency",
                             "max_duration", "request_timeout", "ignore_eos"))
    g.add_argument("--ban-token-ids", type=ints, default=[],
                   help="logit_bias -100 on these ids, e.g. EOS for llama.cpp (0,2 for SmolLM2)")
    add_setting_args(g, pick(ClientConfig, "continuous_usage"))
    g.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    add_report_args(g)
    add_setting_args(g, pick(BenchConfig, "scrape_metrics"))
    g.add_argument("--disable-tqdm", action="store_true")
    add_setting_args(g, pick(BenchConfig, "label"))


def add_report_args(g: Any) -> None:
    """What the report computes besides its fixed metrics (`bench`, `simulate`)."""
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput: ttft, tpot, e2el (vLLM's) and tbt, in ms")
    g.add_argument("--metric-percentiles", type=floats, default=list(PERCENTILES))


def add_search_args(p: argparse.ArgumentParser) -> None:
    """The capacity search's SLOs and settings (`bench capacity`, `simulate capacity`)."""
    p.add_argument("--tbt-slo", type=floats, required=True, metavar="SECONDS[,SECONDS]",
                   help="P99 TBT SLO(s); several reuse the same trials")
    add_setting_args(p, pick(SearchConfig, "tbt_percentile", "max_sched_delay", "start_rate",
                             "precision", "min_rate", "max_rate", "max_trials"))


def search_config_from_args(args: argparse.Namespace) -> SearchConfig:
    return SearchConfig(args.tbt_slo, **settings_from_args(SearchConfig, args))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` (with serve, capacity, plot) to an `add_subparsers()` object."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="one run at one request rate; prints and saves a report")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_setting_args(serve, pick(WorkloadConfig, "request_rate"))
    serve.add_argument("--tbt-slo", type=float, default=None, metavar="SECONDS",
                       help="also count the TBT gaps over this")
    add_setting_args(serve, pick(BenchConfig, "detail"))
    serve.add_argument("--result-file", default=None)
    add_workload_args(serve)
    add_client_args(serve)

    cap = sub.add_parser("capacity", help="search the highest rate meeting a TBT SLO")
    add_search_args(cap)
    add_setting_args(cap, pick(CapacityConfig, "sched_delay_source", "baseline_prompts",
                               "allow_failures", "warmup_prompts"))
    sys_ = cap.add_argument_group("systems (one or more)")
    sys_.add_argument("--base-url", action="append", default=[],
                      help="a server already running (repeatable)")
    sys_.add_argument("--server-cmd", action="append", default=[],
                      help="start this server command, with {port} (repeatable); one "
                           "holding {tbt_slo} is started once per SLO, with that SLO")
    sys_.add_argument("--system-label", action="append", default=[],
                      help="labels for --base-url then --server-cmd, in order")
    sys_.add_argument("--policy", type=words, default=[],
                      help="start our server with each policy, e.g. sarathi,vllm,orca")
    sys_.add_argument("--token-budget", type=budgets, default=[DEFAULT_TOKEN_BUDGET],
                      help="comma list; slo: sarathi with the SLO under test as its "
                           "--tbt-slo (searched once per SLO)")
    sys_.add_argument("--server-model", default=None, help="model for our server (default one)")
    sys_.add_argument("--server-args", default="", help="extra flags for our server")
    add_setting_args(sys_, pick(CapacityConfig, "startup_timeout", "log_dir"))
    add_setting_args(cap, pick(CapacityConfig, "trial_detail_dir"))
    cap.add_argument("--result-file", default=None)
    add_workload_args(cap)
    add_client_args(cap)

    plot = sub.add_parser("plot", help="PNG plots from serve reports and capacity results")
    plot.add_argument("files", nargs="+")
    plot.add_argument("--out-dir", default=".")
    plot.add_argument("--tbt-slo", type=float, default=None, metavar="SECONDS",
                      help="SLO line and stall threshold (default: from the files)")
    return bench


def bench_config_from_args(args: argparse.Namespace, base_url: str, rate: float = math.inf,
                           tbt_slo: float | None = None, detail: bool = True) -> BenchConfig:
    client = ClientConfig(base_url=base_url, **settings_from_args(ClientConfig, args),
                          ban_token_ids=args.ban_token_ids, extra_body=args.extra_body,
                          progress=not args.disable_tqdm)
    return BenchConfig(workload_config_from_args(args, rate), client, SLOs.parse(args.goodput),
                       None if tbt_slo is None else tbt_slo * 1000.0,
                       tuple(args.metric_percentiles), args.scrape_metrics, detail, args.label)


def _serve(args: argparse.Namespace) -> int:
    from ..bench.report import format_report, save_json
    from ..bench.run import run_benchmark

    cfg = bench_config_from_args(args, args.base_url, args.request_rate, args.tbt_slo,
                                 args.detail)
    report = run_benchmark(cfg)
    print(format_report(report, cfg.percentiles))
    if args.result_file:
        save_json(args.result_file, report)
        print(f"saved {args.result_file}")
    return 0 if report["completed"] else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _capacity(args: argparse.Namespace) -> int:
    from ..bench.capacity_run import run_capacity
    from ..bench.systems import build_systems

    systems = build_systems(args.base_url, args.server_cmd, args.system_label, args.policy,
                            args.token_budget, args.server_args, args.max_model_len,
                            args.server_model)
    cfg = CapacityConfig(bench_config_from_args(args, ""), search_config_from_args(args),
                         **settings_from_args(CapacityConfig, args), result_file=args.result_file)
    # `timeout` sends SIGTERM, which by default ends Python without running `finally`:
    # turn it into KeyboardInterrupt so the servers the run started are still stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    doc = run_capacity(systems, cfg)
    print(json.dumps(doc["summary"], indent=1))
    return 0 if doc["summary"] else 1


def _plot(args: argparse.Namespace) -> int:
    from ..bench.plot import plot_all

    tbt_ms = None if args.tbt_slo is None else args.tbt_slo * 1000.0
    for path in plot_all(args.files, args.out_dir, tbt_ms):
        print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the parsed `bench` command; returns the exit status."""
    commands = {"serve": _serve, "capacity": _capacity, "plot": _plot}
    try:
        return commands[args.bench_command](args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        print(f"stallfree bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during a capacity search
        print("stallfree bench: interrupted (servers it started were stopped)", file=sys.stderr)
        return 130
