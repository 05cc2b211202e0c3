"""Helpers for the server tests: a real server in a subprocess (or a thread), a fake engine."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from stallfree.bench.systems import ServerProcess as LaunchedServer
from stallfree.bench.systems import System, free_port
from stallfree.executor.base import WorkerError
from stallfree.outputs import (
    CompletionOutput,
    EngineInfo,
    EngineStats,
    IterationRecord,
    RequestOutput,
    StepOutput,
    StepResult,
)


class ServerProcess(LaunchedServer):
    """`python -m stallfree serve ARGS` on a free loopback port; stop() ends it by PID."""

    def __init__(self, *args: str, startup_timeout: float = 240.0) -> None:
        command = [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1",
                   "--port", "{port}", "--uvicorn-log-level", "warning", *args]
        super().__init__(System("stallfree-test", command=command, env={"HF_HUB_OFFLINE": "1"}),
                         startup_timeout)
        self.url = self.base_url

    def stop(self) -> None:
        super().stop(grace=15)
        os.unlink(self.log_path)


async def stream_completion(c: httpx.AsyncClient, body: dict,
                            started: asyncio.Event | None = None) -> tuple[str, str | None]:
    """Streams a completion (`stream` is set here): its text and last finish reason. Fails
    on an error event; sets `started` at the first chunk."""
    text, finish = "", None
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if started is not None:
                started.set()
    return text, finish


class ThreadServer:
    """uvicorn serving `app` in a thread of this process (for fake-engine tests)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} plus {'name': value} summed over label sets."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        values[name + labels] = value
        if labels:
            values[name] = values.get(name, 0.0) + value
    return values


# ---- a fake engine: the LLMEngine surface the server uses, without a model ----------
class FakeTokenizer:
    """One token per character (ids are code points mod 256)."""

    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return self(text + ("<assistant>" if add_generation_prompt else ""))["input_ids"]


@dataclass
class _FakeRequest:
    prompt: list[int]
    params: object
    arrival: float
    outputs: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)
    first_scheduled: float | None = None


class FakeEngine:
    """Generates 'x' tokens, one per step per sequence; `gate` cleared = nothing runs.

    With `gate` cleared, every request stays waiting (to fill the queue);
    `fail` set makes every step raise (an engine crash), `fail_steps` the next so many;
    a prompt starting with "!" fails that request alone at its first step (as if its
    sampling raised). With `text` set, each sequence writes that text instead, a
    character a step, then stops.
    """

    def __init__(self, step_delay: float = 0.01, text: str | None = None) -> None:
        self.text = text
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(vocab_size=256)
        self.max_model_len = 64
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()
        self.fail = threading.Event()
        self.fail_steps = 0
        # Workers that die: the next so many steps raise WorkerError; restart_executor()
        # brings them back (requests keep their state, as recompute would give them).
        self.worker_fail_steps = 0
        self.executor = SimpleNamespace(restartable=True)
        self.restarts = 0
        self._requests: dict[str, _FakeRequest] = {}
        self._stats = EngineStats(0, 0, 0.0, 100, 100)
        self.info = EngineInfo("cpu", "float32", "given", 1)

    def stats(self) -> EngineStats:
        return self._stats

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def reset_prefix_cache(self) -> int:
        self.prefix_cache_resets = getattr(self, "prefix_cache_resets", 0) + 1
        return 3

    def _count(self) -> None:
        live = [r for r in self._requests.values() if any(f is None for f in r.finish)]
        n = lambda rs: sum(r.params.n for r in rs)  # noqa: E731
        running = [r for r in live if r.first_scheduled is not None]
        self._stats = EngineStats(n(running), n(live) - n(running), min(1.0, len(running) / 100),
                                  100, 100)

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, but max_model_len is "
                             f"{self.max_model_len}")
        n = params.n
        self._requests[request_id] = _FakeRequest(list(prompt), params,
                                                  arrival_time or time.monotonic(),
                                                  [[] for _ in range(n)], [None] * n,
                                                  [[] for _ in range(n)])
        self._count()

    def abort_request(self, request_id) -> None:
        self._requests.pop(request_id, None)
        self._count()

    def restart_executor(self) -> list[str]:
        self.restarts += 1
        return list(self._requests)

    def abort_all(self) -> list[str]:
        ids = list(self._requests)
        self._requests.clear()
        self._count()
        return ids

    def has_unfinished_requests(self) -> bool:
        return any(any(f is None for f in r.finish) for r in self._requests.values())

    def step(self) -> StepResult:
        time.sleep(self.step_delay)
        if self.worker_fail_steps > 0:
            self.worker_fail_steps -= 1
            raise WorkerError("worker rank 1 (pid 0) exited with code -9")
        if self.fail.is_set() or self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("simulated engine failure")
        if not self.gate.is_set():
            return StepResult([], [], None)
        now = time.monotonic()
        outs = []
        failed = {rid: "simulated sampling failure" for rid, r in self._requests.items()
                  if r.prompt[:1] == [ord("!")]}
        for rid in failed:
            del self._requests[rid]
        for rid, r in self._requests.items():
            if r.first_scheduled is None:
                r.first_scheduled = now
            for i in range(r.params.n):
                if r.finish[i] is not None:
                    continue
                char = "x" if self.text is None else self.text[len(r.outputs[i])]
                r.outputs[i].append(ord(char))
                r.times[i].append(now)
                if self.text is not None and len(r.outputs[i]) == len(self.text):
                    r.finish[i] = "stop"
                elif len(r.outputs[i]) >= (r.params.max_tokens or 8):
                    r.finish[i] = "length"
                outs.append(StepOutput(rid, i, [ord(char)], char, r.finish[i]))
        finished = [self._release(rid) for rid, r in list(self._requests.items())
                    if all(f is not None for f in r.finish)]
        record = IterationRecord(now, now, 0, len(outs), len(outs), 0,
                                 decode_contexts=(1,) * len(outs))
        self._count()
        return StepResult(outs, finished, record, failed)

    def _release(self, request_id) -> RequestOutput:
        r = self._requests.pop(request_id)
        outs = [CompletionOutput(i, "".join(map(chr, o)), o, r.finish[i], r.times[i])
                for i, o in enumerate(r.outputs)]
        return RequestOutput(request_id, None, r.prompt, outs, r.arrival, r.first_scheduled)
