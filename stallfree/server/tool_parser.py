"""The model's own tool calls in its text, and splitting that text, as it streams, into
content and calls.

Each model family writes calls its own way; a `ToolCallParser` describes one way (what
opens a call, what closes it, how its text becomes calls) and `ToolCallSplitter` applies
any of them to streamed text. The default, `HermesParser`, reads JSON inside <tool_call>
tags, as SmolLM2 writes them (a list of calls per tag) and Qwen and Hermes-style models
do (one call per tag); the others are in tool_parser_*.py, chosen by
tool_parser_registry.py.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import ClassVar

# Tool arguments nested deeper than this are refused (from a client) or left as text (from
# the model): Python's parser and the chat template's `tojson` recurse once per level, and
# about a thousand levels exhaust the interpreter's stack.
MAX_JSON_DEPTH = 64
_JSON_BLANKS = " \t\n\r"  # JSON's whitespace (str.strip's is wider)


def json_depth(value: object) -> int:
    """How deeply lists and objects nest in parsed JSON (a scalar is 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def load_json(text: str) -> object:
    """`json.loads(text)`, refusing nesting beyond MAX_JSON_DEPTH with a ValueError (a
    JSONDecodeError where the text is not JSON at all)."""
    return load_json_values(text, max_values=1)[0]


def load_json_values(text: str, separator: str = "", max_values: int | None = None
                     ) -> list[object]:
    """The JSON values written one after another in `text`, each optionally followed by
    `separator` (whitespace around either is allowed); at least one. A ValueError where
    it is not that, or nests beyond MAX_JSON_DEPTH."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    try:
        while True:
            pos = len(text) - len(text[pos:].lstrip(_JSON_BLANKS))
            if pos == len(text) and values:
                return values
            if max_values is not None and len(values) == max_values:
                raise json.JSONDecodeError("Extra data", text, pos)  # as json.loads says
            value, pos = decoder.raw_decode(text, pos)
            if json_depth(value) > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            values.append(value)
            rest = text[pos:].lstrip(_JSON_BLANKS)
            if separator and rest.startswith(separator):
                pos = len(text) - len(rest) + len(separator)
    except RecursionError:  # deeper than the interpreter's stack: certainly too deep
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


def calls_of(items: Iterable[object], known: Collection[str]) -> list[ParsedCall] | None:
    """Parsed JSON objects as calls, each {"name", "arguments"} ("parameters" is read too,
    as Llama writes it). None unless every one is a well-formed call of a known tool."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # already JSON text: it must parse
            try:
                load_json(arguments)
            except ValueError:
                return None
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        else:
            return None
        calls.append(ParsedCall(item["name"], arguments))
    return calls


def parse_calls(payload: str, known: Collection[str]) -> list[ParsedCall] | None:
    """The calls in one payload: a JSON object or a list of them (see `calls_of`)."""
    try:
        data = load_json(payload)
    except ValueError:  # not JSON, or nested too deeply to be a call: the text stays text
        return None
    return calls_of(data if isinstance(data, list) else [data], known)


def _first_nonblank(text: str, n: int) -> str:
    """The first `n` characters of `text` that are not whitespace (fewer if it has not)."""
    seen: list[str] = []
    for char in text:
        if not char.isspace():
            seen.append(char)
            if len(seen) == n:
                break
    return "".join(seen)


class ToolCallParser:
    """One model family's way of writing tool calls in its text.

    A call opens at one of `markers`, anywhere in the text, or at one of `leading` when
    that is the first text of the reply (matched ignoring whitespace: for formats where
    the whole reply is the call, and whose marker the detokenizer may have dropped as a
    special token). It ends at `end`, or, without one, at the end of the reply.

    A format written with special tokens says so (`needs_special_tokens`, and which ones it
    reads: `special_markers`): the detokenizer drops special tokens unless the request says
    otherwise, so the chat route keeps them for this parser's tool requests, then strips
    every other special token's text from the reply's content (tools.ToolReply).
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[tuple[str, ...]] = ()
    end: ClassVar[str | None] = None
    needs_special_tokens: ClassVar[bool] = False
    special_markers: ClassVar[tuple[str, ...]] = ()

    def parse(self, payload: str, known: Collection[str]) -> list[ParsedCall] | None:
        """The calls in one call's text (after its marker; a leading opener included),
        or None to leave the text as content."""
        raise NotImplementedError

    def leading_state(self, text: str) -> bool | None:
        """Whether `text`, the reply so far (leading whitespace stripped), opens with one
        of `leading`: True, False, or None while too short to tell."""
        undecided = False
        for opener in self.leading:
            seen = _first_nonblank(text, len(opener))
            if seen == opener:
                return True
            undecided |= opener.startswith(seen)
        return None if undecided else False


class HermesParser(ToolCallParser):
    """JSON in <tool_call> tags: the default, and the format model/tool_prompt.py teaches
    a model whose chat template ignores tools."""

    name = "hermes"
    markers = ("<tool_call>",)
    end = "</tool_call>"
    # The tags are text, or added tokens that are not special (Qwen2.5's and Qwen3's), so
    # they reach the parser with special tokens skipped, as they always have.
    needs_special_tokens = False

    def parse(self, payload: str, known: Collection[str]) -> list[ParsedCall] | None:
        return parse_calls(payload, known)


HERMES = HermesParser()


def _held_back(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of `text` could be the start of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ToolCallSplitter:
    """Splits text, as it streams in, into content and well-formed calls.

    Text that might begin a call is held back until it is clear; a call's text is held
    until it ends, then becomes calls, or stays content if it is not a well-formed call
    of a known tool (nothing the model wrote is dropped).
    """

    def __init__(self, known: Collection[str], parser: ToolCallParser = HERMES) -> None:
        self.known = known
        self.parser = parser
        self._buffer = ""
        self._opener: str | None = None  # the open call's marker (or leading blanks)
        self._at_start = bool(parser.leading)  # nothing but blanks so far: may open one

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The content and calls that `text` (appended to what came before) completes."""
        self._buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        end = self.parser.end
        while True:
            if self._opener is not None:
                if end is None:  # the call runs to the end of the reply: see finish()
                    break
                cut = self._buffer.find(end)
                if cut < 0:
                    break
                payload, self._buffer = self._buffer[:cut], self._buffer[cut + len(end):]
                self._close(payload, end, content, calls)
                continue
            if self._at_start:
                stripped = self._buffer.lstrip()
                state = self.parser.leading_state(stripped) if stripped else None
                if state is None:  # blanks, or maybe an opener: hold it all
                    break
                self._at_start = False
                if state:
                    self._opener = self._buffer[:len(self._buffer) - len(stripped)]
                    self._buffer = stripped
                    continue
            found = [(i, m) for m in self.parser.markers if (i := self._buffer.find(m)) >= 0]
            if not found:
                cut = len(self._buffer) - _held_back(self._buffer, self.parser.markers)
                content.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            start, marker = min(found)
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(marker):]
            self._opener = marker
        return "".join(content), calls

    def _close(self, payload: str, end: str, content: list[str],
               calls: list[ParsedCall]) -> None:
        """One call's text read: its calls, or (not a call) the text back as content."""
        parsed = self.parser.parse(payload, self.known)
        if parsed is None:
            content.append(f"{self._opener}{payload}{end}")
        else:
            calls.extend(parsed)
        self._opener = None

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """Whatever is held back, at the end of the text. A call still open counts if its
        text is well-formed (for a format without an end, that is how a call ends; others'
        models stop right after the JSON at times)."""
        buffer, self._buffer = self._buffer, ""
        self._at_start = False
        if self._opener is None:
            return buffer, []
        content: list[str] = []
        calls: list[ParsedCall] = []
        self._close(buffer, "", content, calls)
        return "".join(content), calls


def split_tool_calls(text: str, known: Collection[str], parser: ToolCallParser = HERMES
                     ) -> tuple[str, list[ParsedCall]]:
    """A whole text's content (outside well-formed calls) and its calls."""
    splitter = ToolCallSplitter(known, parser)
    content, calls = splitter.feed(text)
    rest, more = splitter.finish()
    return content + rest, calls + more
