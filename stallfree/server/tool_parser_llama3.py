"""Llama 3.1 / 3.2's JSON tool calls (vLLM's `llama3_json`).

Llama 3.1's chat template asks the model to answer a call with nothing but
`{"name": function name, "parameters": {...}}`; several calls are separated by `;`.
Calls to Python-coded tools may follow `<|python_tag|>`. That tag is a special token,
kept for tool requests (skip_special_tokens off); a client that skips special tokens
drops it all the same, so a reply whose first text is a JSON object opens a call too;
a JSON answer that is not a call of a known tool stays content (after the whole reply
is in, since until then it may still become one).
"""
from __future__ import annotations

from collections.abc import Collection

from .tool_parser import ParsedCall, ToolCallParser, calls_of, load_json_values


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    needs_special_tokens = True
    special_markers = markers
    leading = ('{"',)  # an object with a first key; ignoring whitespace

    def parse(self, payload: str, known: Collection[str]) -> list[ParsedCall] | None:
        try:
            objects = load_json_values(payload, separator=";")
        except ValueError:
            return None
        return calls_of(objects, known)
