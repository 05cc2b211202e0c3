"""Hostile input under tensor parallelism: one request's values, or keys forged into the
workers' store, must change nothing for anyone else.

A value that validation lets through but the wire cannot carry (an int past 64 bits)
fails its own request alone, and the batch index stays in step with the workers'; a
client of the store without the run's secret can neither stop, fail nor feed the
workers or the engine, and reads no prompt from it. On the tiny random-weight Llama.
"""
from __future__ import annotations

import asyncio
import datetime

import httpx
import pytest
import torch.distributed as dist

from stallfree import LLM, SamplingParams

ENGINE = dict(policy="sarathi", token_budget=16, max_model_len=64, dtype="float32")
PROMPTS = [[(5 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((7, 19, 4))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
HUGE = 2**64  # one past what msgpack carries


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    return [o.token_ids for o in LLM(tiny_model, **ENGINE).generate(PROMPTS, GREEDY)]


def _outsider(port: int) -> dist.TCPStore:
    """A client of the engine's store without the run's secret: anyone local."""
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


def _forge(port: int, batches: range = range(0)) -> None:
    """Unsigned values under every key the engine or a worker reads, those of `batches`
    too: a worker waits on msg/k before the engine writes it, and must ignore a forged
    one. (Only for batches not yet sent: overwriting one in flight would lose it, which
    anyone who can write the store can do; what is tested is that nothing forged runs.)"""
    store = _outsider(port)
    for key in ("error", "stop", "config", "hb/0", "hb/1", "ready/0", "ready/1"):
        store.set(key, b"forged")
    for k in batches:
        for key in (f"msg/{k}", f"out/{k}", f"times/{k}/0", f"ack/{k}/0", f"ack/{k}/1"):
            store.set(key, b"forged")


def _run(engine, requests: dict[str, tuple[int, SamplingParams]]) -> tuple[dict, dict]:
    """Runs request id -> (prompt index, params) to the end: (request id -> tokens,
    request id -> why it failed)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, PROMPTS[prompt], params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    failed: dict[str, str] = {}
    while engine.has_unfinished_requests():
        step = engine.step()
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
        failed.update(step.failed)
    return tokens, failed


def test_an_unsendable_value_fails_its_own_request_and_the_channel_stays_in_step(
        tiny_model, expected):
    with LLM(tiny_model, tensor_parallel_size=2, **ENGINE) as llm:
        engine = llm.engine
        smuggled = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=1)
        smuggled.seed = HUGE  # past validation, as a bug elsewhere might let it
        # Valid, and each means "no limit": they reach the workers as such.
        unbounded = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                   top_k=HUGE)
        tokens, failed = _run(engine, {"a": (0, GREEDY), "b": (1, smuggled),
                                        "c": (2, unbounded)})
        assert set(failed) == {"b"} and "OverflowError" in failed["b"], failed
        assert tokens["a"] == expected[0] and tokens["c"] == expected[2]
        # Every batch after it still reaches the workers under the index they expect.
        tokens, failed = _run(engine, {"d": (0, GREEDY)})
        assert not failed and tokens["d"] == expected[0]


def test_seeds_past_64_bits_are_refused_up_front():
    for seed in (HUGE, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=HUGE - 1).seed == HUGE - 1


def test_forged_store_keys_change_nothing(tiny_model, expected):
    with LLM(tiny_model, tensor_parallel_size=2, **ENGINE) as llm:
        executor = llm.engine.executor
        _forge(executor.store.port, range(executor._next, executor._next + 64))
        executor.check()  # a forged error or heartbeat is no failure
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        executor.check()
        assert all(p.poll() is None for p in executor.procs), "a forged key stopped a worker"


def _worker_port(server_pid: int) -> int:
    """The engine's store port, from a worker's environment (as any local user of the
    same account could read it; the secret there is what a test may not use)."""
    from test_parallel import _children

    with open(f"/proc/{_children(server_pid)[0]}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return int(env[b"MASTER_PORT"])


def test_tp2_server_hostile_fields_and_forged_keys_leave_a_stream_intact(tiny_model):
    from server_utils import ServerProcess, stream_completion

    expected = LLM(tiny_model, **ENGINE).generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].text
    server = ServerProcess("--model", tiny_model, "-tp", "2", "--max-model-len", "64",
                           "--dtype", "float32", "--max-num-batched-tokens", "16",
                           "--served-model-name", "tiny")
    hostile = [{"seed": HUGE}, {"seed": -HUGE}, {"max_tokens": HUGE}, {"min_tokens": HUGE},
               {"top_k": HUGE}, {"seed": HUGE, "stream": True}]
    try:
        async def scenario() -> tuple[str, list[int]]:
            first = asyncio.Event()

            async def stream() -> str:
                text, finish = await stream_completion(c, {
                    "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 40,
                    "temperature": 0.0, "ignore_eos": True}, first)
                assert finish == "length"
                return text

            async def bad(fields: dict) -> int:
                body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4,
                        "temperature": 0.0, **fields}
                r = await c.post("/v1/completions", json=body)
                return r.status_code

            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                task = asyncio.create_task(stream())
                await asyncio.wait_for(first.wait(), 60)
                statuses = await asyncio.gather(*(bad(f) for f in hostile))
                _forge(_worker_port(server.proc.pid))
                return await task, statuses

        text, statuses = asyncio.run(scenario())
        assert text == expected
        # Refused (400), or served: never a 5xx, never another request's failure.
        assert all(s in (200, 400) for s in statuses), statuses
        # Idle now: forge the keys of every batch still to come too (and some past).
        _forge(_worker_port(server.proc.pid), range(1000))
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
