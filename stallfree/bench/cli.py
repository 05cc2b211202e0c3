"""`stallfree bench {serve,capacity,plot}`.

Flag names follow `vllm bench serve` where the meaning is the same. Building
the parser imports nothing heavy; each command imports what it needs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from .workload import DATASETS, DEFAULT_MIN_TOKEN_ID, DEFAULT_VOCAB_SIZE


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default="sharegpt",
                   choices=DATASETS, help="length trace (shipped with stallfree) or random")
    g.add_argument("--dataset-path", default=None,
                   help="a trace CSV with num_prefill_tokens,num_decode_tokens instead")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply prompt and output lengths (e.g. 0.125 to fit a CPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="cap prompt + output, cutting both in proportion (the paper's rule)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help="prompt token ids are drawn below this (default: SmolLM2's)")
    g.add_argument("--min-token-id", type=int, default=DEFAULT_MIN_TOKEN_ID)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("client")
    g.add_argument("--model", default=None, help="model name sent in requests (default: none)")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--api-key", default=None)
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--max-duration", type=float, default=None,
                   help="seconds for a whole run; later requests fail (default: no limit)")
    g.add_argument("--request-timeout", type=float, default=3600.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers that refuse it)")
    g.add_argument("--ban-token-ids", type=_ints, default=[],
                   help="logit_bias -100 on these ids, e.g. EOS for llama.cpp (0,2 for SmolLM2)")
    g.add_argument("--no-continuous-usage", dest="continuous_usage", action="store_false",
                   help="do not ask for usage in every chunk")
    g.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput: ttft, tpot, e2el (vLLM's) and tbt, in ms")
    g.add_argument("--metric-percentiles", type=_floats, default=[50, 90, 99])
    g.add_argument("--no-scrape-metrics", dest="scrape_metrics", action="store_false",
                   help="do not read the server's queue-time histogram from /metrics")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--label", default=None)


def add_bench_args(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` (with serve, capacity, plot) to a `add_subparsers()` object."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="one run at one request rate; prints and saves a report")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (default inf: all at once)")
    serve.add_argument("--tbt-slo", type=float, default=None, metavar="SECONDS",
                       help="also count the TBT gaps over this")
    serve.add_argument("--no-detail", dest="detail", action="store_false",
                       help="leave per-request lists and token times out of the JSON")
    serve.add_argument("--result-file", default=None)
    _add_workload_args(serve)
    _add_client_args(serve)

    cap = sub.add_parser("capacity", help="search the highest rate meeting a TBT SLO")
    cap.add_argument("--tbt-slo", type=_floats, required=True, metavar="SECONDS[,SECONDS]",
                     help="P99 TBT SLO(s); several reuse the same trials")
    cap.add_argument("--tbt-percentile", type=float, default=99.0)
    cap.add_argument("--max-sched-delay", type=float, default=2.0, metavar="SECONDS")
    cap.add_argument("--sched-delay-source", default="auto",
                     choices=["auto", "response", "prometheus", "ttft"])
    cap.add_argument("--baseline-prompts", type=int, default=10,
                     help="requests (one at a time) for the low-rate TTFT of the ttft source")
    cap.add_argument("--allow-failures", action="store_true",
                     help="a trial with failed requests may still pass")
    cap.add_argument("--start-rate", type=float, default=1.0)
    cap.add_argument("--precision", type=float, default=0.025,
                     help="stop when the failing rate <= passing rate * (1 + this)")
    cap.add_argument("--min-rate", type=float, default=0.01)
    cap.add_argument("--max-rate", type=float, default=math.inf)
    cap.add_argument("--max-trials", type=int, default=20)
    cap.add_argument("--warmup-prompts", type=int, default=2)
    sys_ = cap.add_argument_group("systems (one or more)")
    sys_.add_argument("--base-url", action="append", default=[],
                      help="a server already running (repeatable)")
    sys_.add_argument("--server-cmd", action="append", default=[],
                      help="start this server command, with {port} (repeatable)")
    sys_.add_argument("--system-label", action="append", default=[],
                      help="labels for --base-url then --server-cmd, in order")
    sys_.add_argument("--policy", type=_words, default=[],
                      help="start our server with each policy, e.g. sarathi,vllm,orca")
    sys_.add_argument("--token-budget", type=_ints, default=[512])
    sys_.add_argument("--server-model", default=None, help="model for our server (default one)")
    sys_.add_argument("--server-args", default="", help="extra flags for our server")
    sys_.add_argument("--startup-timeout", type=float, default=600.0)
    sys_.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    cap.add_argument("--trial-detail-dir", default=None,
                     help="also save every trial's full report here (for TBT CDF plots)")
    cap.add_argument("--result-file", default=None)
    _add_workload_args(cap)
    _add_client_args(cap)

    plot = sub.add_parser("plot", help="PNG plots from serve reports and capacity results")
    plot.add_argument("files", nargs="+")
    plot.add_argument("--out-dir", default=".")
    plot.add_argument("--tbt-slo", type=float, default=None, metavar="SECONDS",
                      help="SLO line and stall threshold (default: from the files)")
    return bench


def workload_config(args: argparse.Namespace, rate: float = math.inf) -> Any:
    from .workload import WorkloadConfig

    return WorkloadConfig(
        dataset=args.dataset, dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        request_rate=rate, burstiness=args.burstiness, seed=args.seed,
        length_scale=args.length_scale, max_model_len=args.max_model_len,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, vocab_size=args.vocab_size,
        min_token_id=args.min_token_id)


def bench_config(args: argparse.Namespace, base_url: str, rate: float = math.inf,
                 tbt_slo: float | None = None, detail: bool = True) -> Any:
    from .client import ClientConfig
    from .metrics import SLOs
    from .runner import BenchConfig

    client = ClientConfig(
        base_url=base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        ignore_eos=args.ignore_eos, ban_token_ids=args.ban_token_ids,
        continuous_usage=args.continuous_usage, request_timeout=args.request_timeout,
        max_duration=args.max_duration, max_concurrency=args.max_concurrency,
        extra_body=args.extra_body, progress=not args.disable_tqdm)
    return BenchConfig(workload_config(args, rate), client, SLOs.parse(args.goodput),
                       None if tbt_slo is None else tbt_slo * 1000.0,
                       tuple(args.metric_percentiles), args.scrape_metrics, detail, args.label)


def _serve(args: argparse.Namespace) -> int:
    from .metrics import format_report
    from .runner import run_benchmark, save_json

    cfg = bench_config(args, args.base_url, args.request_rate, args.tbt_slo, args.detail)
    report = run_benchmark(cfg)
    print(format_report(report, cfg.percentiles))
    if args.result_file:
        save_json(args.result_file, report)
        print(f"saved {args.result_file}")
    return 0 if report["completed"] else 1


def _plot(args: argparse.Namespace) -> int:
    from .plot import plot_all

    tbt_ms = None if args.tbt_slo is None else args.tbt_slo * 1000.0
    for path in plot_all(args.files, args.out_dir, tbt_ms):
        print(f"wrote {path}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Runs the parsed `bench` command; returns the exit status."""
    try:
        if args.bench_command == "serve":
            return _serve(args)
        if args.bench_command == "capacity":
            from .capacity_cli import run_capacity

            return run_capacity(args)
        if args.bench_command == "plot":
            return _plot(args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        print(f"stallfree bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during a capacity search
        print("stallfree bench: interrupted (servers it started were stopped)", file=sys.stderr)
        return 130
    return 1
