"""The benchmark report: vLLM `bench serve`'s metrics and key names, plus TBT and stalls.

Keys that mean what vLLM's mean carry vLLM's names (`completed`, `failed`,
`request_throughput`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
`median_e2el_ms`, ...), so one script can read both tools' JSON. Definitions:

- TTFT: request sent -> first token received. E2E (`e2el`): sent -> last token.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request (requests of one token
  have none).
- ITL: vLLM's, gaps between consecutive *chunks* of a request.
- TBT (ours, the paper's metric): gaps between consecutive *tokens*, every gap
  of every successful request pooled, the first token excluded. Equal to ITL
  when each chunk carries one token.
- Longest stall: the largest TBT gap, with the request and token it delayed.
- Scheduling delay: only when the server reports it per request (see
  client.py); the server's queue-time histogram is added by the caller.
- Goodput: requests per second that met every given SLO (vLLM's `--goodput`
  keys ttft, tpot, e2el in ms, plus `tbt`: every TBT gap of the request).
- Follow-up TTFT (`followup_ttft`): TTFT of the turns after the first of
  multi-turn conversations, the ones a prefix cache speeds up.
- Prefix cache: from each response's `usage.prompt_tokens_details.cached_tokens`
  (null when the server does not report it), the share of prompt tokens served
  from the cache (`prefix_cache_hit_rate`) and the prompt tokens computed per
  request (`mean_computed_prompt_tokens`).

Statistics are over successful requests; percentiles are numpy's linear
interpolation (as vLLM's). Statistics of an empty set are null in JSON. The run's
configuration comes first in every report (`report_header`); `save_json` writes
strict JSON; `format_report` prints a report.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from .config import PERCENTILES, BenchConfig, SLOs
from .records import RequestResult, RunResult
from .workload import RequestSpec, describe


def percentile(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if len(values) else None


def _stats(prefix: str, seconds: Sequence[float], pcts: Sequence[float]) -> dict[str, Any]:
    """mean/median/std/pXX of `seconds`, in ms, under vLLM's key names."""
    ms = [s * 1000.0 for s in seconds]
    out: dict[str, Any] = {
        f"mean_{prefix}_ms": float(np.mean(ms)) if ms else None,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": float(np.std(ms)) if ms else None,
    }
    for p in pcts:
        out[f"p{percentile_name(p)}_{prefix}_ms"] = percentile(ms, p)
    return out


