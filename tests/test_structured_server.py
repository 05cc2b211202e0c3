"""Structured outputs and tool calls through the OpenAI-compatible server (default model)."""
from __future__ import annotations

import asyncio
import json
import re
from enum import Enum

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from json_schemas import SCHEMAS
from server_utils import ServerProcess

MODEL = "smol"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "The time."}},
]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object",
                                                                       "properties": {},
                                                                       "additionalProperties":
                                                                       False})
              for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def server():
    # The weights dequantized: the greedy answers below must finish within their token
    # limits, and on a 135M model that rests on its exact weights. Kept quantized (x rounded
    # to int8), schema 16's greedy integer ran on to the limit in an AVX2 build.
    proc = ServerProcess("--served-model-name", MODEL, "--max-model-len", "1024",
                         "--quantization", "none")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _sampling(i: int) -> dict:
    """Greedy for even i, sampled (seeded) for odd i."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}


# Every schema greedy and sampled, streamed and whole: cell k is (schema, stream), and
# _sampling(k) alternates greedy and sampled, so each sampled cell draws its own seed.
JSON_CELLS = [(i, stream) for i in range(len(SCHEMAS)) for stream in (False, True)
              for _ in range(2)]


async def _json_schema_answer(client: openai.AsyncOpenAI, k: int) -> tuple[str, str | None]:
    """(text, finish_reason) of cell k; max_tokens far above what any answer needs: the
    grammar, not the limit, must end it."""
    i, stream = JSON_CELLS[k]
    prompt, schema = SCHEMAS[i]
    request = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": 512, "response_format": {"type": "json_schema", "json_schema": {
                   "name": f"s{i}", "schema": schema, "strict": True}}, **_sampling(k)}
    if not stream:
        done = await client.chat.completions.create(**request)
        return done.choices[0].message.content, done.choices[0].finish_reason
    parts, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **request):
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def _json_schema_answers(url: str) -> list[tuple[str, str | None]]:
    """Every cell's answer, all sent at once: one batch, not one request after another."""
    async def scenario() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        try:
            return await asyncio.gather(*(_json_schema_answer(client, k)
                                          for k in range(len(JSON_CELLS))))
        finally:
            await client.close()

    return asyncio.run(scenario())


def _json_schema_failure(k: int, text: str, finish: str | None) -> str | None:
    """Why cell k's answer is wrong, or None when it parses, validates and stopped."""
    i, stream = JSON_CELLS[k]
    where = (f"schema {i} {'streamed' if stream else 'whole'} "
             f"{'sampled' if k % 2 else 'greedy'}: {text!r}")
    if finish != "stop":
        return f"{where} finished with {finish}"
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[i][1])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{where} {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def test_json_schema_answers_parse_and_validate_greedy_and_sampled_streamed_and_not(server):
    assert len(SCHEMAS) >= 20
    answers = _json_schema_answers(server.url)
    # Every wrong cell at once: one failing schema should not hide another.
    failures = [why for k, (text, finish) in enumerate(answers)
                if (why := _json_schema_failure(k, text, finish))]
    assert not failures, "\n".join(failures)


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Reading(BaseModel):
    city: str = Field(max_length=30)
    temperature: int = Field(ge=-60, le=60)
    unit: Unit


class Report(BaseModel):
    # Bounded, as a schema for a small model should be: unbounded text can run on.
    title: str = Field(max_length=40)
    readings: list[Reading] = Field(min_length=1, max_length=3)


def test_the_official_clients_parse_fills_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Give a weather report for two "
                                                           "cities."}],
        response_format=Report, max_tokens=300, temperature=0.0)
    report = done.choices[0].message.parsed
    assert isinstance(report, Report) and all(isinstance(r, Reading) for r in report.readings)
    assert done.choices[0].finish_reason == "stop"


def _answer(client: openai.OpenAI, endpoint: str, text: str, max_tokens: int,
            extra: dict) -> tuple[str, str]:
    """(text, finish_reason) of a greedy request: `text` is the prompt of completions and
    the user's message of chat."""
    if endpoint == "completions":
        done = client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens,
                                         temperature=0.0, extra_body=extra)
        return done.choices[0].text, done.choices[0].finish_reason
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=0.0, extra_body=extra)
    return done.choices[0].message.content, done.choices[0].finish_reason


