"""`stallfree serve`: the engine's flags, the server's (`ServerConfig`), and a positional MODEL."""
from __future__ import annotations

import argparse
from typing import Any

from ..config import setting_fields
from .args import (
    add_engine_args,
    add_profile_arg,
    add_setting_args,
    engine_config_from_args,
    settings_from_args,
    slo_cost_seed,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    srv = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(srv)
    add_profile_arg(srv)
    from ..server.config import ServerConfig  # light: no fastapi or torch until run

    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="GGUF file or Hugging Face directory (same as --model)")
    add_setting_args(srv, setting_fields(ServerConfig))
    return srv


def _model(args: argparse.Namespace) -> str | None:
    """The positional MODEL or --model (the same one if both are given)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


def run(args: argparse.Namespace) -> int:
    from ..server import ServerConfig, serve

    engine_config = engine_config_from_args(args, model=_model(args))
    return serve(engine_config, ServerConfig(**settings_from_args(ServerConfig, args)),
                 slo_cost_seed(args, engine_config))