def percentile_name(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9': the p in vLLM's `p99_ttft_ms` keys."""
    return str(int(p)) if int(p) == p else str(p)


def longest_stall(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    """The largest gap between two tokens of one request, and where it happened."""
    best: dict[str, Any] | None = None
    for r in results:
        gaps = r.tbt
        if not gaps:
            continue
        i = int(np.argmax(gaps))
        if best is None or gaps[i] * 1000.0 > best["ms"]:
            best = {"ms": gaps[i] * 1000.0, "request": r.index, "token": i + 1,
                    "at_s": r.token_times[i + 1]}
    return best


def peak_output_per_s(results: Sequence[RequestResult]) -> float:
    """Most tokens received in any whole second of the run (vLLM's 1 s buckets)."""
    times = [t for r in results for t in r.token_times]
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times) - min(times)).astype(int))
    return float(counts.max())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight (sent, last token not yet received) at one moment."""
    events = []
    for r in results:
        if r.send_time is not None:
            end = r.chunk_times[-1] if r.chunk_times else r.send_time
            events += [(r.send_time, 1), (end, -1)]
    level = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        level += step
        peak = max(peak, level)
    return peak


def compute_report(run: RunResult, slos: SLOs | None = None,
                   percentiles: Sequence[float] = PERCENTILES,
                   detail: bool = True, tbt_slo_ms: float | None = None) -> dict[str, Any]:
    """The JSON report of one run (without the run's configuration: the caller adds it)."""
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    dur = run.duration if run.duration > 0 else math.nan
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tbts = [g for r in ok for g in r.tbt]
    rep: dict[str, Any] = {
        "duration": run.duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_output_per_s(ok),
        "max_concurrent_requests": peak_concurrency(run.results),
    }
    rep |= _stats("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles)
    rep |= _stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles)
    rep |= _stats("itl", [g for r in ok for g in r.itl], percentiles)
    rep |= _stats("e2el", [r.latency for r in ok if r.latency is not None], percentiles)
    rep |= _stats("tbt", tbts, percentiles)
    rep["max_tbt_ms"] = max(tbts) * 1000.0 if tbts else None
    rep["num_tbt_gaps"] = len(tbts)
    stall = longest_stall(ok)
    rep["longest_stall_ms"] = stall["ms"] if stall else None
    rep["longest_stall"] = stall
    if tbt_slo_ms is not None:
        rep["tbt_slo_ms"] = tbt_slo_ms
        rep["num_tbt_gaps_over_slo"] = sum(1 for g in tbts if g * 1000.0 > tbt_slo_ms)
    delays = [r.scheduling_delay for r in ok if r.scheduling_delay is not None]
    rep["sched_delay_source"] = "response" if delays else None
    rep |= _stats("sched_delay", delays, percentiles)
    if slos is not None and slos.as_dict():
        good = sum(1 for r in ok if slos.met_by(r))
        rep["goodput_slos_ms"] = slos.as_dict()
        rep["good_requests"] = good
        rep["request_goodput"] = good / dur
    rep |= _repeat_stats(run.results, ok, percentiles)
    rep["token_count_inexact_requests"] = sum(1 for r in ok if not r.token_count_exact)
    rep["output_len_mismatch_requests"] = sum(1 for r in ok
                                              if r.output_len != r.expected_output_len)
    rep["error_counts"] = dict(Counter(r.error or "unknown" for r in failed))
    if detail:
        rep |= per_request_detail(run.results)
    return rep


def _repeat_stats(results: Sequence[RequestResult], ok: Sequence[RequestResult],
                  percentiles: Sequence[float]) -> dict[str, Any]:
    """Follow-up turns' TTFT (multi-turn workloads only) and the prefix cache's share."""
    rep: dict[str, Any] = {}
    if any(r.turn for r in results):
        followups = [r.ttft for r in ok if r.turn and r.ttft is not None]
        rep["num_followup_turns"] = len(followups)
        rep |= _stats("followup_ttft", followups, percentiles)
    known = [r for r in ok if r.usage_cached_tokens is not None and r.usage_prompt_tokens]
    prompt = sum(r.usage_prompt_tokens for r in known)
    cached = sum(r.usage_cached_tokens for r in known)
    rep["prefix_cache_hit_rate"] = cached / prompt if known else None
    rep["mean_cached_prompt_tokens"] = cached / len(known) if known else None
    rep["mean_computed_prompt_tokens"] = (prompt - cached) / len(known) if known else None
    return rep


def _r6(values: Iterable[float]) -> list[float]:
    return [round(v, 6) for v in values]


def per_request_detail(results: Sequence[RequestResult]) -> dict[str, Any]:
    """vLLM's per-request lists (seconds) plus every token's arrival, for plots."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [None if r.ttft is None else round(r.ttft, 6) for r in results],
        "itls": [_r6(r.itl) for r in results],
        "errors": [r.error for r in results],
        "send_times": [None if r.send_time is None else round(r.send_time, 6) for r in results],
        "token_times": [_r6(r.token_times) for r in results],
        "success": [r.success for r in results],
        "turns": [r.turn for r in results],
        "cached_tokens": [r.usage_cached_tokens for r in results],
    }


# ---- the run's configuration and the file ---------------------------------------------
def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # as vLLM writes it; JSON has no Infinity


def report_header(cfg: BenchConfig, specs: list[RequestSpec], start_unix: float,
                  backend: str = "openai") -> dict[str, Any]:
    """The run's configuration, first in every report (the simulator writes the same)."""
    w, c = cfg.workload, cfg.client
    return {
        "date": datetime.fromtimestamp(start_unix, timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": backend, "label": cfg.label, "model_id": c.model, "base_url": c.base_url,
        "endpoint": c.endpoint, "dataset_name": w.dataset if not w.dataset_path else w.dataset_path,
        "num_prompts": w.num_prompts, "request_rate": _rate_json(w.request_rate),
        "burstiness": w.burstiness, "max_concurrency": c.max_concurrency, "seed": w.seed,
        "length_scale": w.length_scale, "max_model_len": w.max_model_len,
        "shared_prefix_len": w.shared_prefix_len, "turns": w.turns, "think_time": w.think_time,
        "ignore_eos": c.ignore_eos, "max_duration": c.max_duration, "workload": describe(specs),
    }


def _clean(obj: Any) -> Any:
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def save_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(_clean(obj), f, indent=1, allow_nan=False)
        f.write("\n")


# ---- printing ------------------------------------------------------------------------
_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("followup_ttft", "follow-up TTFT", "TTFT of Turns After the First"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"),
             ("tbt", "TBT", "Time Between Tokens (every gap)"),
             ("sched_delay", "Sched. delay", "Scheduling Delay"))


def _line(label: str, value: Any, fmt: str = ".2f") -> str:
    text = "n/a" if value is None else (format(value, fmt) if isinstance(value, float)
                                        else str(value))
    return f"{label:<40} {text:<10}"


def format_report(rep: dict[str, Any], percentiles: Sequence[float] = PERCENTILES) -> str:
    """The report as `vllm bench serve` prints it, with our sections added."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _line("Successful requests:", rep["completed"]),
             _line("Failed requests:", rep["failed"])]
    if rep.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", rep["max_concurrency"]))
    if rep.get("request_rate") is not None:
        lines.append(_line("Request rate (req/s):", rep["request_rate"]))
    lines += [_line("Benchmark duration (s):", rep["duration"]),
              _line("Total input tokens:", rep["total_input_tokens"]),
              _line("Total generated tokens:", rep["total_output_tokens"]),
              _line("Request throughput (req/s):", rep["request_throughput"])]
    if rep.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", rep["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", rep["output_throughput"]),
              _line("Peak output token throughput (tok/s):", rep["max_output_tokens_per_s"]),
              _line("Peak concurrent requests:", rep["max_concurrent_requests"]),
              _line("Total Token throughput (tok/s):", rep["total_token_throughput"])]
    for key, name, header in _SECTIONS:
        if rep.get(f"mean_{key}_ms") is None and key in ("sched_delay", "followup_ttft"):
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_line(f"Mean {name} (ms):", rep.get(f"mean_{key}_ms")))
        lines.append(_line(f"Median {name} (ms):", rep.get(f"median_{key}_ms")))
        for p in percentiles:
            if p != 50:
                pct = percentile_name(p)
                lines.append(_line(f"P{pct} {name} (ms):", rep.get(f"p{pct}_{key}_ms")))
        if key == "tbt":
            lines.append(_line("Max TBT (longest stall) (ms):", rep.get("max_tbt_ms")))
            if rep.get("num_tbt_gaps_over_slo") is not None:
                lines.append(_line(f"Gaps over {rep['tbt_slo_ms']:g} ms:",
                                   rep["num_tbt_gaps_over_slo"]))
    if rep.get("prefix_cache_hit_rate") is not None:
        lines.append("{s:{c}^{n}}".format(s="Prefix cache (usage)", n=50, c="-"))
        lines.append(_line("Prefix cache hit rate (%):", 100.0 * rep["prefix_cache_hit_rate"]))
        lines.append(_line("Mean prompt tokens computed:", rep["mean_computed_prompt_tokens"]))
    queue = rep.get("server_queue_time")
    if queue and queue.get("count"):
        lines.append("{s:{c}^{n}}".format(s="Server queue time (/metrics)", n=50, c="-"))
        lines.append(_line("Mean queue time (ms):", queue["mean_s"] * 1000.0))
        if queue.get("median_upper_s") is not None:
            lines.append(_line("Median queue time <= (bucket) (ms):",
                               queue["median_upper_s"] * 1000.0))
        lines.append(_line("Requests queued <= 2 s (%):", 100.0 * queue["frac_le_2s"]))
    if rep.get("token_count_inexact_requests"):
        lines.append(_line("Requests timed per chunk, not token:",
                           rep["token_count_inexact_requests"]))
    lines.append("=" * 50)
    return "\n".join(lines)
