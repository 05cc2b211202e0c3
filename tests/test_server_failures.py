"""Server failure paths on a fake engine (no model): API key, full queue, engine crash.

A real uvicorn serves the app from a thread of this process; the fake engine
lets each test pause, fill or crash the engine at will.
"""
from __future__ import annotations

import asyncio
import errno
import io
import json
import time

import httpx
import pytest

from server_utils import FakeEngine, scrape
from stallfree.iteration_log import IterationLog
from stallfree.server.async_engine import MAX_CONSECUTIVE_FAILURES, MAX_WORKER_RESTARTS
from stallfree.server.config import RequestLimits

MODEL = "fake"


def _is_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_api_key_guards_every_route_but_health(serve):
    engine = FakeEngine()
    server = serve(engine, api_key="sekret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        _is_error(c.post("/v1/completions", json=body), 401)
        _is_error(c.post("/v1/completions", json=body,
                         headers={"Authorization": "Bearer wrong"}), 401)
        _is_error(c.get("/v1/models"), 401)
        _is_error(c.post("/v1/chat/completions", content=b"{not json"), 401)  # auth comes first
        _is_error(c.post("/reset_prefix_cache"), 401)
        assert getattr(engine, "prefix_cache_resets", 0) == 0
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                             ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/version"),
                             ("GET", "/nothing-here")):
            _is_error(c.request(method, path, json={"prompt": "hi"}), 401)
        ok = {"Authorization": "Bearer sekret"}
        r = c.post("/reset_prefix_cache", headers=ok)
        assert r.status_code == 200 and r.json() == {"status": "ok", "num_cached_blocks": 3}
        assert engine.prefix_cache_resets == 1
        r = c.post("/v1/completions", json=body, headers=ok)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        assert c.post("/tokenize", json={"prompt": "hi"}, headers=ok).json()["count"] == 2
        assert c.get("/metrics", headers=ok).status_code == 200
        assert c.get("/openapi.json", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200  # for load balancers, without a key
    scraped = serve(FakeEngine(), api_key="sekret", public_metrics=True)
    with httpx.Client(base_url=scraped.url, timeout=10) as c:
        assert c.get("/metrics").status_code == 200
        _is_error(c.get("/v1/models"), 401)


LIMITS = RequestLimits(max_body_bytes=4000, max_prompts=3, max_sequences=4,
                       max_stop_strings=2, max_stop_length=5, max_stop_token_ids=2,
                       max_logprobs=3)
OVER_LIMITS = [
    # (what, path, body, param, the flag named)
    ("prompts", "/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "max-prompts"),
    ("prompts x n", "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n",
     "max-sequences"),
    ("chat n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "n": 5}, "n", "max-sequences"),
    ("stop count", "/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop",
     "max-stop-strings"),
    ("stop length", "/v1/completions", {"prompt": "a", "stop": ["abcdef"]}, "stop",
     "max-stop-length"),
    ("stop_token_ids", "/v1/completions", {"prompt": "a", "stop_token_ids": [1, 2, 3]},
     "stop_token_ids", "max-stop-token-ids"),
    ("logprobs", "/v1/completions", {"prompt": "a", "logprobs": 4}, "logprobs",
     "max-logprobs"),
    ("chat top_logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 5},
     "logprobs", "max-logprobs"),
]


def test_each_limit_is_answered_400_naming_it(serve):
    engine = FakeEngine()
    server = serve(engine, limits=LIMITS)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for what, path, body, param, flag in OVER_LIMITS:
            err = _is_error(c.post(path, json=body), 400)
            assert err["param"] == param and f"--{flag}" in err["message"], (what, err)
            assert err["code"] == "limit_exceeded"
        # At the limits, everything is served.
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "stop": ["x", "abcde"],
                                            "stop_token_ids": [1, 2], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        # The body: declared too long, or streamed (chunked) past the limit.
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        err = _is_error(c.post("/v1/completions", json=big), 413)
        assert "--max-body-bytes" in err["message"]

        def chunks():
            for _ in range(5):
                yield b" " * 1000
            yield b'{"prompt": "hi"}'

        err = _is_error(c.post("/v1/completions", content=chunks(),
                               headers={"content-type": "application/json"}), 413)
        assert "--max-body-bytes" in err["message"]
        assert c.post("/v1/completions", content=iter([b'{"prompt": ', b'"hi", "max_tokens": 1}']),
                      headers={"content-type": "application/json"}).status_code == 200
    assert not engine.has_unfinished_requests()


def test_full_waiting_queue_counts_sequences(serve):
    engine = FakeEngine()
    server = serve(engine, max_waiting_requests=3)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            held = asyncio.create_task(c.post("/v1/completions",
                                              json={"prompt": "hi", "n": 2, "max_tokens": 2}))
            deadline = time.monotonic() + 10
            while engine.stats().num_waiting < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            # One request of 2 sequences waits: 2 more would make 4 > 3.
            r = await c.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 2})
            assert _is_error(r, 503)["code"] == "queue_full"
            r = await c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
            assert _is_error(r, 503)["code"] == "queue_full"
            assert engine.stats().num_waiting == 2  # the refused one left nothing behind
            engine.gate.set()
            assert (await held).status_code == 200
            # An empty queue takes a request even larger than the limit.
            r = await c.post("/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 4

    asyncio.run(scenario())


def test_a_call_of_several_prompts_is_admitted_whole_or_not_at_all(serve):
    engine = FakeEngine()
    added: list[str] = []
    plain_add = engine.add_request

    def add_request(request_id, prompt, params, arrival_time=None):
        plain_add(request_id, prompt, params, arrival_time)
        added.append(request_id)
    engine.add_request = add_request
    server = serve(engine, max_waiting_requests=4)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            def post(prompt):
                return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            calls = [post(["a", "b", "c"]) for _ in range(4)] + [post("d") for _ in range(8)]
            tasks = [asyncio.create_task(call) for call in calls]
            deadline = time.monotonic() + 10
            while len(added) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            engine.gate.set()
            return await asyncio.gather(*tasks)

    responses = asyncio.run(scenario())
    calls: dict[str, int] = {}
    for rid in added:
        call = rid.rsplit("-", 1)[0] if rid.count("-") > 1 else rid
        calls[call] = calls.get(call, 0) + 1
    # Each call's prompts joined the engine together (a 3-prompt call is 3 or nothing).
    assert sorted(set(calls.values())) in ([1], [3], [1, 3])
    for r, prompts in zip(responses, [3] * 4 + [1] * 8):
        assert r.status_code in (200, 503)
        if r.status_code == 200:
            assert len(r.json()["choices"]) == prompts
    ok = sum(r.status_code == 200 for r in responses[:4]) * 3 + \
        sum(r.status_code == 200 for r in responses[4:])
    assert ok == len(added)  # nothing admitted was withdrawn, nothing refused was run


def test_full_waiting_queue_answers_503_at_once(serve):
    engine = FakeEngine()
    server = serve(engine, max_waiting_requests=2)
    engine.gate.clear()  # nothing gets scheduled: requests pile up waiting

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {"prompt": "hi", "max_tokens": 3}
            held = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while engine.stats().num_waiting < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            start = time.monotonic()
            r = await c.post("/v1/completions", json=body)
            assert time.monotonic() - start < 2
            assert _is_error(r, 503)["code"] == "queue_full"
            engine.gate.set()
            for resp in await asyncio.gather(*held):
                assert resp.status_code == 200
                assert resp.json()["choices"][0]["text"] == "xxx"
            # Room again.
            assert (await c.post("/v1/completions", json=body)).status_code == 200

    asyncio.run(scenario())


def _held_requests(c: httpx.AsyncClient, engine: FakeEngine, max_tokens: int = 50):
    """A plain, a chat and a streamed request, all waiting in the (gated) engine."""
    body = {"prompt": "hi", "max_tokens": max_tokens}
    plain = asyncio.create_task(c.post("/v1/completions", json=body))
    chat = asyncio.create_task(c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}))

    async def stream() -> list[str]:
        events = []
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    return plain, chat, asyncio.create_task(stream())


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(serve):
    engine = FakeEngine()
    server = serve(engine)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            plain, chat, streamed = _held_requests(c, engine)
            await _until(lambda: engine.stats().num_waiting == 3, "requests did not arrive")
            engine.fail_steps = 1  # one step fails, for no single request's fault
            engine.gate.set()
            for task in (plain, chat):
                resp = await asyncio.wait_for(task, 10)
                assert _is_error(resp, 500)["code"] == "request_failed"
            events = await asyncio.wait_for(streamed, 10)
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "request_failed"
            # The engine went on: healthy, and serving the next requests.
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx"

    asyncio.run(scenario())


