"""`stallfree serve`: flags and the uvicorn runner."""
from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server flags (vLLM's names). Use together with cli.add_engine_args."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="GGUF file or Hugging Face directory (same as --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("STALLFREE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                             "(default: $STALLFREE_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported "
                             f"(default: the model path, or {DEFAULT_SERVED_MODEL_NAME})")
    parser.add_argument("--max-waiting-requests", type=_positive_int, default=None,
                        help="answer 503 while this many sequences wait (default: unbounded)")
    parser.add_argument("--iteration-log", default=None, metavar="PATH",
                        help="write every engine iteration (batch shape, wall and CPU time) "
                             "to PATH as JSON lines; `stallfree simulate replay` reads it")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def _resolve_model(args: argparse.Namespace) -> str | None:
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag and flag and tag != flag:
        raise ValueError(f"two models given: {tag!r} and --model {flag!r}")
    return tag or flag


def run_server(args: argparse.Namespace) -> int:
    """Loads the engine, then serves until interrupted. Returns an exit status."""
    import uvicorn

    from ..cli import engine_kwargs
    from ..iteration_log import IterationLog
    from ..llm import LLM
    from .api import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log = None
    try:
        model = _resolve_model(args)
        args.model = model
        kwargs = engine_kwargs(args)
        # Opened before the model loads, so a bad path fails fast.
        log = IterationLog(args.iteration_log) if args.iteration_log else None
        llm = LLM(**kwargs)
    except (ValueError, OSError) as err:
        if log is not None:
            log.close()
        print(f"stallfree: error: {err}", file=sys.stderr)
        return 2
    if log is not None:
        import torch

        log.header(block_size=llm.engine.config.cache.block_size,
                   threads=torch.get_num_threads(), pipeline_depth=llm.engine.executor.depth)
    names = args.served_model_name or [model or DEFAULT_SERVED_MODEL_NAME]
    app = build_app(llm.engine, names, api_key=args.api_key,
                    max_waiting_requests=args.max_waiting_requests, model_root=model,
                    iteration_log=log)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
    print(f"stallfree: serving {names[0]!r} on http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.Server(config).run()
    finally:
        llm.shutdown()  # worker processes of a parallel engine end with the server
        if log is not None:
            log.close()
    return 0
