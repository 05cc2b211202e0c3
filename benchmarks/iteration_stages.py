"""Where an iteration's time goes under load: scheduling, input preparation, forward,
logits and sampling, and the engine's bookkeeping, per iteration kind.

Run: .venv/bin/python benchmarks/iteration_stages.py [--requests 32] [--prompt-len 256]
     [--output-len 64] [--token-budget 512] [--temperature 0.8] [--dtype auto]

All requests are submitted at once to the offline engine, so iterations run loaded: first
prefill chunks beside growing decode batches (mixed), then decodes alone. Each stage is
timed by wrapping the function that does it (a timer costs ~1 us, against iterations of
tens of ms):

- schedule: `next_micro_batch` (the policy, block allocation, prefix lookups);
- inputs: the runner's work before the forward: token and position lists, KV block
  cleaning, attention metadata;
- forward: the decoder layers (`CausalLM.forward`);
- logits + sampling: the LM head over the sampled rows, the sampler, logprobs;
- bookkeeping: the rest of `LLMEngine.step`: applying tokens, stop checks,
  detokenizing, outputs, the iteration record.

Medians per iteration kind over the whole run, with the CPU's flags printed beside.
"""
from __future__ import annotations

# stallfree before torch, as `stallfree serve` imports them: its import asks torch for huge
# pages, which torch reads only as it loads (stallfree/huge_pages.py).
from stallfree import LLM, SamplingParams

# isort: split
import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from stallfree import engine as engine_module
from stallfree.executor import model_runner
from stallfree.executor.hardware import vector_flags

STAGES = ("schedule", "inputs", "forward", "logits + sampling", "bookkeeping")


class StageClock:
    """Seconds spent in each wrapped function during the current iteration."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start
        return timed

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def instrument(llm: LLM, clock: StageClock) -> None:
    runner = llm.engine.executor.runner
    engine_module.next_micro_batch = clock.wrap("schedule", engine_module.next_micro_batch)
    runner.execute = clock.wrap("execute", runner.execute)
    model = runner.model
    model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("logits", model.compute_logits)  # the LM head
    runner.sampler = clock.wrap("sampling", runner.sampler)
    model_runner.token_logprobs = clock.wrap("sampling", model_runner.token_logprobs)


def split(step: float, t: dict[str, float]) -> dict[str, float]:
    execute, forward = t.get("execute", 0.0), t.get("forward", 0.0)
    sampling = t.get("logits", 0.0) + t.get("sampling", 0.0)
    return {"schedule": t.get("schedule", 0.0), "inputs": execute - forward - sampling,
            "forward": forward, "logits + sampling": sampling,
            "bookkeeping": step - execute - t.get("schedule", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    llm = LLM(max_model_len=args.prompt_len + args.output_len + 16, dtype=args.dtype,
              token_budget=args.token_budget, max_num_seqs=max(args.requests, 1))
    engine = llm.engine
    clock = StageClock()
    instrument(llm, clock)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True, seed=0)
    prompts = [[(i * 104729 + j * 7919) % 40000 + 100 for j in range(args.prompt_len)]
               for i in range(args.requests)]
    llm.generate(prompts[:2], params)  # warm-up
    engine.iterations.clear()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    clock.take()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        result = engine.step()
        step = time.perf_counter() - start
        times = clock.take()
        record = result.record
        if record is None:
            continue
        kind = "decodes only" if record.num_prefill_tokens == 0 else "mixed (prefill chunks)"
        rows[kind].append({**split(step, times), "total": step, "seqs": record.num_seqs})
    flags = vector_flags()
    print(f"dtype {engine.dtype}, {torch.get_num_threads()} threads, {args.requests} requests "
          f"x {args.prompt_len}-token prompts, {args.output_len} outputs, budget "
          f"{args.token_budget}, temperature {args.temperature}; CPU flags: {flags}")
    print("| iterations | n | median seqs | " + " | ".join(STAGES) + " | total ms |")
    print("|---|---:|---:|" + "---:|" * (len(STAGES) + 1))
    for kind, items in rows.items():
        med = {k: statistics.median(r[k] for r in items) for k in (*STAGES, "total", "seqs")}
        cells = " | ".join(f"{med[s] * 1e3:.2f} ({100 * med[s] / med['total']:.0f}%)"
                           for s in STAGES)
        print(f"| {kind} | {len(items)} | {med['seqs']:.0f} | {cells} | "
              f"{med['total'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
