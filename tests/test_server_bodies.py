"""Large request bodies: parsed and validated off the event loop, and a prompt refused by
its length before its ids (server/body.py); a trickled body is bounded (--body-timeout)."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from stallfree.server.config import RequestLimits

MODEL = "fake"
PATIENCE = 20  # seconds a test waits for what must happen: a bound on a hang, not a timing


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_a_large_body_is_parsed_while_health_answers(serve, monkeypatch):
    """The parse of a large body is held until /health has answered: on the event loop,
    /health could not answer and the test would fail (not hang: the hold is bounded)."""
    server = serve()
    health_answered = threading.Event()
    real_loads = json.loads

    def held_loads(text, *args, **kwargs):
        if len(text) > 1 << 20:  # the large body only
            health_answered.wait(PATIENCE)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", held_loads)
    # 60 prompts of 60 ids (FakeEngine's max_model_len is 64), padded past 1 MiB.
    body = {"model": MODEL, "prompt": [[7] * 60] * 60, "max_tokens": 1, "user": "x" * (2 << 20)}
    results = {}

    def complete() -> None:
        results["r"] = httpx.post(server.url + "/v1/completions", json=body, timeout=PATIENCE * 3)

    sender = threading.Thread(target=complete)
    sender.start()
    try:
        health = httpx.get(server.url + "/health", timeout=PATIENCE / 4)
    finally:
        health_answered.set()
        sender.join(PATIENCE * 3)
    assert health.status_code == 200
    response = results["r"]
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 60


@pytest.mark.parametrize("large", [False, True])
def test_a_long_prompt_is_refused_by_its_length_before_its_ids(serve, large):
    """A token-id prompt of max_model_len ids or more is refused for its length, whatever
    its ids: neither pydantic nor the vocabulary check looks at them."""
    server = serve()
    count = 800_000 if large else 64  # FakeEngine: max_model_len 64, vocab 256
    prompt = [5] * (count - 1) + [999]  # an id outside the vocabulary, at the end
    response = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                          json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "prompt"
    assert f"prompt has {count} tokens, but max_model_len is 64" in error["message"]


def test_too_many_prompts_are_refused_before_their_ids(serve):
    server = serve(limits=RequestLimits(max_prompts=4))
    response = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                          json={"model": MODEL, "prompt": [[1, -1]] * 5})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "prompt" and "--max-prompts" in error["message"]


@pytest.mark.parametrize("size", [100, 200_000])  # parsed here and on a thread
def test_bad_bodies_still_name_their_field(serve, size):
    server = serve()
    pad = "x" * size
    bad_n = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                       json={"model": MODEL, "prompt": "hi", "n": 0, "user": pad})
    assert bad_n.status_code == 400 and _error(bad_n)["param"] == "n"
    bad_json = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                          content=b'{"prompt": "' + pad.encode() + b'",',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert _error(bad_json)["message"].startswith("the body is not valid JSON")
    not_utf8 = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                          content=b'{"prompt": "\xd3\x10' + pad.encode() + b'"}',
                          headers={"content-type": "application/json"})
    assert not_utf8.status_code == 400, not_utf8.text
    assert _error(not_utf8)["message"].startswith("the body is not valid JSON")
    bad_id = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                        json={"model": MODEL, "prompt": [1, 999], "user": pad})
    assert bad_id.status_code == 400 and _error(bad_id)["param"] == "prompt"
    good = httpx.post(server.url + "/v1/completions", timeout=PATIENCE,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": pad})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "xx"


def test_a_trickled_body_is_answered_408_naming_the_flag(serve):
    """A body never finished gets 408 naming --body-timeout (before: the request waited
    for it forever, holding its connection)."""
    server = serve(limits=RequestLimits(body_timeout=1))
    with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pr")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"--body-timeout" in reply
