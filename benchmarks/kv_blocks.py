"""Decode steps with each request's KV blocks consecutive or scattered, by block size.

Run: .venv/bin/python benchmarks/kv_blocks.py [--batch 32] [--block-sizes 16 32 64]
     [--rounds 5]
A fresh engine hands a prompt consecutive blocks (its free list is FIFO), so decode
attention reads each request's KV sequentially. A server that has run for a while hands
out blocks in the order requests freed or evicted them, scattered over the cache; here
the free list is shuffled before the batch arrives to stand for that. Each cell is the
median decode step (ms) of `batch` requests at 512-token contexts, the variants
interleaved within every round, on a KV cache four times the batch's need.
"""
from __future__ import annotations

import argparse
import random
import statistics

from engine_speed import _prompts

from stallfree import LLM, SamplingParams
from stallfree.executor.hardware import vector_flags
from stallfree.model.llama import kv_cache_bytes_per_token

CONTEXT, STEPS, BUDGET = 512, 8, 2048


def decode_step_ms(llm: LLM, batch: int, scattered: bool, seed: int) -> float:
    max_tokens = STEPS + -(-batch * CONTEXT // BUDGET) + 2
    per_token = kv_cache_bytes_per_token(llm.engine.model_config, llm.engine.dtype)
    llm.reconfigure(token_budget=BUDGET, max_num_seqs=max(128, batch),
                    kv_cache_memory=4 * batch * (CONTEXT + max_tokens + 16) * per_token)
    free = llm.engine.scheduler.block_manager._free
    if scattered:
        order = list(free)
        random.Random(seed).shuffle(order)
        free.clear()
        free.extend(order)
    llm.engine.iterations.clear()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(_prompts(batch, CONTEXT, batch), params)
    steps = [r.end - r.start for r in llm.engine.iterations
             if r.num_prefill_tokens == 0 and r.num_seqs == batch]
    return statistics.median(steps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    llms = {size: LLM(max_model_len=4096, block_size=size) for size in args.block_sizes}
    engine = next(iter(llms.values())).engine
    flags = vector_flags()
    print(f"{engine.dtype}, batch {args.batch} at {CONTEXT}-token contexts; CPU flags: "
          f"{flags}")
    cells = {(size, scattered): [] for size in args.block_sizes for scattered in (False, True)}
    for r in range(args.rounds):
        for (size, scattered), ms in cells.items():
            ms.append(decode_step_ms(llms[size], args.batch, scattered, seed=r))
    print("| block size | consecutive ms | scattered ms | scattered / consecutive |\n"
          "|---|---|---|---|")
    for size in args.block_sizes:
        together, apart = (statistics.median(cells[(size, s)]) for s in (False, True))
        print(f"| {size} | {together:.1f} | {apart:.1f} | {apart / together:.2f}x |")


if __name__ == "__main__":
    main()
