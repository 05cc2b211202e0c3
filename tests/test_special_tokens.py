"""skip_special_tokens: special tokens' text kept or dropped by the incremental detokenizer
(streamed and whole alike), the stop token left out, offline through SamplingParams, the
server's request field, and the chat route keeping special tokens for a tool-call parser
that reads them (Mistral's [TOOL_CALLS]) while stripping the others from the reply."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from server_utils import FakeEngine, FakeTokenizer, ThreadServer
from stallfree import LLM, SamplingParams
from stallfree.detokenizer import IncrementalDetokenizer
from stallfree.request import RequestStatus
from stallfree.request_group import RequestGroup
from stallfree.server.api import build_app
from stallfree.server.structured_protocol import Tool
from stallfree.server.tool_parser_registry import PARSERS
from stallfree.server.tool_parser_specials import SpecialTexts
from stallfree.server.tools import ToolUse

TURN = "<|im_start|>assistant\nCafé 🙂 déjà vu<|im_end|>\n<|im_start|>user\nok"
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok():
    from tiny_models import default_tokenizer

    return default_tokenizer()  # SmolLM2's: <|im_start|> and <|im_end|> are special


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas, hit = [], False
    for token in ids:
        delta, hit = detok.append(token)
        deltas.append(delta)
        if hit:
            break
    return deltas + [detok.flush()], hit


@pytest.mark.parametrize("skip", [False, True])
def test_streamed_increments_equal_the_whole_decode(tok, skip):
    ids = tok(TURN, add_special_tokens=False)["input_ids"]
    assert EOS in ids and 1 in ids  # the specials are single tokens
    detok = IncrementalDetokenizer(tok, stop=[], skip_special_tokens=skip)
    deltas, hit = _feed(detok, ids)
    whole = tok.decode(ids, skip_special_tokens=skip)
    assert not hit and "".join(deltas) == detok.text == whole
    assert ("<|im_end|>" in whole) is (not skip)  # True: dropped, as always
    if not skip:  # a special token's text arrives whole, in its own step
        assert "<|im_end|>" in deltas


def test_stop_strings_match_special_tokens_text_only_when_kept(tok):
    ids = tok(TURN, add_special_tokens=False)["input_ids"]
    kept = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    deltas, hit = _feed(kept, ids)
    assert hit and "".join(deltas) == "<|im_start|>assistant\nCafé 🙂 déjà vu"
    dropped = IncrementalDetokenizer(tok, stop=["<|im_end|>"])
    deltas, hit = _feed(dropped, ids)
    assert not hit and "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def _group_text(tok, ids: list[int], **params) -> str:
    """`ids` through a RequestGroup, the engine's path: each token appended to the child
    first, and an EOS finishing it, as the scheduler does."""
    group = RequestGroup("r", None, [1], SamplingParams(max_tokens=50, **params), 0.0, tok,
                         frozenset({EOS}))
    child, streamed = group.children[0], ""
    for token in ids:
        child.output_token_ids.append(token)
        if token == EOS:
            child.status = RequestStatus.FINISHED_STOPPED
        delta, _ = group.append(0, token, None)
        streamed += delta
    streamed += group.detokenizers[0].flush()
    assert streamed == group.output().outputs[0].text
    return streamed


def test_the_stop_token_is_left_out_of_kept_special_tokens(tok):
    ids = tok("<|im_start|>Hi there<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == EOS
    assert _group_text(tok, ids, skip_special_tokens=False) == "<|im_start|>Hi there"
    assert _group_text(tok, ids, skip_special_tokens=False, include_stop_str_in_output=True) \
        == "<|im_start|>Hi there<|im_end|>"
    assert _group_text(tok, ids) == "Hi there"  # the default, unchanged


def test_sampling_params_validates_the_field():
    assert SamplingParams().skip_special_tokens is True
    assert SamplingParams(skip_special_tokens=False).skip_special_tokens is False
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
            SamplingParams(skip_special_tokens=bad)


@pytest.fixture(scope="module")
def special_llm(tmp_path_factory):
    """A tiny model whose logits are all 0: greedy writes token 0, <|endoftext|>, a special
    token that is not its EOS, every step."""
    import torch

    from tiny_models import build_tiny_model, default_tokenizer

    model = build_tiny_model()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    folder = tmp_path_factory.mktemp("tiny_zero_head")
    model.save_pretrained(folder, safe_serialization=True)
    default_tokenizer().save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22)
    yield llm
    llm.shutdown()


def test_offline_generate_takes_it_through_sampling_params(special_llm):
    def text(**params) -> tuple[str, str]:
        out = special_llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=3,
                                                        **params))[0]
        assert out.token_ids[0] == 0
        return out.text, out.finish_reason

    assert text() == ("", "length")
    assert text(skip_special_tokens=False) == ("<|endoftext|>" * 3, "length")
    # A stop token's own text is left out, as vLLM leaves it, unless asked for.
    assert text(skip_special_tokens=False, stop_token_ids=[0]) == ("", "stop")
    assert text(skip_special_tokens=False, stop_token_ids=[0],
                include_stop_str_in_output=True) == ("<|endoftext|>", "stop")


# ---- the server ----------------------------------------------------------------------
class RecordingEngine(FakeEngine):
    """The fake engine, keeping the sampling parameters of every request it is given."""

    def __init__(self, **kwargs) -> None:
        super().__init__(step_delay=0.001, **kwargs)
        self.max_model_len = 100_000  # the tool list makes long prompts
        self.params: list[SamplingParams] = []

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        self.params.append(params)
        super().add_request(request_id, prompt, params, arrival_time)


class SpecialTokenizer(FakeTokenizer):
    """The fake tokenizer with special tokens of Mistral's, as transformers lists them."""

    SPECIAL = ("</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]")

    def __init__(self) -> None:
        self.added_tokens_decoder = {i: SimpleNamespace(content=text, special=True)
                                     for i, text in enumerate(self.SPECIAL)}


