"""Where a served token's time goes: the offline step beside the same request served.

Run: .venv/bin/python benchmarks/serving_path.py [--reps 3] [--dtype auto] [--threads N]

One request at a time (a 256-token prompt, 64 forced output tokens), in one sitting:

1. Offline: `LLM.generate`, the median decode iteration (end - start) of the engine.
2. Served: `stallfree serve --iteration-log` on loopback, the same prompt streamed by an
   httpx client in this process (a neighbour on the same cores, as any bench client is).
   From the client: the median and P99 gap between streamed chunks (ITL). From the
   iteration log: the median decode step (end - start), the median period between the
   starts of consecutive iterations (step + the engine thread's work between steps:
   commands, gauges, handing outputs over) and the engine thread's CPU time per step.
   From /proc/<pid>/task: the server's CPU seconds per generated token, by thread (the
   engine thread, the compute threads, the event loop that detokenizes and writes SSE,
   the rest), read before and after the streamed requests.

ITL - period is the handoff (engine thread -> event loop -> socket -> client); period
- step the engine thread's time outside steps; served step - offline step what the
serving process and the client take from the step (the GIL, cores). Every figure is a
median over --reps rounds of --requests requests; the CPU's flags are printed beside.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from stallfree import LLM, SamplingParams
from stallfree.bench.systems import ServerProcess, System
from stallfree.executor.hardware import vector_flags
from stallfree.iteration_log import read_iteration_log

PROMPT = [(j * 7919) % 40000 + 100 for j in range(256)]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the threads of `pid`: the main thread (the event loop) apart, the
    others summed by name (compute threads take the name of the thread that made them)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        key = "main thread (event loop)" if task.name == str(pid) else name
        out[key] += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


def offline_step(dtype: str, outputs: int) -> float:
    llm = LLM(dtype=dtype, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=outputs, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up
    steps = []
    for _ in range(3):
        llm.engine.iterations.clear()
        llm.generate([PROMPT], params)
        steps += [r.end - r.start for r in llm.engine.iterations if not r.num_prefill_tokens]
    llm.shutdown()
    return statistics.median(steps)


def stream_one(client: httpx.Client, outputs: int) -> list[float]:
    """Arrival times of a streamed request's chunks that carry text."""
    times = []
    body = {"model": "m", "prompt": PROMPT, "max_tokens": outputs, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return times


def served(dtype: str, threads: int | None, outputs: int, requests: int) -> dict:
    log = Path(tempfile.mkdtemp()) / "iterations.jsonl"
    cmd = [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1", "--port",
           "{port}", "--served-model-name", "m", "--dtype", dtype, "--max-model-len", "1024",
           "--iteration-log", str(log), "--uvicorn-log-level", "warning",
           *(["--threads", str(threads)] if threads else [])]
    with ServerProcess(System("serving-path", command=cmd, env={"HF_HUB_OFFLINE": "1"})) as s, \
            httpx.Client(base_url=s.base_url, timeout=300, trust_env=False) as client:
        stream_one(client, outputs)  # warm-up
        before, gaps = thread_cpu(s.proc.pid), []
        for _ in range(requests):
            times = stream_one(client, outputs)
            gaps += [b - a for a, b in zip(times, times[1:])]
        after = thread_cpu(s.proc.pid)
        time.sleep(0.5)  # the last records reach the log
        _, records = read_iteration_log(log)
    decodes = [r for r in records if not r.num_prefill_tokens][-requests * (outputs - 1):]
    periods = [b.start - a.start for a, b in zip(decodes, decodes[1:])
               if b.start - a.start < 10 * (a.end - a.start)]  # not across requests
    cpu: dict[str, float] = defaultdict(float)
    for name in after:
        cpu[name] += after[name] - before.get(name, 0.0)
    tokens = requests * outputs
    return {"itl_median": statistics.median(gaps),
            "itl_p99": statistics.quantiles(gaps, n=100)[98],
            "step": statistics.median(r.end - r.start for r in decodes),
            "period": statistics.median(periods),
            "engine_cpu_per_step": statistics.median(r.cpu_time for r in decodes),
            "cpu_ms_per_token": {k: 1e3 * v / tokens for k, v in sorted(cpu.items())}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=4, help="per round")
    p.add_argument("--outputs", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    flags = vector_flags()
    print(f"CPU flags: {flags}; {os.cpu_count()} cpus", flush=True)
    rounds = []
    for rep in range(args.reps):
        off = offline_step(args.dtype, args.outputs)
        on = served(args.dtype, args.threads, args.outputs, args.requests)
        on["offline_step"] = off
        rounds.append(on)
        print(f"round {rep}: {json.dumps(on, default=lambda x: round(x, 5))}", flush=True)
    keys = ("offline_step", "step", "period", "itl_median", "itl_p99", "engine_cpu_per_step")
    summary = {k: statistics.median(r[k] for r in rounds) for k in keys}
    groups = {g for r in rounds for g in r["cpu_ms_per_token"]}
    summary["cpu_ms_per_token"] = {
        g: statistics.median(r["cpu_ms_per_token"].get(g, 0.0) for r in rounds) for g in groups}
    summary["ratios"] = {"itl_over_offline_step": summary["itl_median"] / summary["offline_step"],
                         "served_step_over_offline": summary["step"] / summary["offline_step"],
                         "period_minus_step_ms": 1e3 * (summary["period"] - summary["step"]),
                         "itl_minus_period_ms": 1e3 * (summary["itl_median"] - summary["period"])}
    print(json.dumps(summary, indent=1, default=lambda x: round(x, 5)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
