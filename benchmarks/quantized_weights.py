"""Weights kept quantized against the same weights dequantized, side by side in one run.

Run: .venv/bin/python benchmarks/quantized_weights.py [--dtype float32] [--model PATH]
     [--batches 1,8,32] [--rounds 5] [--chunk 512]

Two engines on one GGUF file (default: the default model's Q4_1 file), `quantization=auto`
(its Q4/Q8 weights stay quantized, csrc/quant_linear.cpp) and `quantization=none`
(dequantized to --dtype at load, the float kernels), measured in interleaved rounds: the
decode step at each batch size with 512-token contexts, and prefill tokens/s of a
2048-token prompt in chunks of --chunk. Each row is the median over rounds, the ratio taken
from those medians.
"""
from __future__ import annotations

from stallfree import LLM

# isort: split
import argparse
import statistics

import torch
from engine_speed import decode_step_seconds, prefill_tokens_per_second

from stallfree.executor.hardware import vector_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    engines = {q: LLM(args.model, max_model_len=4096, dtype=args.dtype, quantization=q)
               for q in ("none", "auto")}
    held = {q: sum(llm.engine.executor.model.held_bytes().values()) / 1e6
            for q, llm in engines.items()}
    print(f"CPU flags: {vector_flags()}; dtype {args.dtype}; {torch.get_num_threads()} threads")
    print(f"weights held: none {held['none']:.0f} MB, auto {held['auto']:.0f} MB "
          f"({held['auto'] / held['none']:.2f}x)")
    print(f"median of {args.rounds} interleaved rounds\n")
    print("| measure | dequantized (none) | quantized (auto) | auto / none |\n|---|---|---|---|")
    rows = [(f"decode step, batch {b}, 512-token contexts (ms)",
             lambda llm, b=int(b): decode_step_seconds(llm, b, 512, steps=8) * 1e3)
            for b in args.batches.split(",")]
    rows.append((f"prefill, 2048-token prompt in chunks of {args.chunk} (tokens/s)",
                 lambda llm: prefill_tokens_per_second(llm, args.chunk, 2048)))
    for name, measure in rows:
        values: dict[str, list[float]] = {q: [] for q in engines}
        for _ in range(args.rounds):
            for q, llm in engines.items():
                values[q].append(measure(llm))
        none, auto = (statistics.median(values[q]) for q in ("none", "auto"))
        print(f"| {name} | {none:.1f} | {auto:.1f} | {auto / none:.2f}x |", flush=True)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