@pytest.fixture
def serve():
    servers = []

    def start(parser: str | None = None, text: str | None = None,
              tokenizer: FakeTokenizer | None = None) -> tuple[str, RecordingEngine]:
        engine = RecordingEngine(text=text)
        if tokenizer is not None:
            engine.tokenizer = tokenizer
        app = build_app(engine, "fake")
        if parser is not None:  # as `stallfree serve --tool-call-parser` sets it
            app.state.tool_parser = PARSERS[parser]
        servers.append(ThreadServer(app))
        return servers[-1].url, engine

    yield start
    for server in servers:
        server.stop()


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Paris?"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "add")]


@pytest.mark.parametrize("path,base", [("/v1/completions",
                                        {"model": "fake", "prompt": "x", "max_tokens": 2}),
                                       ("/v1/chat/completions", CHAT)])
def test_the_request_field_is_a_bool_or_a_400(serve, path, base):
    url, engine = serve()
    for bad in ("false", 0, 1, None, [False]):
        r = httpx.post(url + path, json={**base, "skip_special_tokens": bad}, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "skip_special_tokens"
    for value in (False, True):
        r = httpx.post(url + path, json={**base, "skip_special_tokens": value}, timeout=30)
        assert r.status_code == 200, r.text
        assert engine.params[-1].skip_special_tokens is value
    assert httpx.post(url + path, json=base, timeout=30).status_code == 200
    assert engine.params[-1].skip_special_tokens is True


@pytest.mark.parametrize("parser,extra,kept", [
    ("mistral", {"tools": TOOLS}, True),
    ("llama3_json", {"tools": TOOLS}, True),
    ("hermes", {"tools": TOOLS}, False),  # <tool_call> is not a special token: unchanged
    ("mistral", {}, False),  # no tools
    ("mistral", {"tools": TOOLS, "tool_choice": "none"}, False),
    ("mistral", {"tools": TOOLS, "skip_special_tokens": True}, False),  # the client's say
])
def test_the_chat_route_keeps_special_tokens_for_a_parser_that_reads_them(
        serve, parser, extra, kept):
    url, engine = serve(parser)
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    assert engine.params[-1].skip_special_tokens is (not kept)


CALLS = '[{"name": "get_weather", "arguments": {"city": "<s>Paris</s>"}}, ' \
        '{"name": "add", "arguments": {"a": 2}}]'


def test_kept_special_tokens_other_than_the_parsers_are_stripped_from_content(serve):
    """What a Mistral model writes with special tokens kept: its markers reach the parser;
    a stray [INST] and an end token before the real end (say, under min_tokens) do not
    reach the client; a call's arguments are kept as written, "</s>" in them too."""
    text = "Check[INST]ing.</s>[TOOL_CALLS]" + CALLS
    url, _ = serve("mistral", text, SpecialTokenizer())
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = {**CHAT, "max_tokens": 500, "tools": TOOLS}
    expected = [("get_weather", {"city": "<s>Paris</s>"}), ("add", {"a": 2})]

    def calls_of(message) -> list[tuple[str, dict]]:
        return [(c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls]

    message = client.chat.completions.create(**ask).choices[0].message
    assert message.content == "Checking." and calls_of(message) == expected
    content, calls = "", {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
    assert content == "Checking." and list(calls.values()) == expected
    # A client that keeps special tokens itself gets them all.
    mine = client.chat.completions.create(**ask, extra_body={"skip_special_tokens": False})
    assert mine.choices[0].message.content == "Check[INST]ing.</s>"
    assert calls_of(mine.choices[0].message) == expected


def test_a_special_token_split_over_deltas_is_stripped_whole():
    specials = SpecialTexts.of(["<|eot_id|>", "<|eom_id|>"])
    use = ToolUse.of([Tool.model_validate(TOOLS[0])], "auto", True)
    text = ('Sure<|eot_id|> <|e<|eom_id|><|python_tag|>{"name": "get_weather", '
            '"parameters": {"html": "<|eot_id|>"}}')
    whole, _ = use.reply(PARSERS["llama3_json"], specials).message(text, "stop")
    assert whole["content"] == "Sure <|e"
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"html": "<|eot_id|>"}
    for size in (1, 2, 3, 7):
        reply = use.reply(PARSERS["llama3_json"], specials)
        deltas = [reply.delta(text[i:i + size], None)[0] for i in range(0, len(text), size)]
        deltas.append(reply.delta("", "stop")[0])
        content = "".join(d.get("content", "") for d in deltas)
        arguments = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])]
        assert content == "Sure <|e" and arguments == [whole["tool_calls"][0]["function"]
                                                       ["arguments"]]
