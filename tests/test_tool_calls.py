"""tool_choice auto: the model's own <tool_call> text becomes OpenAI tool_calls, whole and
streamed (a scripted fake engine writes the text); and tools in the chat template."""
from __future__ import annotations

import json

import openai
import pytest

from server_utils import FakeEngine, ThreadServer
from stallfree.model.tokenizer import chat_prompt_ids, load_tokenizer
from stallfree.server.api import build_app
from stallfree.server.tool_parser import ToolCallSplitter, split_tool_calls

KNOWN = ["get_weather", "add"]
TOOLS = [{"type": "function", "function": {
    "name": name, "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "a": {"type": "integer"}}}}} for name in KNOWN]
SMOL = ('Let me check.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "add", "arguments": {"a": 2}}]</tool_call>')
QWEN = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "parameters": {"a": 5}}\n</tool_call>')


# ---- the parser -----------------------------------------------------------------------
@pytest.mark.parametrize("text,content,calls", [
    (SMOL, "Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 2})]),
    (QWEN, "\n", [("get_weather", {"city": "Oslo"}), ("add", {"a": 5})]),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),
    ("<tool_call>[]</tool_call>Nothing to call.", "Nothing to call.", []),
    ("a < b <tool_ call", "a < b <tool_ call", []),
])
def test_split_whole_and_at_every_cut_agree(text, content, calls):
    def parsed(found):
        return [(c.name, json.loads(c.arguments)) for c in found]

    whole_content, whole_calls = split_tool_calls(text, KNOWN)
    assert (whole_content, parsed(whole_calls)) == (content, calls)
    for cut in range(len(text) + 1):  # the same result however the text streams in
        splitter = ToolCallSplitter(KNOWN)
        a, first = splitter.feed(text[:cut])
        b, second = splitter.feed(text[cut:])
        c, third = splitter.finish()
        assert (a + b + c, parsed(first + second + third)) == (content, calls), cut


def test_text_that_might_open_a_tag_is_held_back_only_until_clear():
    splitter = ToolCallSplitter(KNOWN)
    assert splitter.feed("Hello <tool") == ("Hello ", [])
    assert splitter.feed("box>") == ("<toolbox>", [])


# ---- through the server --------------------------------------------------------------
@pytest.fixture
def serve():
    servers = []

    def start(text: str) -> openai.OpenAI:
        engine = FakeEngine(step_delay=0.001, text=text)
        engine.max_model_len = 100_000  # the tool list makes long prompts
        server = ThreadServer(build_app(engine, "fake"))
        servers.append(server)
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    yield start
    for server in servers:
        server.stop()


def _ask(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Weather in Paris? And 2 + 0?"}],
        max_tokens=500, **kwargs)


def test_auto_tool_calls_whole_and_streamed(serve):
    client = serve(SMOL)
    done = _ask(client, tools=TOOLS)
    message, choice = done.choices[0].message, done.choices[0]
    assert choice.finish_reason == "tool_calls" and message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"}), ("add", {"a": 2})]
    assert len({c.id for c in message.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in message.tool_calls)

    content, calls, finish = "", {}, None
    for chunk in _ask(client, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] \
        == [("get_weather", {"city": "Paris"}), ("add", {"a": 2})]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_one_call_per_tag_and_parallel_tool_calls_false(serve):
    client = serve(QWEN)
    done = _ask(client, tools=TOOLS)
    assert [c.function.name for c in done.choices[0].message.tool_calls] == KNOWN
    single = _ask(client, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_and_no_tools_leave_the_text_alone(serve):
    client = serve(SMOL)
    for kwargs in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        done = _ask(client, **kwargs)
        assert done.choices[0].message.content == SMOL
        assert done.choices[0].message.tool_calls is None
        assert done.choices[0].finish_reason == "stop"


# ---- tools in the chat template ------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
]
# A template that reads tools and tool messages itself, as Qwen's and Llama 3.1's do.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %} FOR:{{ m.tool_call_id }}{% endif %}|{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_a_template_that_reads_tools_gets_them_unchanged(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    try:
        text = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY, False, TOOLS))
    finally:
        tokenizer.chat_template = original
    assert text == ('TOOLS:get_weather;add;|[user]Weather in Paris?|'
                    '[assistant]CALL:get_weather{"city": "Paris"}|'
                    '[tool]Sunny, 21 degrees FOR:call_1|')


def test_a_template_without_tools_gets_them_written_into_the_messages(tokenizer):
    text = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY, True, TOOLS))
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    assert '"name": "get_weather"' in system and '"name": "add"' in system
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}]</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY[:1], True))
    assert "<tools>" not in plain  # no tools, no tool text
