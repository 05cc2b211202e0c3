"""Async streaming client over the OpenAI completions API that times every output token.

Token counting (one SSE chunk may carry several tokens, or none):

1. Every request asks for `stream_options: {include_usage: true,
   continuous_usage_stats: true}`. vLLM then puts the cumulative
   `usage.completion_tokens` in *every* chunk: the difference between two
   chunks is the exact number of tokens the later one carried (0 or more).
2. A server without continuous usage (stallfree, llama.cpp's server; unknown
   stream_options fields are ignored by both) sends one chunk per token, so a
   chunk with choices counts as one token. A last chunk with empty text and a
   finish_reason is ambiguous (llama.cpp's closing chunk carries no token, a
   stallfree token may decode to no text): it counts only if the final usage
   says one token is still unaccounted for.
3. The final usage chunk (`include_usage`) is the authority on the number of
   output tokens. If the chunks still disagree with it (a server that batches
   tokens into chunks without continuous usage), the request keeps its chunk
   times (one per chunk) and is flagged `token_count_exact = False`; the report
   counts such requests, since their TBT is then per chunk, not per token.

Tokens that arrive in one chunk share its arrival time: the client sees them
at once, so the gaps between them are 0 (this is what a user experiences).

Times are `time.perf_counter()` seconds relative to the start of the run.
The run is bounded in count (the workload) and in time (`max_duration`):
requests not sent by then are failed as "not sent", requests still streaming
are cancelled and failed, keeping what they received.

A conversation (`RequestSpec.follows`) is one task: each turn is sent its think
time after the previous one's last token; a turn that fails ends its
conversation (the later turns fail as "previous turn failed"). The prompt
tokens the server found in its prefix cache come from the final usage
(`prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report them).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from .config import ClientConfig
from .records import RequestResult, RunResult
from .workload import RequestSpec


class ResponseStream:
    """Accumulates one response's chunks (see the module docstring for the rules)."""

    def __init__(self, result: RequestResult) -> None:
        self.r = result
        self.cum_usage: int | None = None  # last cumulative completion_tokens seen
        self.ambiguous_time: float | None = None  # an empty closing chunk, maybe a token
        self.final_usage: dict[str, Any] | None = None

    def chunk(self, data: dict[str, Any], now: float) -> None:
        r = self.r
        if isinstance(data.get("error"), (dict, str)):
            err = data["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else err)
        ext = data.get("metrics")
        if isinstance(ext, dict) and ext.get("scheduling_delay") is not None:
            r.scheduling_delay = float(ext["scheduling_delay"])
        usage = data.get("usage")
        cum = usage.get("completion_tokens") if isinstance(usage, dict) else None
        choices = data.get("choices") or []
        if not choices:
            if isinstance(usage, dict):
                self.final_usage = usage
            return
        if cum is not None and self.cum_usage is None and r.chunk_times:
            # Usage first seen after tokens counted without it: not continuous usage but
            # the final usage on the closing chunk (llama.cpp's server sends it there).
            self.final_usage = usage
            cum = None
        if cum is not None:  # continuous usage: exact tokens in this chunk
            n = cum - (self.cum_usage or 0)
            self.cum_usage = cum
            if n > 0:
                r.chunk_times.append(now)
                r.chunk_tokens.append(n)
            return
        choice = choices[0]
        text = choice.get("text")
        if text is None:  # chat-style chunk
            text = (choice.get("delta") or {}).get("content") or ""
        if not text and choice.get("finish_reason") is not None and r.chunk_times:
            self.ambiguous_time = now
            return
        r.chunk_times.append(now)
        r.chunk_tokens.append(1)

    def finish(self) -> None:
        r = self.r
        counted = sum(r.chunk_tokens)
        usage = self.final_usage
        reported = usage.get("completion_tokens") if usage else None
        if usage and usage.get("prompt_tokens") is not None:
            r.usage_prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") if usage else None
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            r.usage_cached_tokens = int(details["cached_tokens"])
        if reported is None and self.cum_usage is not None:
            reported = self.cum_usage
        if self.ambiguous_time is not None and reported == counted + 1:
            r.chunk_times.append(self.ambiguous_time)
            r.chunk_tokens.append(1)
            counted += 1
        if reported is not None:
            r.output_len = int(reported)
            r.token_count_exact = counted == r.output_len
        else:
            r.output_len = counted


class StreamError(Exception):
    pass


def _body(spec: RequestSpec, cfg: ClientConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"include_usage": True}
    if cfg.continuous_usage:
        options["continuous_usage_stats"] = True
    body: dict[str, Any] = {"prompt": spec.prompt_token_ids, "max_tokens": spec.output_len,
                            "stream": True, "stream_options": options,
                            "temperature": cfg.temperature}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.ban_token_ids:
        body["logit_bias"] = {str(t): -100 for t in cfg.ban_token_ids}
    body.update(cfg.extra_body)
    return body


async def _one(client: httpx.AsyncClient, spec: RequestSpec, cfg: ClientConfig, t0: float,
               result: RequestResult, slots: asyncio.Semaphore | None) -> None:
    body = _body(spec, cfg)
    stream = ResponseStream(result)
    try:
        if slots is not None:
            await slots.acquire()
        try:
            result.send_time = time.perf_counter() - t0
            async with client.stream("POST", cfg.url, json=body,
                                     timeout=cfg.request_timeout) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise StreamError(f"HTTP {resp.status_code}: {text[:300]}")
                async for line in resp.aiter_lines():
                    now = time.perf_counter() - t0
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments, event names
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    stream.chunk(json.loads(payload), now)
        finally:
            if slots is not None:
                slots.release()
        stream.finish()
        result.success = result.output_len > 0 and bool(result.chunk_times)
        if not result.success:
            result.error = "no output tokens"
    except asyncio.CancelledError:
        stream.finish()
        result.error = "cancelled at the time limit"
    except (StreamError, httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        stream.finish()
        result.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, StreamError) \
            else str(exc)


async def _conversation(client: httpx.AsyncClient, first: RequestSpec,
                        next_turn: dict[int, RequestSpec], cfg: ClientConfig, t0: float,
                        results: dict[int, RequestResult], slots: asyncio.Semaphore | None,
                        done: Any) -> None:
    """Sends `first`, then each later turn its think time after the previous one ended."""
    spec: RequestSpec | None = first
    while spec is not None:
        result = results[spec.index]
        await _one(client, spec, cfg, t0, result, slots)
        done()
        nxt = next_turn.get(spec.index)
        if nxt is None:
            return
        late = "not sent before the time limit"
        reason = None
        if result.error == "cancelled at the time limit":
            reason = late
        elif not result.success:
            reason = "previous turn failed"
        else:
            try:
                await asyncio.sleep(nxt.think_time)
            except asyncio.CancelledError:  # the run's time is up
                reason = late
            due = time.perf_counter() - t0
            results[nxt.index].scheduled_time = due
            if cfg.max_duration is not None and due >= cfg.max_duration:
                reason = late
        if reason is not None:
            while nxt is not None:
                results[nxt.index].error = reason
                done()
                nxt = next_turn.get(nxt.index)
        spec = nxt


async def run_async(specs: list[RequestSpec], cfg: ClientConfig) -> RunResult:
    """Sends every request at its arrival time (a later turn of a conversation, its think
    time after the previous turn) and waits for all (within max_duration)."""
    from tqdm import tqdm

    results = [RequestResult(s.index, s.prompt_len, s.output_len, s.arrival, turn=s.turn)
               for s in specs]
    by_index = {r.index: r for r in results}
    next_turn = {s.follows: s for s in specs if s.follows is not None}
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(specs), disable=not cfg.progress, unit="req", dynamic_ncols=True)
    start_unix = time.time()
    t0 = time.perf_counter()
    deadline = cfg.max_duration
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=cfg.request_timeout,
                                 trust_env=False) as client:
        for spec in specs:
            if spec.follows is not None:
                continue  # sent by its conversation's task
            if deadline is not None and spec.arrival >= deadline:
                turn: RequestSpec | None = spec
                while turn is not None:
                    by_index[turn.index].error = "not sent before the time limit"
                    bar.update(1)
                    turn = next_turn.get(turn.index)
                continue
            delay = spec.arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_conversation(
                client, spec, next_turn, cfg, t0, by_index, slots, lambda: bar.update(1))))
        if tasks:
            left = None if deadline is None else max(0.0, deadline - (time.perf_counter() - t0))
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    bar.close()
    ends = [r.chunk_times[-1] for r in results if r.chunk_times]
    sends = [r.send_time for r in results if r.send_time is not None]
    duration = (max(ends) - min(sends)) if ends and sends else time.perf_counter() - t0
    return RunResult(results, duration, start_unix)


def run(specs: list[RequestSpec], cfg: ClientConfig) -> RunResult:
    return asyncio.run(run_async(specs, cfg))
