"""`stallfree generate`: complete prompts offline and print the results."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ..sampling_params import SamplingParams
from .args import (
    add_engine_args,
    add_profile_arg,
    engine_config_from_args,
    engine_kwargs,
    slo_cost_seed,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="complete prompts offline and print the results")
    add_engine_args(gen)
    add_profile_arg(gen)
    # A command-line run wants more than SamplingParams' 16 tokens, and greedy by default.
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    gen.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate max-tokens regardless of EOS")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    return gen


def run(args: argparse.Namespace) -> int:
    from ..llm import LLM  # torch loads only when a command needs it

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    seed = slo_cost_seed(args, engine_config_from_args(args))
    with LLM(cost_seed=seed, **engine_kwargs(args)) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outputs = llm.generate(args.prompts, params)
        info = llm.engine.info
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({
                "prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
                "ttft": out.ttft, "tbt": out.tbt,
                "scheduling_delay": (out.first_scheduled_time - out.arrival_time
                                     if out.first_scheduled_time else None),
                "dtype": info.dtype, "dtype_reason": info.dtype_reason,
                "huge_pages": info.huge_pages,
                "kernels": {op: impl for op, impl, _ in info.kernels}}))
        else:
            print(f"--- {prompt}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens, "
                  f"TTFT {out.ttft:.3f}s]")
    return 0
