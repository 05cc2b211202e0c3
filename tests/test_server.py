"""The OpenAI-compatible server on the default model, started for real in a subprocess."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess, scrape
from stallfree import SamplingParams

MODEL = "smol"
MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0.0}
PROMPTS = [f"Write one sentence about the number {i} and the colour "
           f"{['red', 'green', 'blue', 'gold'][i % 4]}." for i in range(32)]


@pytest.fixture(scope="module")
def server():
    # float32: streams are compared with each other alone and batched (see conftest). The
    # weights stay quantized, as the server runs by default: the offline engine it is
    # compared with is `quantized_llm`.
    proc = ServerProcess("--served-model-name", MODEL, "other-name",
                         "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120)


def _settle(server, timeout: float = 30.0) -> dict[str, float]:
    """Waits until nothing runs or waits and every KV block is free; returns the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server.url)
        idle = (m["stallfree:num_requests_running"] == 0
                and m["stallfree:num_requests_waiting"] == 0
                and m["stallfree:kv_cache_usage_perc"] == 0
                and m["stallfree:kv_cache_free_blocks"] == m["stallfree:kv_cache_total_blocks"])
        if idle:
            return m
        assert time.monotonic() < deadline, f"server did not settle: {m}"
        time.sleep(0.1)


# ---- the official client ------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "other-name"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_startup_heap_is_frozen_out_of_full_gc_passes(server):
    # A full pass over the model's, tokenizer's and app's objects would stall every running
    # request for ~150 ms (serve.freeze_startup_heap); the server froze them before serving.
    with open(server.log_path, errors="replace") as f:
        found = re.search(r"(\d+) start-up objects frozen out of the cyclic GC", f.read())
    assert found, "the server did not report freezing its start-up objects"
    assert int(found.group(1)) > 50_000


def test_sync_client_greedy_stream_equals_plain_equals_offline(client, quantized_llm):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY))
    offline = quantized_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert plain.choices[0].text == streamed == offline.text
    assert plain.choices[0].finish_reason == offline.finish_reason
    assert plain.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert plain.usage.completion_tokens == len(offline.token_ids)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    messages = [{"role": "user", "content": "Name three fruits."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    offline = quantized_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == streamed == offline.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens,
                                         usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    # The same prompt a second time: its whole blocks came from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_sync_client_parameters(client):
    echo = client.completions.create(model="other-name", prompt="One, two,", max_tokens=4,
                                     echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("One, two,")
    many = client.completions.create(model=MODEL, prompt=["Hi", "Bye"], n=2, max_tokens=3,
                                     temperature=0.8, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.prompt_tokens >= 2 and 4 <= many.usage.completion_tokens <= 12
    again = client.completions.create(model=MODEL, prompt=["Hi", "Bye"], n=2, max_tokens=3,
                                      temperature=0.8, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20,
                                        stop=[" 6"], **GREEDY)
    assert " 6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


# Each sampling field over HTTP gives what the offline engine gives for the same
# parameters (seeded where random): a field the server dropped would change the text.
SAMPLING_CASES = [
    {"temperature": 0.8, "seed": 11, "top_k": 5},
    {"temperature": 1.0, "seed": 12, "min_p": 0.3},
    {"temperature": 0.9, "seed": 13, "top_p": 0.8},
    {"temperature": 0.0, "repetition_penalty": 1.5},
    {"temperature": 0.7, "seed": 14, "presence_penalty": 1.5},
    {"temperature": 0.0, "frequency_penalty": 1.2},
    {"temperature": 0.0, "min_tokens": 12, "stop": ["."]},
]


@pytest.mark.parametrize("fields", SAMPLING_CASES,
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_sampling_fields_over_http_equal_offline(client, quantized_llm, fields):
    prompt = "Write a short list of fruits. First,"
    http = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                     extra_body=fields)
    offline = quantized_llm.generate(prompt, SamplingParams(max_tokens=16, **fields))[0]
    assert http.choices[0].text == offline.text
    assert http.choices[0].finish_reason == offline.finish_reason
    assert http.usage.completion_tokens == len(offline.token_ids)


def test_logprobs_in_both_formats(client):
    done = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4,
                                      logprobs=3, **GREEDY)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == done.choices[0].text
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Greedy picks the most likely token, so it heads the alternatives.
        assert len(top) == 3 and logprob <= 0 and max(top.values()) == pytest.approx(logprob)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        stream=True, **GREEDY)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content])


