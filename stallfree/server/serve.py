"""`stallfree serve`'s runner: the engine, the app and uvicorn, from two configs."""
from __future__ import annotations

import gc
import logging
import sys
import time

from .. import env
from ..config import EngineConfig
from ..scheduler.cost_fit import OnlineCost
from .config import ServerConfig

GC_FREEZE_SWITCH = env.GC_FREEZE  # "0": the start-up objects stay in the GC's passes


def freeze_startup_heap() -> tuple[int, float]:
    """Keeps what start-up built out of the cyclic GC's full passes; returns (objects
    frozen, seconds the full pass over them took first).

    The model's modules, the tokenizer's tables and the app are ~300K tracked objects.
    A full pass walks all of them holding the GIL: 125-160 ms on a 2-core EPYC, a stall
    of every running request's next token, and Python runs one whenever the objects that
    survived since the last reach a quarter of the total: under load at 10 requests/s,
    every one to two minutes. Frozen, a full pass walks only what serving created
    (docs/benchmarks.md). Frozen objects are still freed once unreferenced; only cycles
    among them are never collected, and a server keeps its start-up objects anyway."""
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    gc.freeze()
    return gc.get_freeze_count(), seconds


def serve(engine_config: EngineConfig, server_config: ServerConfig,
          cost_seed: OnlineCost | None = None) -> int:
    """Loads the engine, then serves until interrupted. Returns an exit status
    (2, with the reason on stderr, when a setting or a file is refused). `cost_seed`:
    the TBT SLO's starting cost model (default: calibrated at start-up)."""
    # Heavy imports here, so that `import stallfree.server` stays cheap for the CLI.
    import uvicorn

    from ..engine import LLMEngine
    from ..iteration_log import IterationLog
    from .api import build_app
    from .connections import accept_backlog, fitted_limits, guarded_protocol, raise_fd_limit
    from .engine_thread import EngineThread
    from .tool_parser_registry import choose_tool_parser

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log = None
    # The engine is built on the thread that will step it: all tensor work on one thread.
    engine_thread = EngineThread()
    try:
        # Opened before the model loads, so a bad path fails fast.
        log = IterationLog(server_config.iteration_log) if server_config.iteration_log else None
        engine = engine_thread.run(LLMEngine, engine_config, cost_seed)
    except (ValueError, OSError) as err:
        if log is not None:
            log.close()
        print(f"stallfree: error: {err}", file=sys.stderr)
        return 2
    try:
        if log is not None:
            import torch

            try:
                sched = engine.config.scheduler
                log.header(block_size=engine.config.cache.block_size,
                           threads=torch.get_num_threads(), pipeline_depth=engine.executor.depth,
                           tbt_slo=sched.tbt_slo, tbt_slo_margin=sched.tbt_slo_margin)
            except OSError as err:  # e.g. a full disk: serve without the log
                logging.getLogger("stallfree.server").error(
                    "cannot write the iteration log (%s); serving without it", err)
                log.close_quietly()
                log = None
        names = server_config.served_names(engine_config.model)
        server: list[uvicorn.Server] = []  # filled below, once the app exists

        def stop_serving() -> None:
            """The engine died for good: stop, so that the process exits non-zero and its
            supervisor restarts it (rather than answering 503 forever)."""
            if server:
                server[0].should_exit = True

        app = build_app(engine, names, api_key=server_config.api_key,
                        max_waiting_requests=server_config.max_waiting_requests,
                        model_root=engine_config.model, iteration_log=log,
                        limits=server_config.limits(),
                        public_metrics=server_config.public_metrics,
                        tokenizer_threads=server_config.tokenizer_threads,
                        on_fatal=stop_serving, engine_thread=engine_thread)
        # How the model writes tool calls, chosen (and logged) at start-up.
        app.state.tool_parser = choose_tool_parser(server_config.tool_call_parser,
                                                   engine.tokenizer)
        host, port = server_config.host, server_config.port
        # Connections bounded below the open-file limit, and their header wait.
        fd_limit = raise_fd_limit()
        connections = fitted_limits(server_config.connection_limits(), fd_limit)
        config = uvicorn.Config(app, host=host, port=port,
                                log_level=server_config.uvicorn_log_level,
                                timeout_graceful_shutdown=5, backlog=accept_backlog(fd_limit),
                                http=guarded_protocol(connections))
        server.append(uvicorn.Server(config))
        async_engine = app.state.stallfree.engine
        # The engine runs from build_app on: one that died before `server` was filled
        # found stop_serving a no-op, so look now. From here on stop_serving reaches the
        # server, and uvicorn honours a should_exit set before it runs.
        if not async_engine.is_dead:
            if env.gc_freeze():
                frozen, seconds = freeze_startup_heap()
                logging.getLogger("stallfree.server").info(
                    "%d start-up objects frozen out of the cyclic GC's full passes (one "
                    "over them took %.0f ms; %s=0 leaves them to it)", frozen, seconds * 1e3,
                    GC_FREEZE_SWITCH)
            print(f"stallfree: serving {names[0]!r} on http://{host}:{port}", flush=True)
            server[0].run()
        if async_engine.crashed:
            print(f"stallfree: error: {async_engine.dead_reason}", file=sys.stderr)
            return 1
    finally:
        engine.shutdown()  # worker processes of a parallel engine end with the server
        if log is not None:
            log.close_quietly()
    return 0
