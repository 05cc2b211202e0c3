"""`stallfree bench capacity`: the capacity search run against real servers, one by one.

For each system: start it (or use its URL), send a few warm-up requests,
then search once per TBT SLO. Trials are cached by rate per system, so the
strict and relaxed searches share every rate they both try, and the low-rate
TTFT baseline (only for the `ttft` scheduling-delay source) is measured at
most once. The result file is rewritten after each system, so a crash or
an interrupt keeps what was measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shlex
import signal
import time
from typing import Any

from .capacity import Criterion, SearchResult, Trial, search_capacity
from .cli import bench_config
from .runner import run_benchmark, save_json, with_rate
from .systems import ServerProcess, System, command_system, stallfree_systems

_DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "send_times",
                "token_times", "success")


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in _DETAIL_KEYS}


def build_systems(args: argparse.Namespace) -> list[System]:
    labels = list(args.system_label)
    systems = []
    for url in args.base_url:
        systems.append(System(labels.pop(0) if labels else url, base_url=url))
    for cmd in args.server_cmd:
        systems.append(command_system(cmd, labels.pop(0) if labels else None))
    if args.policy:
        systems += stallfree_systems(args.policy, args.token_budget, shlex.split(args.server_args),
                                     args.max_model_len, args.server_model)
    if not systems:
        raise ValueError("give at least one system: --policy, --server-cmd or --base-url")
    names = [s.label for s in systems]
    if len(set(names)) != len(names):
        raise ValueError(f"system labels must differ: {names} (use --system-label)")
    return systems


def _trial_line(label: str, t: Trial) -> str:
    m = t.metrics
    tbt = "n/a" if t.tbt_s is None else f"{t.tbt_s * 1e3:.1f} ms"
    delay = "n/a" if t.sched_delay_s is None else f"{t.sched_delay_s:.2f} s"
    if t.sched_delay_source == "prometheus" and t.sched_delay_s is not None:
        delay = "<= " + delay  # the histogram bucket edge above the median
    ttft = m.get("median_ttft_ms")
    return (f"[{label}] {t.rate:.4g} req/s: P99 TBT {tbt}, median TTFT "
            f"{'n/a' if ttft is None else f'{ttft:.0f} ms'}, sched delay {delay} "
            f"({t.sched_delay_source}), {m.get('completed')} ok / {m.get('failed')} failed"
            f" -> {'PASS' if t.passed else 'fail: ' + t.reason}")


def measure_system(args: argparse.Namespace, system: System, base_url: str) -> dict[str, Any]:
    base = bench_config(args, base_url, detail=bool(args.trial_detail_dir))
    base = dataclasses.replace(base, label=system.label)
    quiet = dataclasses.replace(base, detail=False, scrape_metrics=False)
    salts = itertools.count(1)  # a fresh prompt-id stream for every run (no prefix-cache hits)
    if args.warmup_prompts > 0:
        warm = dataclasses.replace(quiet, workload=dataclasses.replace(
            quiet.workload, num_prompts=args.warmup_prompts))
        run_benchmark(with_rate(warm, math.inf, max_concurrency=1), token_salt=10**6)

    cache: dict[float, dict[str, Any]] = {}

    def trial(rate: float) -> dict[str, Any]:
        if rate not in cache:
            report = run_benchmark(with_rate(base, rate), token_salt=next(salts))
            if args.trial_detail_dir:
                os.makedirs(args.trial_detail_dir, exist_ok=True)
                save_json(os.path.join(args.trial_detail_dir,
                                       f"{system.label}_rate{rate:.4f}.json"), report)
            cache[rate] = _summary(report)
        return cache[rate]

    baseline_report: dict[str, Any] = {}

    def baseline() -> float:
        if not baseline_report:
            n = min(args.baseline_prompts, args.num_prompts)
            cfg = dataclasses.replace(quiet, workload=dataclasses.replace(quiet.workload,
                                                                          num_prompts=n))
            report = _summary(run_benchmark(with_rate(cfg, math.inf, max_concurrency=1),
                                            token_salt=2 * 10**6))
            if report.get("median_ttft_ms") is None:
                raise RuntimeError(f"the low-rate TTFT baseline failed: {report['error_counts']}")
            baseline_report.update(report)
            print(f"[{system.label}] low-rate baseline: median TTFT "
                  f"{baseline_report['median_ttft_ms']:.0f} ms over {n} requests one at a time",
                  flush=True)
        return baseline_report["median_ttft_ms"] / 1000.0

    results: list[SearchResult] = []
    for slo in args.tbt_slo:
        criterion = Criterion(slo, args.tbt_percentile, args.max_sched_delay,
                              args.sched_delay_source, not args.allow_failures,
                              baseline=baseline)
        print(f"[{system.label}] searching: {criterion.describe()['text']}", flush=True)
        res = search_capacity(trial, criterion, args.start_rate, args.precision, args.min_rate,
                              args.max_rate, args.max_trials,
                              on_trial=lambda t: print(_trial_line(system.label, t), flush=True))
        print(f"[{system.label}] capacity {res.capacity_qps:.4g} req/s at P99 TBT <= "
              f"{slo * 1e3:g} ms {res.note}", flush=True)
        results.append(res)
    return {"label": system.label, "command": system.command, "base_url": base_url,
            "baseline": baseline_report or None, "results": [r.to_dict() for r in results]}


def _min_rate(args: argparse.Namespace) -> float:
    """No trial below the rate at which the workload cannot even be sent within --max-duration.

    Below N / max_duration the trial would fail for lack of time, not for missing the SLO;
    1.5x leaves a third of the time to drain the queue.
    """
    if args.max_duration is None:
        return args.min_rate
    floor = 1.5 * args.num_prompts / args.max_duration
    if args.min_rate < floor:
        print(f"min rate raised to {floor:.3g} req/s: {args.num_prompts} requests must arrive "
              f"within 2/3 of --max-duration {args.max_duration:g} s", flush=True)
    return max(args.min_rate, floor)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_capacity(args: argparse.Namespace) -> int:
    systems = build_systems(args)
    args.min_rate = _min_rate(args)
    # `timeout` sends SIGTERM, which by default ends Python without running `finally`:
    # turn it into KeyboardInterrupt so the server we started is still stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    out: dict[str, Any] = {
        "kind": "capacity", "date": time.strftime("%Y%m%d-%H%M%S"), "cpu_count": os.cpu_count(),
        "workload": dataclasses.asdict(bench_config(args, "").workload) | {"request_rate": None},
        "search": {"start_rate": args.start_rate, "precision": args.precision,
                   "min_rate": args.min_rate, "max_rate": args.max_rate,
                   "max_trials": args.max_trials, "max_duration_per_trial": args.max_duration,
                   "warmup_prompts": args.warmup_prompts},
        "tbt_slos_s": args.tbt_slo, "systems": [], "summary": [],
    }
    for system in systems:
        server = None
        try:
            if system.command is not None:
                print(f"[{system.label}] starting: {shlex.join(system.command)}", flush=True)
                server = ServerProcess(system, args.startup_timeout, args.log_dir)
                url = server.base_url
            else:
                url = system.base_url or ""
            entry = measure_system(args, system, url)
            if server is not None:
                entry |= {"log": server.log_path, "pid": server.proc.pid}
        except (RuntimeError, TimeoutError, OSError) as err:
            print(f"[{system.label}] error: {err}", flush=True)
            entry = {"label": system.label, "command": system.command, "error": str(err),
                     "results": []}
        finally:
            if server is not None:
                server.stop()
        out["systems"].append(entry)
        for res in entry["results"]:
            out["summary"].append({"label": system.label,
                                   "tbt_slo_s": res["criterion"]["tbt_slo_s"],
                                   "capacity_qps": res["capacity_qps"],
                                   "sched_delay_source": _sources(res),
                                   "converged": res["converged"], "note": res["note"]})
        if len(out["summary"]) == 1:
            out["capacity_qps"] = out["summary"][0]["capacity_qps"]
            out["criterion"] = entry["results"][0]["criterion"]
        else:
            out.pop("capacity_qps", None)
            out.pop("criterion", None)
        if args.result_file:
            save_json(args.result_file, out)
    print(json.dumps(out["summary"], indent=1))
    return 0 if out["summary"] else 1


def _sources(res: dict[str, Any]) -> list[str]:
    """Which scheduling-delay source(s) the trials of a search used."""
    return sorted({t["sched_delay_source"] for t in res["trials"] if t["sched_delay_source"]})