def test_one_request_failing_alone_leaves_the_others(serve):
    engine = FakeEngine()
    server = serve(engine)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            plain, chat, streamed = _held_requests(c, engine, max_tokens=4)
            bad = asyncio.create_task(c.post("/v1/completions",
                                             json={"prompt": "!bad", "max_tokens": 4}))
            await _until(lambda: engine.stats().num_waiting == 4, "requests did not arrive")
            engine.gate.set()
            err = _is_error(await asyncio.wait_for(bad, 10), 500)
            assert err["code"] == "request_failed" and "simulated sampling failure" in \
                err["message"]
            assert (await plain).json()["choices"][0]["text"] == "xxxx"
            assert (await chat).json()["choices"][0]["message"]["content"] == "xxxx"
            events = await streamed
            assert events[-1] == "[DONE]" and all("error" not in e for e in events)

    asyncio.run(scenario())


def test_steps_that_keep_failing_kill_the_engine_and_stop_the_server(serve):
    engine = FakeEngine()
    fatal = []
    server = serve(engine, on_fatal=lambda: fatal.append(True))
    engine.fail.set()  # every step fails: the engine, not a request, is broken

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = {"prompt": "hi", "max_tokens": 5}
            for _ in range(MAX_CONSECUTIVE_FAILURES):
                r = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
                assert _is_error(r, 500)["code"] == "request_failed"
            r = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
            assert _is_error(r, 500)["code"] == "engine_dead"
            assert _is_error(await c.get("/health"), 503)["code"] == "engine_dead"
            # New work is refused at once, never left hanging; the supervisor is told.
            r = await asyncio.wait_for(c.post("/v1/completions", json=body), 5)
            assert r.status_code == 503
            assert (await c.get("/metrics")).status_code == 200

    asyncio.run(scenario())
    assert fatal == [True]