ENDPOINTS = ("completions", "chat")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"json_object": True}}])
def test_json_object_gives_an_object_on_both_endpoints(client, endpoint, extra):
    # A prompt the model answers briefly: an open "Some JSON" made it write one string
    # until max_tokens in bfloat16 (valid so far, but never closed).
    text, finish = _answer(client, endpoint, "Give me a JSON object with the keys name and "
                                             "age.", 200, extra)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_every_constraint_field_on_both_endpoints(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = 'root ::= "x" [0-9] [0-9]'

    def valid(t: str) -> bool:
        return jsonschema.validate(json.loads(t), schema) is None

    def json_schema(**strict: bool) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "ok", "schema": schema, **strict}}}

    for extra, check in (
            ({"structured_outputs": {"regex": phone}}, lambda t: re.fullmatch(phone, t)),
            ({"guided_regex": phone}, lambda t: re.fullmatch(phone, t)),
            ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha",
                                                                                   "beta")),
            ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
            ({"structured_outputs": {"grammar": grammar}}, lambda t: re.fullmatch(r"x\d\d", t)),
            ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"x\d\d", t)),
            ({"structured_outputs": {"json": schema}}, lambda t: json.loads(t)["ok"] in (True,
                                                                                       False)),
            ({"guided_json": json.dumps(schema)}, valid),
            (json_schema(), lambda t: "ok" in json.loads(t)),
            # strict is ignored: decoding keeps to the schema either way.
            (json_schema(strict=False), valid)):
        for endpoint in ENDPOINTS:
            text = _answer(client, endpoint, "The answer:" if endpoint == "completions"
                           else "The answer?", 40, extra)[0]
            assert check(text), (endpoint, extra, text)


def _check_calls(calls: list[tuple[str, str]], name: str | None = None) -> None:
    assert calls
    for called, arguments in calls:
        assert called in PARAMETERS and (name is None or called == name)
        jsonschema.validate(json.loads(arguments), PARAMETERS[called])


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, list[str]]:
    calls: dict[int, dict] = {}
    finish, ids = None, []
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.id:
                ids.append(delta.id)
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish, ids


@pytest.mark.parametrize("choice", ["required", "get_weather", "add", "now"])
def test_required_and_named_tool_choice_always_give_valid_calls(client, choice):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    name = None if choice == "required" else choice
    finish_reason = "tool_calls" if choice == "required" else "stop"  # as OpenAI's
    for i in range(2):  # greedy, then sampled
        done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice=tool_choice, max_tokens=200,
                                              **_sampling(i))
        message = done.choices[0].message
        assert done.choices[0].finish_reason == finish_reason
        assert all(c.id.startswith("call_") and c.type == "function"
                   for c in message.tool_calls)
        _check_calls([(c.function.name, c.function.arguments) for c in message.tool_calls],
                     name)
        calls, finish, ids = _streamed_calls(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
            stream=True, **_sampling(i)))
        assert finish == finish_reason and len(ids) == len(calls) == len(set(ids))
        _check_calls(calls, name)
        if i == 0:  # greedy: the stream carries the same calls as the whole reply
            assert calls == [(c.function.name, c.function.arguments)
                             for c in message.tool_calls]


@pytest.mark.parametrize("body,param", [
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"messages": ASK, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": ASK, "structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"messages": ASK, "structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs.grammar"),
    ({"messages": ASK, "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ({"messages": ASK, "guided_json": "{not json"}, "guided_json"),
    ({"messages": ASK, "guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}}]},
     "tools[0].function.parameters"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "a string"}}]}, "tools.0.function.parameters"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function",
                                                      "function": {"name": "missing"}}},
     "tool_choice"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_constraints_and_tools_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_bad_constraint_on_completions_gets_400(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "guided_grammar": "root ::= ("},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar"


def test_tool_results_in_later_turns_reach_the_template(server, client):
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}]
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": conversation,
                                                   "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = httpx.post(server.url + "/detokenize", json={"model": MODEL,
                                                          "tokens": r.json()["tokens"]},
                        timeout=60).json()["prompt"]
    assert "<tool_response>\nSunny, 21 degrees\n</tool_response>" in prompt
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert '"name": "add"' in prompt and "<tools>" in prompt  # the tools, in the system turn
    done = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS,
                                          max_tokens=16, temperature=0.0)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
