"""Prefix caching on vs off, same server otherwise, in one sitting (docs/benchmarks.md).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prefix_caching.py --out out/prefix

Starts two servers on the default model that differ only in `--no-enable-prefix-caching`
and sends each workload to both, alternating which goes first (on/off, then off/on, ...)
so drifting background load hits both alike. The caching server's cache is reset before
each run, and every run draws fresh prompt ids, so nothing carries over between runs.
Workloads, at fixed request rates:

- multiturn: conversations of `--turns` turns with sharegpt's lengths (scaled): each
  turn resends the previous prompt and reply plus a new message, after a think time.
  Compared: TTFT of the turns after the first (median, P99).
- shared: a shared `--shared-prefix-len`-token system prompt and short questions.
  Compared: prompt tokens computed per request (from /metrics: iteration tokens less
  decode tokens) and TTFT.
- random: random prompts, no reuse, all sent at once. Compared: throughput.

It also times the scheduler alone (no model; a fake executor) on the random workload with
the cache on and off: the difference per iteration is the cost of the lookups and of
caching blocks, set against the mean iteration time the engine measured. Prints one JSON
document (and writes it to --out/prefix_caching.json); medians over --reps runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from stallfree.bench.config import BenchConfig, ClientConfig
from stallfree.bench.run import run_benchmark
from stallfree.bench.systems import ServerProcess, System
from stallfree.bench.workload import WorkloadConfig, build_workload
from stallfree.config import SchedulerConfig
from stallfree.scheduler import BlockManager, make_scheduler
from stallfree.sim.simulator import make_request

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)$')
COUNTERS = ("stallfree:iteration_tokens_total_sum", "stallfree:iteration_tokens_total_count",
            "stallfree:generation_tokens_total", "stallfree:request_success_total",
            "stallfree:prefix_cache_queries_total", "stallfree:prefix_cache_hits_total")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in COUNTERS:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def workloads(args: argparse.Namespace) -> dict[str, WorkloadConfig]:
    return {
        "multiturn": WorkloadConfig(
            dataset="sharegpt", num_prompts=args.turns * args.conversations, seed=args.seed,
            length_scale=args.length_scale, max_model_len=args.max_model_len, turns=args.turns,
            think_time=args.think_time, request_rate=args.conversation_rate),
        "shared": WorkloadConfig(
            dataset="random", num_prompts=args.shared_prompts, seed=args.seed,
            random_input_len=args.question_len, random_output_len=args.answer_len,
            shared_prefix_len=args.shared_prefix_len, request_rate=args.shared_rate),
        "random": WorkloadConfig(
            dataset="random", num_prompts=args.random_prompts, seed=args.seed,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len,
            random_range_ratio=0.5),
    }


def one_run(server: ServerProcess, caching: bool, workload: WorkloadConfig, salt: int,
            label: str) -> dict:
    if caching:
        httpx.post(server.base_url + "/reset_prefix_cache", timeout=60, trust_env=False)
    before = scrape(server.base_url)
    cfg = BenchConfig(workload, ClientConfig(base_url=server.base_url, progress=False),
                      detail=False, label=label)
    report = run_benchmark(cfg, token_salt=salt)
    time.sleep(1.0)  # the last request's counters are updated after its final chunk
    after = scrape(server.base_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    requests = delta["stallfree:request_success_total"]
    # Every iteration token is a prompt token or a decode; a sequence's first token is
    # sampled after its prompt, so decodes = generated tokens - sequences.
    prefill = delta["stallfree:iteration_tokens_total_sum"] - (
        delta["stallfree:generation_tokens_total"] - requests)
    iterations = delta["stallfree:iteration_tokens_total_count"]
    report["server"] = {
        "prefill_tokens_computed": prefill,
        "prefill_tokens_per_request": prefill / requests if requests else None,
        "iterations": iterations,
        # The run's wall time per iteration: the iteration time when the server never idles
        # (all requests sent at once).
        "s_per_iteration": report["duration"] / iterations if iterations else None,
        "prefix_cache_queries": delta[COUNTERS[4]], "prefix_cache_hits": delta[COUNTERS[5]]}
    return report


KEYS = ("median_followup_ttft_ms", "p99_followup_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "p99_tbt_ms", "output_throughput", "total_token_throughput", "request_throughput",
        "prefix_cache_hit_rate", "mean_computed_prompt_tokens", "duration", "failed")


def summary(reports: list[dict]) -> dict:
    out = {}
    for key in KEYS:
        values = [r.get(key) for r in reports if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    for key in ("prefill_tokens_per_request", "s_per_iteration"):
        values = [r["server"][key] for r in reports if r["server"][key] is not None]
        out[key] = statistics.median(values) if values else None
    out["runs"] = len(reports)
    return out


def scheduler_overhead(workload: WorkloadConfig, budget: int, reps: int) -> dict:
    """Seconds of scheduler work (schedule + update) per iteration, cache on and off."""
    specs = build_workload(workload, token_salt=99)
    result = {}
    for caching in (False, True, False, True) * reps:
        config = SchedulerConfig("sarathi", budget, 128, 4096)
        # Room for every request at once: no preemption, the same iterations on and off.
        sched = make_scheduler(config, BlockManager(16384, 16, 0.01, caching))
        for spec in specs:
            sched.add_request(make_request(spec, 0.0))
        iterations, start = 0, time.process_time()
        while sched.has_unfinished_requests():
            out = sched.schedule(0.0)
            sched.update(out, {c.request_id: 7 for c in out.chunks if c.samples}, 0.0)
            iterations += 1
        result.setdefault(caching, []).append((time.process_time() - start) / iterations)
        result.setdefault(f"iterations-{caching}", []).append(iterations)
    assert result["iterations-True"] == result["iterations-False"]
    return {"off_s_per_iteration": statistics.median(result[False]),
            "on_s_per_iteration": statistics.median(result[True]),
            "iterations": result["iterations-True"][0], "requests": len(specs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/prefix")
    p.add_argument("--parts", default="multiturn,shared,random,overhead")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-budget", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1GiB")
    # multiturn
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--length-scale", type=float, default=0.0625)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--conversation-rate", type=float, default=0.05)
    # shared
    p.add_argument("--shared-prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--shared-prompts", type=int, default=12)
    p.add_argument("--shared-rate", type=float, default=0.1)
    # random
    p.add_argument("--random-prompts", type=int, default=24)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    args = p.parse_args()
    parts = args.parts.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"settings": vars(args), "cpu_flags": cpu_flags(), "results": {}}
    serve = [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1", "--port",
             "{port}", "--token-budget", str(args.token_budget), "--max-model-len",
             str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
             "--uvicorn-log-level", "warning"]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    servers: dict[bool, ServerProcess] = {}
    try:
        if set(parts) - {"overhead"}:
            for caching in (True, False):
                flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
                servers[caching] = ServerProcess(System(f"caching-{caching}", command=serve + [
                    flag], env=env), startup_timeout=600, log_dir=str(out_dir))
        loads = workloads(args)
        for name in [n for n in parts if n in loads]:
            reports: dict[bool, list[dict]] = {True: [], False: []}
            for rep in range(args.reps):
                order = (True, False) if rep % 2 == 0 else (False, True)
                for caching in order:
                    label = f"{name}-{'on' if caching else 'off'}-{rep}"
                    started = time.time()
                    r = one_run(servers[caching], caching, loads[name], rep + 1, label)
                    print(f"{label}: {time.time() - started:.0f} s, "
                          f"{json.dumps({k: r.get(k) for k in KEYS[:4]})}", flush=True)
                    reports[caching].append(r)
            on, off = summary(reports[True]), summary(reports[False])
            doc["results"][name] = {"on": on, "off": off, "ratios_off_over_on": {
                k: off[k] / on[k] for k in on
                if isinstance(on[k], float) and on[k] and off[k] is not None}}
            save(out_dir, doc)
        if "overhead" in parts:
            random = loads["random"]
            big = WorkloadConfig(dataset="random", num_prompts=200, random_input_len=1024,
                                 random_output_len=128, random_range_ratio=0.5, seed=random.seed)
            doc["results"]["overhead"] = scheduler_overhead(big, args.token_budget, args.reps)
            save(out_dir, doc)
    finally:
        for server in servers.values():
            server.stop()
    print(json.dumps(doc["results"], indent=1))
    return 0


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = re.search(r"flags\s*:\s*(.*)", text)
    wanted = [f for f in (flags.group(1).split() if flags else [])
              if f.startswith(("avx", "fma", "amx", "sse4"))]
    return f"{model.group(1) if model else '?'}; {' '.join(wanted)}; {os.cpu_count()} cpus"


def save(out_dir: Path, doc: dict) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    (out_dir / "prefix_caching.json").write_text(json.dumps(clean(doc), indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