def test_failed_workers_are_restarted_and_requests_go_on(serve):
    engine = FakeEngine()
    server = serve(engine)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            plain, chat, streamed = _held_requests(c, engine, max_tokens=4)
            await _until(lambda: engine.stats().num_waiting == 3, "requests did not arrive")
            engine.worker_fail_steps = 2  # dies, and dies again right after its restart
            engine.gate.set()
            assert (await plain).json()["choices"][0]["text"] == "xxxx"
            assert (await chat).json()["choices"][0]["message"]["content"] == "xxxx"
            events = await streamed
            assert events[-1] == "[DONE]" and all("error" not in e for e in events)
            assert (await c.get("/health")).status_code == 200

    asyncio.run(scenario())
    assert engine.restarts == 2
    assert scrape(server.url)["stallfree:worker_restarts_total"] == 2


@pytest.mark.parametrize("restartable", [True, False])
def test_workers_that_cannot_come_back_kill_the_engine(serve, restartable):
    engine = FakeEngine()
    engine.executor.restartable = restartable
    fatal = []
    server = serve(engine, on_fatal=lambda: fatal.append(True))
    engine.worker_fail_steps = 100

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "hi"}), 10)
            assert _is_error(r, 500)["code"] == "engine_dead"
            assert _is_error(await c.get("/health"), 503)["code"] == "engine_dead"

    asyncio.run(scenario())
    assert fatal == [True]
    assert engine.restarts == (MAX_WORKER_RESTARTS if restartable else 0)


class _FullDisk(io.StringIO):
    """A file on a full disk: every write raises ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_iteration_log_leaves_the_server_serving(serve):
    engine = FakeEngine()
    log = IterationLog(_FullDisk())
    server = serve(engine, iteration_log=log)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx"
        assert c.get("/health").status_code == 200
    # The log was dropped after its first failed write.
    state = server.server.config.app.state.stallfree
    assert state.engine.iteration_log is None and not state.engine.is_dead


def test_disconnected_stream_is_aborted(serve):
    engine = FakeEngine(step_delay=0.02)
    server = serve(engine)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            for _ in range(3):
                async with c.stream("POST", "/v1/completions", json={
                        "prompt": "hi", "max_tokens": 10_000, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # leave after the first token
            # Non-streaming clients that give up are noticed too.
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10_000},
                             timeout=0.5)
            deadline = time.monotonic() + 10
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "aborted requests still run"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
    metrics = scrape(server.url)
    assert metrics["stallfree:request_aborted_total"] == 4


def test_n_and_multiple_prompts_are_indexed_like_openai(serve):
    server = serve(FakeEngine())
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 2,
                                            "echo": True})
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
        assert [ch["text"] for ch in body["choices"]] == ["abxx", "abxx", "cdexx", "cdexx"]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        lines = []
        with c.stream("POST", "/v1/completions", json={
                "prompt": [[97, 98], [99]], "n": 2, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        texts: dict[int, str] = {}
        for ch in chunks[:-1]:
            for choice in ch["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == {0: "xx", 1: "xx", 2: "xx", 3: "xx"}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
])
def test_stream_left_before_its_first_chunk_is_aborted(serve, path, body):
    engine = FakeEngine()
    server = serve(engine)
    engine.gate.clear()  # nothing is generated: the client leaves before any token

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async with c.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 10
                while not engine.has_unfinished_requests():
                    assert time.monotonic() < deadline, "the request never reached the engine"
                    await asyncio.sleep(0.02)
            # Hung up, having read nothing: the request must go, with nothing generated.
            deadline = time.monotonic() + 10
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "the abandoned request still waits"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert scrape(server.url)["stallfree:request_aborted_total"] == 1


def test_real_server_with_iteration_log_on_a_full_disk_serves(tiny_model):
    """/dev/full answers every write with ENOSPC: the header fails at start-up, and the
    server serves without its log rather than refusing to start or dying later."""
    from server_utils import ServerProcess

    server = ServerProcess("--model", tiny_model, "--iteration-log", "/dev/full",
                           "--kv-cache-memory", "64MiB", "--served-model-name", "tiny")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(2):
                r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                    "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert c.get("/health").status_code == 200
        assert "serving without it" in server.log_tail()
    finally:
        server.stop()
