"""The server is never up but unable to serve: an engine loop that ended without
recording why is dead (503, new work refused), one stuck in a step (wedged workers)
answers /health 503 until it moves again, and an engine that dies before uvicorn
starts still makes `serve` exit 1. On a fake engine (no model)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import httpx
import pytest

import stallfree.engine
import stallfree.server.api
from server_utils import FakeEngine, ThreadServer
from stallfree.config import EngineConfig
from stallfree.executor.base import WorkerError
from stallfree.server.async_engine import AsyncEngine
from stallfree.server.config import ServerConfig
from stallfree.server.serve import serve


class _GoneThread:
    """An engine thread that no longer runs anything: what it is given ends at once,
    never run (cancelled, or failed outside the engine loop's own handler)."""

    def __init__(self, cancelled: bool) -> None:
        self.cancelled = cancelled

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        if self.cancelled:
            future.cancel()
        else:
            future.set_exception(RuntimeError("the engine thread is gone"))
        return future


@pytest.mark.parametrize("cancelled", [True, False])
def test_an_engine_loop_that_ended_unrecorded_is_dead(cancelled):
    app = stallfree.server.api.build_app(FakeEngine(), "fake",
                                         engine_thread=_GoneThread(cancelled))
    engine = app.state.stallfree.engine
    assert engine.is_dead and engine.crashed
    assert ("cancelled" if cancelled else "the engine thread is gone") in engine.dead_reason
    server = ThreadServer(app)
    try:
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        # Refused at once, not queued for a loop that will never take it.
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503
    finally:
        server.stop()


class _Wedged(FakeEngine):
    """Its steps block while `wedged` is set, as on workers that never answer."""

    def __init__(self) -> None:
        super().__init__()
        self.wedged = threading.Event()
        self.stuck = threading.Event()  # set once a step is blocked

    def step(self):
        while self.wedged.is_set():
            self.stuck.set()
            self.wedged.wait(0.01)
        return super().step()


def _health(url: str, until: int) -> httpx.Response:
    """/health once it answers `until` (it changes state on the engine's schedule)."""
    for _ in range(3000):
        health = httpx.get(url + "/health", timeout=10)
        if health.status_code == until:
            return health
        time.sleep(0.01)
    raise AssertionError(f"/health never answered {until}: {health.text}")


def test_an_engine_stuck_in_a_step_is_unhealthy_until_it_moves_again():
    engine = _Wedged()
    engine.wedged.set()
    app = stallfree.server.api.build_app(AsyncEngine(engine, "fake", stall_timeout=1.5),
                                         "fake")
    server = ThreadServer(app)
    try:
        answers: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
            timeout=120)))
        client.start()
        assert engine.stuck.wait(60)
        health = _health(server.url, 503)
        assert health.json()["error"]["code"] == "engine_stalled", health.text
        engine.wedged.clear()  # the workers answer again: so does the engine
        client.join(60)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == "xxx"
        _health(server.url, 200)
    finally:
        server.stop()


def test_the_stall_timeout_must_outlast_an_idle_turn():
    with pytest.raises(ValueError, match="stall_timeout"):
        AsyncEngine(FakeEngine(), "fake", stall_timeout=0.5)


class _DiesAtOnce(FakeEngine):
    """Its workers are found dead at the first idle check and cannot be restarted."""

    def __init__(self) -> None:
        super().__init__()
        self.executor.restartable = False
        self.shut_down = False

    def check_workers(self) -> None:
        raise WorkerError("worker rank 1 (pid 0) exited with code -9")

    def shutdown(self) -> None:
        self.shut_down = True


def test_an_engine_dead_before_uvicorn_starts_makes_serve_exit_1(monkeypatch, capsys):
    engine = _DiesAtOnce()
    monkeypatch.setattr(stallfree.engine, "LLMEngine", lambda config, seed: engine)
    build_app = stallfree.server.api.build_app

    def build_then_let_it_die(*args, **kwargs):
        # The race, made certain: the engine dies before serve() has its uvicorn server.
        app = build_app(*args, **kwargs)
        dead = threading.Event()
        while not app.state.stallfree.engine.is_dead:
            dead.wait(0.01)
        return app

    monkeypatch.setattr(stallfree.server.api, "build_app", build_then_let_it_die)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(
        serve(EngineConfig(), ServerConfig(port=0))), daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "serve() kept serving a dead engine"
    assert result == [1] and engine.shut_down
    assert "could not be restarted" in capsys.readouterr().err
