"""What prompt logprobs cost per prompt token, offline on the default model, side by side.

Run: .venv/bin/python benchmarks/prompt_logprobs.py [--prompt-len 512] [--reps 7]

Times the prefill of one `--prompt-len`-token prompt (max_tokens 1) three ways,
alternating them in every repeat so drifting load hits each alike: without prompt
logprobs, with prompt_logprobs=0 (the token's own logprob), and with prompt_logprobs=5
(plus its top 5). The token budget is the prompt's length, so each prefill is one
iteration: the difference is the LM head and log-softmax over every prompt row. Prints
the medians, the extra milliseconds per prompt token and the ratio to a plain prompt
token, beside the charge the scheduler makes for such a token (the model's
multiply-adds with and without the LM head), and the CPU's vector flags.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from stallfree import LLM, SamplingParams
from stallfree.executor.hardware import vector_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.prompt_len,
              enable_prefix_caching=False, max_model_len=max(2048, args.prompt_len + 8))
    engine = llm.engine
    rng = random.Random(0)
    kinds = {"plain": None, "prompt_logprobs=0": 0, "prompt_logprobs=5": 5}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(args.reps + 1):  # the first round warms up and is dropped
        for name, top in kinds.items():
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top)
            start = time.perf_counter()
            llm.generate([prompt], params)
            if rep:
                times[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    plain = medians["plain"] / args.prompt_len
    report = {
        "cpu": vector_flags(), "dtype": engine.info.dtype, "threads": engine.info.threads,
        "prompt_len": args.prompt_len, "reps": args.reps,
        "median_prefill_ms": {k: round(v * 1e3, 2) for k, v in medians.items()},
        "extra_ms_per_prompt_token": {
            k: round((medians[k] - medians["plain"]) / args.prompt_len * 1e3, 4)
            for k in kinds if k != "plain"},
        "cost_per_prompt_token_vs_plain": {
            k: round(medians[k] / args.prompt_len / plain, 3) for k in kinds if k != "plain"},
        "scheduler_charge_per_token": round(engine.model_config.logits_row_cost, 3),
    }
    print(json.dumps(report, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
