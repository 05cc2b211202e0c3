"""Pipeline bubbles under PP: uniform sarathi micro-batches vs vllm's uneven ones.

Run: .venv/bin/python benchmarks/pipeline_bubbles.py [--pp 2] [--num-prompts 32]
Sends the same sharegpt-shaped requests (lengths scaled to this CPU, random
token ids, full-length outputs) to an engine with --pp stages, once per policy,
all at once. From the workers' own stage clocks it reports the time each
micro-batch spent on each stage (median, P90, max) and the bubble fraction:
the share of stage time left idle while some micro-batch was in flight.
Uneven batches (a whole prefill next to a decode-only batch) leave the next
stage waiting; sarathi's budget-sized batches keep the stages equally busy.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from stallfree import LLM, SamplingParams
from stallfree.bench.workload import WorkloadConfig, build_workload


def bubble_fraction(records: list, pp: int) -> float:
    """1 - busy stage time / (stages x time with anything in flight)."""
    spans = sorted((r.start, r.end) for r in records)
    covered, cur_start, cur_end = 0.0, *spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            covered += cur_end - cur_start
            cur_start = start
        cur_end = max(cur_end, end)
    covered += cur_end - cur_start
    busy = sum(end - start for r in records for start, end in r.stage_times)
    return 1.0 - busy / (pp * covered)


def run(args: argparse.Namespace, policy: str, budget: int) -> dict:
    cfg = WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                         length_scale=args.length_scale, max_model_len=args.max_model_len)
    specs = build_workload(cfg)
    params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
              for s in specs]
    with LLM(policy=policy, token_budget=budget, max_model_len=args.max_model_len,
             pipeline_parallel_size=args.pp) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))  # warm-up
        llm.engine.iterations.clear()
        start = time.monotonic()
        llm.generate([s.prompt_token_ids for s in specs], params)
        elapsed = time.monotonic() - start
        records = list(llm.engine.iterations)
    per_stage = np.array([[end - start for start, end in r.stage_times] for r in records])
    row = {"policy": policy, "token_budget": budget, "micro_batches": len(records),
           "elapsed_s": elapsed, "bubble_fraction": bubble_fraction(records, args.pp),
           "output_tokens": sum(s.output_len for s in specs)}
    for stage in range(args.pp):
        times = per_stage[:, stage] * 1000
        row[f"stage{stage}_ms"] = {"median": float(np.median(times)),
                                   "p90": float(np.percentile(times, 90)),
                                   "max": float(times.max())}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--length-scale", type=float, default=0.125)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--sarathi-budget", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    rows = [run(args, "sarathi", args.sarathi_budget),
            run(args, "vllm", args.max_model_len)]  # vllm: whole prefills, budget = max len
    print(f"PP={args.pp}, {args.num_prompts} {args.dataset} requests at length scale "
          f"{args.length_scale}, all sent at once")
    print(f"{'policy':<8} {'budget':>6} {'batches':>7} {'elapsed s':>9} {'bubble':>7}  "
          + "  ".join(f"stage{s} ms median/p90/max" for s in range(args.pp)))
    for r in rows:
        stages = "  ".join(f"{r[f'stage{s}_ms']['median']:7.1f}/{r[f'stage{s}_ms']['p90']:6.1f}/"
                           f"{r[f'stage{s}_ms']['max']:7.1f}" for s in range(args.pp))
        print(f"{r['policy']:<8} {r['token_budget']:>6} {r['micro_batches']:>7} "
              f"{r['elapsed_s']:>9.1f} {r['bubble_fraction']:>7.1%}  {stages}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