def test_async_client_completions_and_chat(aclient_factory):
    async def scenario():
        client = aclient_factory()
        plain = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                                max_tokens=8, **GREEDY)
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                                 max_tokens=8, stream=True, **GREEDY)
        streamed = "".join([c.choices[0].text async for c in stream])
        assert plain.choices[0].text == streamed
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 2+2?"}]
        chat = await client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=8, **GREEDY)
        stream = await client.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=8, stream=True, **GREEDY)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert chat.choices[0].message.content == streamed
        await client.close()

    asyncio.run(scenario())


# ---- concurrency and disconnects ----------------------------------------------------
def test_32_concurrent_streams_match_each_alone(server, client, aclient_factory):
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY)
             .choices[0].text for p in PROMPTS]

    async def scenario() -> list[str]:
        client = aclient_factory()

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                     stream=True, **GREEDY)
            parts, finish = [], None
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            assert finish in ("stop", "length")
            return "".join(parts)

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    together = asyncio.run(scenario())
    assert together == alone
    _settle(server)


def test_streams_that_stay_get_every_token_in_order_while_others_hang_up(server, client):
    """The engine-to-server handoff under load: 16 concurrent streams, 6 of which hang up at
    random points; each of the other 10 must receive exactly its non-streamed text."""
    rng = random.Random(7)
    prompts = PROMPTS[:16]
    leavers = dict(zip(rng.sample(range(16), 6), (rng.randint(1, 6) for _ in range(6))))
    before = scrape(server.url)

    async def scenario() -> dict[int, str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def one(i: int) -> str:
                parts = []
                # A leaver asks for many tokens, so it is still running when it hangs up.
                length = {"max_tokens": 300, "ignore_eos": True} if i in leavers \
                    else {"max_tokens": 10}
                async with c.stream("POST", "/v1/completions", json={
                        "model": MODEL, "prompt": prompts[i], "stream": True, **length,
                        **GREEDY}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
                        if len(parts) == leavers.get(i):
                            break  # hang up mid-reply
                return "".join(parts)

            texts = await asyncio.gather(*(one(i) for i in range(16)))
            return dict(enumerate(texts))

    streamed = asyncio.run(scenario())
    after = _settle(server)
    assert after["stallfree:request_aborted_total"] - before["stallfree:request_aborted_total"] \
        == len(leavers)
    for i in range(16):
        if i in leavers:
            continue
        alone = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, **GREEDY)
        assert streamed[i] == alone.choices[0].text


def test_10_disconnected_streams_are_aborted_and_free_their_blocks(server):
    before = scrape(server.url)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def leave_early(i: int) -> int:
                got = 0
                async with c.stream("POST", "/v1/completions", json={
                        "model": MODEL, "prompt": PROMPTS[i], "max_tokens": 400,
                        "ignore_eos": True, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            got += 1
                            if got == 3:
                                break  # hang up mid-reply
                return got

            assert await asyncio.gather(*(leave_early(i) for i in range(10))) == [3] * 10

    asyncio.run(scenario())
    after = _settle(server)
    assert after["stallfree:request_aborted_total"] - before["stallfree:request_aborted_total"] \
        == 10
    # Far fewer tokens than 10 x 400 were generated: the aborts were prompt.
    generated = after["stallfree:generation_tokens_total"] \
        - before["stallfree:generation_tokens_total"]
    assert 30 <= generated < 2000
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Still there?", "max_tokens": 3})
    assert r.status_code == 200


# ---- bad requests -------------------------------------------------------------------
_LONG = "hello " * (MAX_MODEL_LEN + 10)
_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (name, path, body (dict or raw bytes), status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b'[1, 2, 3]', 400, None),
    ("empty body", "/v1/completions", b'', 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400,
     "max_tokens"),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature -1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("temperature bool", "/v1/completions", {"prompt": "x", "temperature": True}, 400,
     "temperature"),
    ("top_p 2", "/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("presence_penalty 3", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("min_tokens over max_tokens", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("prompt over max_model_len", "/v1/completions", {"prompt": _LONG}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [1, -3]}, 400, "prompt"),
    ("stop_token_ids out of vocab", "/v1/completions",
     {"prompt": "x", "stop_token_ids": [10**6], "min_tokens": 2}, 400, "stop_token_ids"),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("logprobs over 20", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     400, None),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, 400, None),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": _MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat max_tokens negative", "/v1/chat/completions", {"messages": _MSG, "max_tokens": -1},
     400, "max_tokens"),
    ("chat unknown model", "/v1/chat/completions", {"model": "nope", "messages": _MSG}, 404,
     "model"),
    ("chat over max_model_len", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": _LONG}]}, 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("tokenize neither field", "/tokenize", {}, 400, "prompt"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(server, name, path, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_server_still_serves_after_bad_requests(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt="Good morning", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    _settle(server)


# ---- tokenizer endpoints and metrics ------------------------------------------------
def test_tokenize_round_trip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": _MSG}).json()
    assert chat["count"] > r["count"]


def test_metrics_counters_equal_usage_sums(server, client):
    before = _settle(server)
    usages = []
    for i in range(3):
        usages.append(client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=5,
                                                n=2, temperature=1.0, seed=i).usage)
    usages.append(client.chat.completions.create(model=MODEL, messages=_MSG,
                                                 max_tokens=6).usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=_MSG, max_tokens=4,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    usages.append(client.completions.create(model=MODEL, prompt=["a b c", "d e"],
                                            max_tokens=3).usage)
    after = _settle(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("stallfree:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("stallfree:generation_tokens_total") == sum(u.completion_tokens
                                                             for u in usages)
    num_requests = 3 + 1 + 1 + 2  # engine requests: one per prompt
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"stallfree:{hist}_count") == num_requests, hist
    assert delta("stallfree:inter_token_latency_seconds_count") == sum(
        u.completion_tokens for u in usages) - (3 * 2 + 1 + 1 + 2)  # gaps = tokens - seqs
    # Every prompt token is computed unless it came from the prefix cache.
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("stallfree:iteration_tokens_total_sum") >= sum(
        u.prompt_tokens for u in usages) - cached
    assert delta("stallfree:prefix_cache_hits_total") == cached
    # Queried at each sequence's admission: the three n = 2 prompts twice.
    assert delta("stallfree:prefix_cache_queries_total") == sum(
        u.prompt_tokens for u in usages) + sum(u.prompt_tokens for u in usages[:3])
    assert delta("stallfree:request_success_total") == 3 * 2 + 1 + 1 + 2
    assert delta("stallfree:num_preemptions_total") == 0
    text = httpx.get(server.url + "/metrics").text
    assert f'stallfree:kv_cache_usage_perc{{model_name="{MODEL}"}}' in text
    assert "# TYPE stallfree:time_to_first_token_seconds histogram" in text


def test_cached_prompt_tokens_in_usage_metrics_and_reset(server, client):
    """A repeated prompt reuses whole 16-token blocks of KV, less one token; both endpoints
    and the stream's usage chunk report it; /reset_prefix_cache forgets it."""
    long = " ".join(f"item {i} is {['red', 'green', 'blue'][i % 3]}" for i in range(30))
    ids = httpx.post(server.url + "/tokenize", json={"prompt": long}).json()["tokens"]
    assert httpx.post(server.url + "/reset_prefix_cache").json()["status"] == "ok"
    before = _settle(server)
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, **GREEDY)
    assert first.choices[0].text == second.choices[0].text
    hit = (len(ids) - 1) // 16 * 16
    assert [u.prompt_tokens_details.cached_tokens for u in (first.usage, second.usage)] == [0, hit]
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit
    msgs = [{"role": "user", "content": long}]
    chat = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **GREEDY)
            for _ in range(2)]
    chat_hit = (chat[0].usage.prompt_tokens - 1) // 16 * 16
    assert [c.usage.prompt_tokens_details.cached_tokens for c in chat] == [0, chat_hit]
    after = _settle(server)
    assert after["stallfree:prefix_cache_hits_total"] - before[
        "stallfree:prefix_cache_hits_total"] == 2 * hit + chat_hit
    assert after["stallfree:prefix_cache_queries_total"] - before[
        "stallfree:prefix_cache_queries_total"] == 3 * len(ids) + 2 * chat[0].usage.prompt_tokens
    reset = httpx.post(server.url + "/reset_prefix_cache").json()
    assert reset["num_cached_blocks"] >= hit // 16
    third = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, **GREEDY)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_openapi_schema_documents_400(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    op = schema["paths"]["/v1/completions"]["post"]
    assert "400" in op["responses"] and "422" not in op["responses"]
    assert json.dumps(schema)  # serialisable
