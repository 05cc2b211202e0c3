"""The engine thread (server/engine_thread.py): the server builds its engine on the thread
that steps it, so all tensor work stays on one thread (one OpenMP pool)."""
from __future__ import annotations

import threading

import httpx
import pytest

from server_utils import FakeEngine, ThreadServer
from stallfree.server.api import build_app
from stallfree.server.engine_thread import EngineThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    thread = EngineThread()
    idents = [thread.run(threading.get_ident) for _ in range(3)]
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    order: list[int] = []
    futures = [thread.submit(order.append, i) for i in range(20)]
    assert [f.result(timeout=10) for f in futures] == [None] * 20 and order == list(range(20))
    with pytest.raises(ValueError, match="bad setting"):
        thread.run(_raise, ValueError("bad setting"))
    assert thread.run(sum, [1, 2]) == 3  # the thread outlives a failed call


class _ThreadRecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(step_delay=0.001)
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def test_the_server_steps_its_engine_on_the_thread_that_built_it():
    thread = EngineThread()
    engine = thread.run(_ThreadRecordingEngine)
    server = ThreadServer(build_app(engine, "fake", engine_thread=thread))
    try:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 3}
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx"
    finally:
        server.stop()
    assert engine.stepped_on == {engine.built_on}
    assert engine.built_on != threading.get_ident()


def _raise(err: Exception) -> None:
    raise err
