"""Engines that differ in settings, side by side in one run: decode steps and prefill speed.

Run: .venv/bin/python benchmarks/settings_ab.py [--dtype float32] [--model PATH]
     [--batches 1,8,32] [--context 512] [--rounds 5] [--chunk 512] [--no-prefill]
     [--configs quantization=none quantization=auto]
e.g. the int8 KV cache against the float one, on dequantized weights:
     .venv/bin/python benchmarks/settings_ab.py --batches 32 --no-prefill \
         --configs quantization=none quantization=none,kv_cache_dtype=int8

Each config (`key=value,key=value`, engine settings by the names LLM takes, over --dtype)
loads one engine on the same model (default: the default model's Q4_1 GGUF, which
`quantization=auto` keeps quantized and `none` dequantizes to --dtype). The engines are
measured in interleaved rounds: the decode step at each batch size with --context-token
contexts, and prefill tokens/s of a 2048-token prompt in chunks of --chunk. Each row is the
median over rounds, each ratio taken from those medians against the first config.
"""
from __future__ import annotations

from stallfree import LLM

# isort: split
import argparse
import statistics

import torch
from engine_speed import decode_step_seconds, prefill_tokens_per_second
from perplexity import parse_config

from stallfree.executor.hardware import vector_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512, help="tokens per decode context")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--no-prefill", action="store_true", help="decode steps only")
    parser.add_argument("--configs", nargs="+", metavar="K=V[,K=V]",
                        default=["quantization=none", "quantization=auto"])
    args = parser.parse_args()
    engines = {config: LLM(args.model, max_model_len=4096,
                           **{"dtype": args.dtype, **parse_config(config)})
               for config in args.configs}
    print(f"CPU flags: {vector_flags()}; dtype {args.dtype}; {torch.get_num_threads()} threads")
    for config, llm in engines.items():
        held = sum(llm.engine.executor.model.held_bytes().values()) / 1e6
        print(f"{config}: weights held {held:.0f} MB, "
              f"{llm.engine.block_manager.num_total_blocks} KV blocks")
    print(f"median of {args.rounds} interleaved rounds\n")
    first, *others = args.configs
    print(f"| measure | {' | '.join(args.configs)} | "
          f"{' | '.join(f'{c} / {first}' for c in others)} |")
    print(f"|---|{'---|' * (2 * len(args.configs) - 1)}")
    rows = [(f"decode step, batch {b}, {args.context}-token contexts (ms)",
             lambda llm, b=int(b): decode_step_seconds(llm, b, args.context, steps=8) * 1e3)
            for b in args.batches.split(",")]
    if not args.no_prefill:
        rows.append((f"prefill, 2048-token prompt in chunks of {args.chunk} (tokens/s)",
                     lambda llm: prefill_tokens_per_second(llm, args.chunk, 2048)))
    for name, measure in rows:
        values: dict[str, list[float]] = {c: [] for c in engines}
        for _ in range(args.rounds):
            for config, llm in engines.items():
                values[config].append(measure(llm))
        medians = [statistics.median(values[c]) for c in args.configs]
        ratios = " | ".join(f"{m / medians[0]:.2f}x" for m in medians[1:])
        print(f"| {name} | {' | '.join(f'{m:.1f}' for m in medians)} | {ratios} |", flush=True)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
