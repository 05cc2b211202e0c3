"""Command line: `stallfree generate ...` (also `python -m stallfree`).

Every flag of every command is made here, one module per command (each with
`add_parser(subparsers)` and `run(args) -> int`); the packages below take config
objects and know nothing of argparse. `args.py` holds the shared pieces.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, convert, generate, info, profile, serve, simulate, worker
from .args import add_engine_args, add_setting_args, engine_config_from_args, engine_kwargs

__all__ = ["add_engine_args", "add_setting_args", "build_parser", "engine_config_from_args",
           "engine_kwargs", "main"]

# In the order `stallfree --help` lists them.
COMMANDS = {"serve": serve, "generate": generate, "worker": worker, "bench": bench,
            "convert": convert, "simulate": simulate, "profile": profile, "info": info}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stallfree", description="Command line: `stallfree generate ...` "
                                      "(also `python -m stallfree`).")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except ValueError as err:
        print(f"stallfree: error: {err}", file=sys.stderr)
        return 2
