"""Hostile input gets a 4xx naming the field, never a 5xx: lone UTF-16 surrogates, integers
past 64 bits, JSON nested past what the parser's recursion allows; and the model's own
deeply nested tool-call text stays text. The server serves on after each."""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import ServerProcess
from stallfree.outputs import TokenLogprobs
from stallfree.server.logprobs import completion_logprobs, top_by_text
from stallfree.server.tool_parser import MAX_JSON_DEPTH, parse_calls, split_tool_calls


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ServerProcess("--model", tiny_model, "--served-model-name", "tiny",
                         "--max-model-len", "256")
    yield proc
    proc.stop()


def _post(server, path: str, raw: str) -> httpx.Response:
    return httpx.post(server.url + path, content=raw.encode(), timeout=60,
                      headers={"content-type": "application/json"})


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _history_with_arguments(arguments: str) -> str:
    return json.dumps({"max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})


# json.dumps writes a lone surrogate as its escape, as a hostile client would.
LONE = "\ud800"
HOSTILE = [
    ("/v1/completions", json.dumps({"prompt": f"a{LONE}b", "max_tokens": 1}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["ok", "\udc00"], "max_tokens": 1}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x", "model": LONE, "max_tokens": 1}), "model"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": [LONE], "max_tokens": 1}), "stop"),
    ("/tokenize", json.dumps({"prompt": LONE}), "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": LONE}]}),
     "messages.0.content"),
    ("/v1/completions", json.dumps({"prompt": "x", "seed": 2**64}), "seed"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2**64}), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "min_tokens": 2**64}), "min_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": 2**64}),
     "max_completion_tokens"),
    ("/v1/chat/completions", _history_with_arguments(_deep(1100)),
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", _history_with_arguments(_deep(5000)),
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/completions", json.dumps({"prompt": "x", "structured_outputs": {
        "json": '{"a":' * 3000 + "1" + "}" * 3000}}), "structured_outputs.json"),
]


@pytest.mark.parametrize("path,raw,param", HOSTILE, ids=[p for _, _, p in HOSTILE])
def test_hostile_input_gets_a_400_naming_the_field(server, path, raw, param):
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_same_fields_within_bounds_are_served(server):
    fine = [("/v1/completions", json.dumps({"prompt": "a\U0001F600b", "max_tokens": 1,
                                            "seed": 2**64 - 1, "min_tokens": 1})),
            ("/v1/chat/completions", _history_with_arguments(_deep(MAX_JSON_DEPTH)))]
    for path, raw in fine:  # a surrogate pair is one character (an emoji), not an error
        assert _post(server, path, raw).status_code == 200


def test_the_models_deeply_nested_tool_call_stays_text():
    known = {"f"}
    for levels in (MAX_JSON_DEPTH + 1, 1100, 5000):
        arguments = _deep(levels)
        payload = json.dumps({"name": "f", "arguments": {"x": 1}})[:-1] + f', "y": {arguments}}}'
        assert parse_calls(payload, known) is None
        assert parse_calls(json.dumps({"name": "f", "arguments": arguments}), known) is None
        text = f"<tool_call>{payload}</tool_call>"
        assert split_tool_calls(text, known) == (text, [])
    assert parse_calls(json.dumps({"name": "f", "arguments": _deep(3)}), known)[0].name == "f"


def test_top_logprobs_keyed_by_text_keep_the_most_likely_of_tokens_that_collide():
    texts = {5: "a", 6: "b", 7: "a"}  # 5 and 7 decode alike (byte pieces, say)
    top = [(5, -0.1), (6, -1.0), (7, -2.0)]
    assert top_by_text(top, texts.__getitem__) == {"a": -0.1, "b": -1.0}
    reversed_best = [(7, -0.1), (6, -1.0), (5, -2.0)]
    shown = completion_logprobs([TokenLogprobs(7, -0.1, reversed_best)], texts.__getitem__)
    assert shown["top_logprobs"] == [{"a": -0.1, "b": -1.0}]
