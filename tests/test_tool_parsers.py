"""Tool-call parsers per model family (hermes, llama3_json, mistral): whole and streamed
text agree at every split, `auto` picks one from the chat template, and the
--tool-call-parser flag; then through the server with a scripted fake engine."""
from __future__ import annotations

import json
import logging

import openai
import pytest

from server_utils import FakeEngine, FakeTokenizer, ThreadServer
from stallfree.cli import build_parser
from stallfree.cli.args import settings_from_args
from stallfree.server.api import build_app
from stallfree.server.config import ServerConfig
from stallfree.server.structured_protocol import Tool
from stallfree.server.tool_parser import ToolCallSplitter, load_json, split_tool_calls
from stallfree.server.tool_parser_registry import (
    PARSERS,
    TOOL_CALL_PARSERS,
    choose_tool_parser,
    detect_tool_parser,
)
from stallfree.server.tools import ToolUse

KNOWN = ["get_weather", "add"]
PARIS, ADD2 = ("get_weather", {"city": "Paris"}), ("add", {"a": 2})


def _parsed(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def split_everywhere(parser: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """The text's content and calls, checked to be the same whole, cut in two at every
    point, and fed a character at a time."""
    whole_content, whole_calls = split_tool_calls(text, KNOWN, PARSERS[parser])
    expected = (whole_content, _parsed(whole_calls))
    pieces = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    for chunks in pieces:
        splitter = ToolCallSplitter(KNOWN, PARSERS[parser])
        content, calls = "", []
        for chunk in chunks:
            more, found = splitter.feed(chunk)
            content, calls = content + more, calls + found
        rest, found = splitter.finish()
        assert (content + rest, _parsed(calls + found)) == expected, chunks
    return expected


HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_CALLS = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "add", "arguments": {"a": 2}}]')


@pytest.mark.parametrize("parser,text,content,calls", [
    # hermes: today's format, unchanged
    ("hermes", HERMES_CALL, "", [PARIS]),
    ("hermes", 'Let me check.' + HERMES_CALL + '<tool_call>[{"name": "add", "arguments": '
               '{"a": 2}}]</tool_call>', "Let me check.", [PARIS, ADD2]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {</tool_call>',
     '<tool_call>{"name": "add", "arguments": {</tool_call>', []),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("hermes", LLAMA_CALL, LLAMA_CALL, []),  # another format's call is plain text
    # llama3_json: the whole reply, after <|python_tag|> or not, calls separated by ;
    ("llama3_json", LLAMA_CALL, "", [PARIS]),
    ("llama3_json", "\n " + LLAMA_CALL + "\n", "", [PARIS]),
    ("llama3_json", "<|python_tag|>" + LLAMA_CALL, "", [PARIS]),
    ("llama3_json", LLAMA_CALL + '; {"name": "add", "arguments": {"a": 2}};', "",
     [PARIS, ADD2]),
    ("llama3_json", "Let me look.<|python_tag|>" + LLAMA_CALL, "Let me look.", [PARIS]),
    ("llama3_json", '{"name": "add", "parameters": {"a": {"b": {"c": [1, "}"]}}}}', "",
     [("add", {"a": {"b": {"c": [1, "}"]}}})]),
    ("llama3_json", LLAMA_CALL[:-1], LLAMA_CALL[:-1], []),  # malformed
    ("llama3_json", LLAMA_CALL + " and more", LLAMA_CALL + " and more", []),
    ("llama3_json", '{"name": "nope", "parameters": {}}',
     '{"name": "nope", "parameters": {}}', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # a JSON answer
    ("llama3_json", "Here: " + LLAMA_CALL, "Here: " + LLAMA_CALL, []),  # not the reply
    ("llama3_json", "{} is empty", "{} is empty", []),
    # mistral: [TOOL_CALLS] then a list; the marker dropped; the newer [ARGS] form
    ("mistral", "[TOOL_CALLS]" + MISTRAL_CALLS, "", [PARIS, ADD2]),
    ("mistral", "Sure.[TOOL_CALLS] " + MISTRAL_CALLS, "Sure.", [PARIS, ADD2]),
    ("mistral", " " + MISTRAL_CALLS, "", [PARIS, ADD2]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 2}',
     "", [PARIS, ADD2]),
    ("mistral", "[TOOL_CALLS]" + MISTRAL_CALLS[:-2], "[TOOL_CALLS]" + MISTRAL_CALLS[:-2], []),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": ', '[TOOL_CALLS]add[ARGS]{"a": ', []),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
     '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', []),
    ("mistral", "[a link](https://example.com) [TOOL", "[a link](https://example.com) [TOOL",
     []),
    ("mistral", "[[1, 2]]", "[[1, 2]]", []),
])
def test_whole_and_streamed_at_every_split_agree(parser, text, content, calls):
    assert split_everywhere(parser, text) == (content, calls)


