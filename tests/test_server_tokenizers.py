"""Tokenizer work runs off the event loop, and no tokenizer serves two threads at once."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from server_utils import FakeEngine, FakeTokenizer, ThreadServer
from stallfree.server.api import build_app
from stallfree.server.tokenizers import TokenizerPool


class _ExclusiveTokenizer:
    """Fails if two threads are inside it at once (what "Already borrowed" punishes).

    The barrier makes calls overlap for sure: each caller waits for another to arrive,
    so two threads sharing one copy would both be inside it."""

    barrier = threading.Barrier(2, timeout=10)

    def __init__(self) -> None:
        self.inside = 0

    def __deepcopy__(self, memo) -> _ExclusiveTokenizer:
        return _ExclusiveTokenizer()

    def encode(self, text: str) -> list[int]:
        self.inside += 1
        try:
            assert self.inside == 1, "two threads inside one tokenizer"
            self.barrier.wait()
            return [len(text)]
        finally:
            self.inside -= 1


def test_pool_threads_never_share_a_tokenizer():
    original = _ExclusiveTokenizer()
    pool = TokenizerPool(original, threads=2)
    seen = []

    def encode(tok, text):
        seen.append(tok)
        return tok.encode(text)

    async def scenario():
        return await asyncio.gather(*(pool.run(encode, "x" * i) for i in range(20)))

    try:
        assert asyncio.run(scenario()) == [[i] for i in range(20)]
    finally:
        pool.shutdown()
    # Two private copies did all the work; the engine's own was never touched.
    assert len({id(t) for t in seen}) == 2 and original not in seen


class _GatedTokenizer(FakeTokenizer):
    """Tokenizes only once `gate` opens: a prompt that takes long to tokenize."""

    gate = threading.Event()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert self.gate.wait(10), "the gate never opened"
        return super().__call__(text, add_special_tokens)


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": "slow"}),
    ("/v1/completions", {"prompt": "slow", "max_tokens": 2}),
])
def test_slow_tokenizing_leaves_the_event_loop_free(path, body):
    engine = FakeEngine()
    engine.tokenizer = _GatedTokenizer()
    server = ThreadServer(build_app(engine, "fake"))
    _GatedTokenizer.gate.clear()

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            slow = asyncio.create_task(c.post(path, json=body))
            # While it tokenizes, the loop still answers (on the loop, this would hang).
            for _ in range(3):
                assert (await c.get("/health")).status_code == 200
                assert (await c.get("/v1/models")).status_code == 200
            assert not slow.done()
            _GatedTokenizer.gate.set()
            assert (await slow).status_code == 200

    try:
        asyncio.run(scenario())
    finally:
        _GatedTokenizer.gate.set()
        server.stop()
