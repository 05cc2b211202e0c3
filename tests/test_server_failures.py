"""Server failure paths on a fake engine (no model): API key, full queue, engine crash.

A real uvicorn serves the app from a thread of this process; the fake engine
lets each test pause, fill or crash the engine at will.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_utils import FakeEngine, ThreadServer, scrape
from stallfree.server.api import build_app

MODEL = "fake"


@pytest.fixture
def serve():
    servers = []

    def start(engine: FakeEngine, **kwargs) -> ThreadServer:
        server = ThreadServer(build_app(engine, MODEL, **kwargs))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def _is_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_api_key_guards_every_v1_route(serve):
    server = serve(FakeEngine(), api_key="sekret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        _is_error(c.post("/v1/completions", json=body), 401)
        _is_error(c.post("/v1/completions", json=body,
                         headers={"Authorization": "Bearer wrong"}), 401)
        _is_error(c.get("/v1/models"), 401)
        _is_error(c.post("/v1/chat/completions", content=b"{not json"), 401)  # auth comes first
        ok = {"Authorization": "Bearer sekret"}
        r = c.post("/v1/completions", json=body, headers=ok)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx"
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        # Outside /v1 no key is needed.
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


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


def test_engine_failure_fails_in_flight_requests_and_health(serve):
    engine = FakeEngine()
    server = serve(engine)
    engine.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            assert (await c.get("/health")).status_code == 200
            body = {"prompt": "hi", "max_tokens": 50}
            plain = asyncio.create_task(c.post("/v1/completions", json=body))
            chat = asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}))

            async def stream() -> list[str]:
                events = []
                async with c.stream("POST", "/v1/completions",
                                    json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return events

            streamed = asyncio.create_task(stream())
            deadline = time.monotonic() + 10
            while engine.stats().num_waiting < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            engine.fail.set()
            for task in (plain, chat):
                resp = await asyncio.wait_for(task, 10)
                assert _is_error(resp, 500)["code"] == "engine_dead"
            events = await asyncio.wait_for(streamed, 10)
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_dead"
            assert _is_error(await c.get("/health"), 503)["code"] == "engine_dead"
            # New work is refused at once, never left hanging.
            r = await asyncio.wait_for(c.post("/v1/completions", json=body), 5)
            assert r.status_code == 503
            assert (await c.get("/metrics")).status_code == 200

    asyncio.run(scenario())


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
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
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