def test_json_with_more_after_it_is_not_json_as_before():
    # A client's tool-call arguments that are not JSON pass on as text (structured_protocol):
    # the sequence reader under load_json must still call extra data a JSONDecodeError.
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        load_json('{"a": 1} x')


def test_text_that_might_open_a_call_is_held_back_only_until_clear():
    llama = ToolCallSplitter(KNOWN, PARSERS["llama3_json"])
    assert llama.feed(" \n") == ("", [])  # blanks first: a call may follow
    assert llama.feed("{") == ("", [])
    assert llama.feed("}") == (" \n{}", [])  # no key: not a call, and no longer the start
    assert llama.feed(' {"name"') == (' {"name"', [])
    mistral = ToolCallSplitter(KNOWN, PARSERS["mistral"])
    assert mistral.feed("[") == ("", [])
    assert mistral.feed("TOOL") == ("", [])  # may be [TOOL_CALLS]
    assert mistral.feed("S] are") == ("[TOOLS] are", [])
    assert mistral.feed(" [TOOL_CALLS][") == (" ", [])  # the call runs to the end
    assert mistral.finish() == ("[TOOL_CALLS][", [])


def _reply(parser: str, parallel: bool = True):
    tools = [Tool.model_validate({"type": "function", "function": {"name": name}})
             for name in KNOWN]
    return ToolUse.of(tools, "auto", parallel).reply(PARSERS[parser])


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", LLAMA_CALL + '; {"name": "add", "parameters": {"a": 2}}'),
    ("mistral", "[TOOL_CALLS]" + MISTRAL_CALLS),
])
def test_replies_as_openai_tool_calls(parser, text):
    message, finish = _reply(parser).message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [PARIS, ADD2]
    message, _ = _reply(parser, parallel=False).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    stream = _reply(parser)
    deltas = [stream.delta(char, None) for char in text] + [stream.delta("", "stop")]
    assert not any("content" in delta for delta, _ in deltas)  # nothing leaks as content
    assert [c["index"] for delta, _ in deltas for c in delta.get("tool_calls", [])] == [0, 1]
    assert deltas[-1][1] == "tool_calls"


