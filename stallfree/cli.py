"""Command line: `stallfree generate ...` (also `python -m stallfree`)."""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

from .config import POLICIES
from .sampling_params import SamplingParams

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1e9'-free plain bytes -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 512MiB or 2GiB)")
    unit = (match.group(2) or "").lower().rstrip("b")
    return int(float(match.group(1)) * _UNITS[unit])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names follow vLLM's)."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--policy", default="sarathi", choices=POLICIES)
    parser.add_argument("--token-budget", "--max-num-batched-tokens", dest="token_budget",
                        type=int, default=512, help="tokens computed per iteration")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="KV cache size, e.g. 1GiB (default: 1GiB on CPU, most of free GPU memory)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                        help="split every layer over N worker processes")
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                        help="split the layers into M pipeline stages (M micro-batches in flight)")
    parser.add_argument("--num-local-workers", type=int, default=None,
                        help="ranks started here (default: all); the rest join with "
                             "`stallfree worker` from other machines")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, policy=args.policy, token_budget=args.token_budget,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                dtype=args.dtype, device=args.device, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                num_local_workers=args.num_local_workers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .server import add_serve_args  # light: no fastapi or torch until run

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(srv)
    add_serve_args(srv)
    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--ignore-eos", action="store_true", help="generate max-tokens regardless of EOS")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    sub.add_parser("worker", help="one tensor/pipeline-parallel rank, for multi-machine runs "
                   "(reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)")
    from .bench.cli import add_bench_args
    from .bench.convert import add_convert_args

    from .sim.cli import add_simulate_args
    from .sim.profile import add_profile_args

    add_bench_args(sub)
    add_convert_args(sub)
    add_simulate_args(sub)
    add_profile_args(sub)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM  # torch loads only when a command needs it

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    with LLM(**engine_kwargs(args)) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({
                "prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
                "ttft": out.ttft, "tbt": out.tbt,
                "scheduling_delay": (out.first_scheduled_time - out.arrival_time
                                     if out.first_scheduled_time else None)}))
        else:
            print(f"--- {prompt}\n{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens, "
                  f"TTFT {out.ttft:.3f}s]")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "worker":
            from .distributed.worker import main as worker_main

            return worker_main()
        if args.command == "bench":
            from .bench.cli import run_bench

            return run_bench(args)
        if args.command == "simulate":
            from .sim.cli import run_simulate

            return run_simulate(args)
        if args.command == "profile":
            from .sim.profile import run_profile

            return run_profile(args)
        if args.command == "convert":
            from .bench.convert import run_convert

            return run_convert(args)
        if args.command == "serve":
            from .server import run_server

            return run_server(args)
    except ValueError as err:
        print(f"stallfree: error: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
