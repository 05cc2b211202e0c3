"""The model's own tool calls in its text: JSON inside <tool_call> tags, as SmolLM2 writes
them (a list of calls per tag) and Qwen and Hermes-style models do (one call per tag)."""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"
# Tool arguments nested deeper than this are refused (from a client) or left as text (from
# the model): Python's parser and the chat template's `tojson` recurse once per level, and
# about a thousand levels exhaust the interpreter's stack.
MAX_JSON_DEPTH = 64


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
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


def parse_calls(payload: str, known: Collection[str]) -> list[ParsedCall] | None:
    """The calls in one payload: a JSON object or a list of them, each {"name", "arguments"}
    ("parameters" is read too). None unless it is all well-formed calls of known tools."""
    try:
        data = load_json(payload)
    except ValueError:  # not JSON, or nested too deeply to be a call: the text stays text
        return None
    calls = []
    for item in data if isinstance(data, list) else [data]:
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


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallSplitter:
    """Splits text, as it streams in, into content and well-formed calls.

    Text that might begin a tag is held back until it is clear; a tag's payload
    is held until its closing tag, then becomes calls, or stays content if it is
    not a well-formed call of a known tool (nothing the model wrote is dropped).
    """

    def __init__(self, known: Collection[str]) -> None:
        self.known = known
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The content and calls that `text` (appended to what came before) completes."""
        self._buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    break
                payload, self._buffer = self._buffer[:end], self._buffer[end + len(END):]
                self._in_call = False
                parsed = parse_calls(payload, self.known)
                if parsed is None:
                    content.append(START + payload + END)
                else:
                    calls.extend(parsed)
                continue
            start = self._buffer.find(START)
            if start < 0:
                keep = _held_back(self._buffer, START)
                cut = len(self._buffer) - keep
                content.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(START):]
            self._in_call = True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """Whatever is held back, at the end of the text. An unclosed tag whose payload
        is a well-formed call counts (models stop right after the JSON at times)."""
        buffer, in_call = self._buffer, self._in_call
        self._buffer, self._in_call = "", False
        if not in_call:
            return buffer, []
        parsed = parse_calls(buffer, self.known)
        return ("", parsed) if parsed is not None else (START + buffer, [])


def split_tool_calls(text: str, known: Collection[str]) -> tuple[str, list[ParsedCall]]:
    """A whole text's content (outside well-formed tool-call tags) and its calls."""
    splitter = ToolCallSplitter(known)
    content, calls = splitter.feed(text)
    rest, more = splitter.finish()
    return content + rest, calls + more
