"""Mistral's tool calls (vLLM's `mistral`): after `[TOOL_CALLS]`, to the end of the reply.

Mistral 7B v0.3 and Mixtral 8x22B write `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`;
tokenizers from v11 on (Mistral Small 3.2, Magistral) write each call as
`[TOOL_CALLS]name[ARGS]{...}`. `[TOOL_CALLS]` and `[ARGS]` are special tokens, kept for
tool requests (skip_special_tokens off). Where a client skips them all the same, a reply
whose first text is a JSON list of objects opens a call as well (the older form without
its marker); the newer form needs its markers in the text.
"""
from __future__ import annotations

from collections.abc import Collection

from .tool_parser import ParsedCall, ToolCallParser, calls_of, load_json, parse_calls

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    needs_special_tokens = True
    special_markers = (TOOL_CALLS, ARGS)
    leading = ('[{"',)  # ignoring whitespace

    def parse(self, payload: str, known: Collection[str]) -> list[ParsedCall] | None:
        if ARGS not in payload:
            return parse_calls(payload, known)
        # The newer form: the payload runs on through later calls' own markers.
        items = []
        for part in payload.split(TOOL_CALLS):
            name, found, arguments = part.partition(ARGS)
            try:
                value = load_json(arguments) if found else None
            except ValueError:
                return None
            if not isinstance(value, dict):
                return None
            items.append({"name": name.strip(), "arguments": value})
        return calls_of(items, known)
