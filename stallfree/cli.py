"""Command line: `stallfree generate ...` (also `python -m stallfree`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Callable, Sequence

from .config import EngineConfig, engine_setting_fields, setting_fields
from .sampling_params import SamplingParams

def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__
    return convert


def add_setting_args(parser: argparse.ArgumentParser, fields: list[dataclasses.Field]) -> None:
    """One flag per config field, with the field's default, help, choices and parser."""
    for f in fields:
        meta = f.metadata
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kind = meta["parse"] or (type(default) if default is not None else str)
        help_text = meta["help"].replace("%", "%%")
        parser.add_argument(*flags, dest=f.name, default=default, type=_flag_type(kind),
                            choices=meta["choices"], help=help_text, nargs=meta["nargs"],
                            metavar=meta["metavar"])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names follow vLLM's)."""
    add_setting_args(parser, engine_setting_fields())


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in engine_setting_fields()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .server import ServerConfig  # light: no fastapi or torch until run

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="GGUF file or Hugging Face directory (same as --model)")
    add_setting_args(srv, setting_fields(ServerConfig))
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
            from .server import ServerConfig, serve

            if args.model_tag and args.model and args.model_tag != args.model:
                raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
            engine_config = EngineConfig.from_kwargs(
                **{**engine_kwargs(args), "model": args.model_tag or args.model})
            return serve(engine_config, ServerConfig(
                **{f.name: getattr(args, f.name) for f in setting_fields(ServerConfig)}))
    except ValueError as err:
        print(f"stallfree: error: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
