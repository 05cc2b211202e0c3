"""What every route of one app shares: the engine bridge, the served names and the checks.

Routes reach it through the `StateDep` dependency (it lives on `app.state`), so the
routers are plain module-level objects and one process can hold several apps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from ..model.tokenizer import chat_prompt_ids
from ..sampling_params import SamplingParams
from ..structured import build_grammar
from ..structured_outputs import CompileLimits
from .async_engine import AsyncEngine
from .config import RequestLimits
from .engine_call import Generation
from .engine_errors import EngineDeadError, QueueFullError
from .errors import APIError, bad_value
from .limits import check_request_limits
from .streaming import ClientGone, unless_disconnected
from .tokenizers import TokenizerPool
from .tools import ToolUse

T = TypeVar("T")


def token_decoder(tokenizer: Any) -> Callable[[int], str]:
    """One token id -> its text (special tokens kept), for logprobs."""
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


class ServerState:
    """One app's engine (an `AsyncEngine`), its served model names, request checks and
    the tokenizer pool that keeps tokenizer work off the event loop."""

    def __init__(self, engine: AsyncEngine, names: list[str], root: str | None,
                 limits: RequestLimits | None = None, tokenizer_threads: int = 2) -> None:
        self.engine = engine
        self.names = names
        self.root = root
        self.limits = limits or RequestLimits()
        self.tokenizers = TokenizerPool(engine.engine.tokenizer, tokenizer_threads)
        grammars = getattr(engine.engine, "grammars", None)  # a test's fake engine has none
        if grammars is not None:  # this server's compile bounds (flags), and their metrics
            grammars.limits = CompileLimits(**{f.name: getattr(self.limits, f.name)
                                               for f in dataclasses.fields(CompileLimits)})
            engine.metrics.watch_grammars(grammars)
        self.created = int(time.time())

    @property
    def llm_engine(self) -> Any:
        """The `LLMEngine` itself: only its tokenizer and limits are read from here."""
        return self.engine.engine

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.names:
            return self.names[0] if model is None else model
        raise APIError(404, f"The model `{model}` does not exist. Served: "
                       f"{', '.join(self.names)}", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, f"the engine has stopped ({self.engine.dead_reason})",
                           "server_error", code="engine_dead")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.llm_engine.model_config.vocab_size
        if any(t >= vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param,
                           code="invalid_value")

    def check_request(self, body: Any, num_prompts: int = 1) -> tuple[str, SamplingParams]:
        """The served model's name and the request's validated sampling parameters,
        within this server's limits."""
        model = self.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise bad_value(exc) from exc
        check_request_limits(self.limits, params, num_prompts)
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        return model, params

    async def prepare_constraint(self, params: SamplingParams,
                                 tools: ToolUse | None = None) -> None:
        """Checks the request's constraint and its tools' parameter schemas (off the event
        loop): a 400 naming the field if one is invalid, before the request is queued."""
        if params.structured_outputs is None and tools is None:
            return

        def check() -> None:
            for schema in [] if tools is None else tools.parameter_schemas():
                build_grammar(schema)
            if params.structured_outputs is not None:
                # Checked only: the compile starts once the engine accepts the request.
                self.llm_engine.grammars.check(params.structured_outputs)
        try:
            await asyncio.to_thread(check)
        except ValueError as exc:
            raise bad_value(exc) from exc

    # ---- tokenizer work, on the pool's threads ------------------------------------
    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` off the event loop, with a tokenizer of its own."""
        return await self.tokenizers.run(fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.offload(
            lambda tok: list(tok(text, add_special_tokens=add_special_tokens)["input_ids"]))

    async def apply_chat_template(self, conversation: list[dict],
                                  add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None) -> list[int]:
        try:
            return await self.offload(chat_prompt_ids, conversation, add_generation_prompt,
                                      tools)
        except Exception as exc:  # jinja errors: e.g. roles the template refuses
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages",
                           code="invalid_value") from exc

    async def decode(self, ids: list[int]) -> str:
        return await self.offload(lambda tok: tok.decode(ids, skip_special_tokens=False))

    async def start(self, request_id: str, prompts: Sequence[str | list[int]], params: Any,
                    arrival: float, raw: Request | None = None) -> Generation:
        """Submits one engine request per prompt; refusals become OpenAI errors. `raw`: the
        HTTP request, whose client leaving during a grammar's compile aborts the call."""
        self.check_alive()
        gen = Generation(self.engine, request_id, list(prompts), params, arrival)
        try:
            await gen.start()
        except ValueError as exc:
            raise bad_value(exc, "prompt") from exc
        except QueueFullError as exc:
            raise APIError(503, str(exc), "server_error", code="queue_full") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        spec = getattr(params, "structured_outputs", None)
        if spec is not None:
            await self._compiled(gen, spec, raw)
        return gen

    async def _compiled(self, gen: Generation, spec: Any, raw: Request | None) -> None:
        """Waits for the accepted request's grammar: a 400 naming the field if a compile
        bound stopped it (nothing was streamed yet). Holding nothing, the wait does not
        keep a compile going that the engine gave up; a client that leaves meanwhile has
        its requests aborted, which stops a compile no one else waits for."""
        outcome = self.llm_engine.grammars.watch(spec)
        if outcome is None:
            return
        wait = asyncio.wrap_future(outcome)
        try:
            await (wait if raw is None else unless_disconnected(raw, wait))
        except ClientGone:
            gen.abort()
            raise APIError(499, "the client closed the request", code="client_gone") from None
        except ValueError as exc:
            gen.abort()
            raise bad_value(exc) from exc
        except Exception:  # noqa: BLE001 - e.g. a compile process died: the engine ends it
            pass


def get_state(request: Request) -> ServerState:
    """The FastAPI dependency that hands a route its app's state."""
    return request.app.state.stallfree


# How a route asks for its app's state: a parameter `state: StateDep`.
StateDep = Annotated[ServerState, Depends(get_state)]