# ---- auto: from the chat template ----------------------------------------------------
QWEN_TEMPLATE = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}')
LLAMA31_TEMPLATE = (
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.' }}{{- \"Do not use variables.\\n\\n\" }}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}")
LLAMA32_TEMPLATE = ("{{- 'Respond in the format {\"name\": function name, \"parameters\": "
                    "dictionary of argument name and its value}.' }}")
MISTRAL_TEMPLATE = ('{%- elif message.tool_calls is defined and message.tool_calls is not '
                    'none %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}')
PLAIN_TEMPLATE = ("{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
                  "{{ message['content'] }}<end_of_turn>\n{% endfor %}")  # Gemma's: no tools


@pytest.mark.parametrize("template,expected", [
    (QWEN_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    (LLAMA32_TEMPLATE, "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"),
    (PLAIN_TEMPLATE, "hermes"),
    (None, "hermes"),
    ({"default": PLAIN_TEMPLATE, "tool_use": MISTRAL_TEMPLATE}, "mistral"),
    ([{"name": "default", "template": PLAIN_TEMPLATE},
      {"name": "tool_use", "template": QWEN_TEMPLATE + LLAMA31_TEMPLATE}], "hermes"),
])
def test_auto_detects_the_parser_from_the_chat_template(template, expected):
    name, why = detect_tool_parser(template)
    assert name == expected and why


def test_the_choice_is_logged_and_a_named_parser_overrides_the_template(caplog):
    tokenizer = FakeTokenizer()
    tokenizer.chat_template = MISTRAL_TEMPLATE
    with caplog.at_level(logging.INFO, logger="stallfree.server"):
        assert choose_tool_parser("auto", tokenizer) is PARSERS["mistral"]
        assert choose_tool_parser("llama3_json", tokenizer) is PARSERS["llama3_json"]
    assert "tool-call parser: mistral (auto: the chat template has [TOOL_CALLS])" \
        in caplog.text
    assert "tool-call parser: llama3_json (--tool-call-parser)" in caplog.text
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        choose_tool_parser("llama", tokenizer)


# ---- the setting and its flag --------------------------------------------------------
def test_the_setting_and_the_flag(capsys):
    assert TOOL_CALL_PARSERS == ("auto", "hermes", "llama3_json", "mistral")
    assert ServerConfig().tool_call_parser == "auto"
    assert ServerConfig(tool_call_parser="mistral").tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes, "
                                         "llama3_json, mistral, got 'qwen'"):
        ServerConfig(tool_call_parser="qwen")
    parser = build_parser()
    for argv, expected in ((["serve"], "auto"),
                           (["serve", "--tool-call-parser", "llama3_json"], "llama3_json")):
        args = parser.parse_args(argv)
        assert settings_from_args(ServerConfig, args)["tool_call_parser"] == expected
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", "--tool-call-parser", "qwen"])
    assert exit_.value.code == 2
    assert "--tool-call-parser: invalid choice: 'qwen' (choose from" in capsys.readouterr().err


# ---- through the server ----------------------------------------------------------------
class TemplateTokenizer(FakeTokenizer):
    """The fake tokenizer with a chat template's text (which it does not run)."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True,
                            **_):
        return super().apply_chat_template(conversation, add_generation_prompt, tokenize)


@pytest.fixture
def serve():
    servers = []

    def start(text: str, template: str | None = None, parser: str | None = None):
        engine = FakeEngine(step_delay=0.001, text=text)
        engine.max_model_len = 100_000  # the tool list makes long prompts
        if template is not None:
            engine.tokenizer = TemplateTokenizer(template)
        app = build_app(engine, "fake")
        if parser is not None:  # as `stallfree serve --tool-call-parser` sets it
            app.state.tool_parser = PARSERS[parser]
        servers.append(ThreadServer(app))
        return openai.OpenAI(base_url=servers[-1].url + "/v1", api_key="x", max_retries=0)

    yield start
    for server in servers:
        server.stop()


TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in KNOWN]


@pytest.mark.parametrize("setup,text", [
    ({"template": LLAMA31_TEMPLATE}, "<|python_tag|>" + LLAMA_CALL),
    ({"template": MISTRAL_TEMPLATE}, "Checking.[TOOL_CALLS]" + MISTRAL_CALLS),
    ({"parser": "mistral"}, "Checking.[TOOL_CALLS]" + MISTRAL_CALLS),
])
def test_the_apps_parser_reads_the_calls_whole_and_streamed(serve, setup, text):
    client = serve(text, **setup)
    ask = {"model": "fake", "messages": [{"role": "user", "content": "Paris?"}],
           "max_tokens": 500, "tools": TOOLS}
    expected = [PARIS] if "python_tag" in text else [PARIS, ADD2]
    message = client.chat.completions.create(**ask).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == expected
    content, calls = "", {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
    assert content == (message.content or "") and list(calls.values()) == expected
