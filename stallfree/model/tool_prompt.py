"""Tools in the prompt of a model whose chat template ignores them (SmolLM2's small models).

A template that handles tools itself (Qwen2.5, Llama 3.1, ...) gets `tools` and the
messages unchanged. Otherwise the conversation is rewritten in the format SmolLM2's
tool-calling training used (and Hermes-style models share): the tools listed as JSON
in <tools> tags in the system message, calls answered as a JSON list in <tool_call>
tags, and tool results passed back in <tool_response> tags in a user turn.
"""
from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "You can call functions to answer. These are available, as JSON schemas:\n"
    "<tools>{tools}</tools>\n"
    "To call one or more of them, reply with nothing but their calls as a JSON list, "
    "inside tool_call tags:\n"
    '<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]'
    "</tool_call>\n"
    "If no function fits, answer the user directly.")


def template_handles_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads `tools` (or tool calls) at all."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tool" in (template if isinstance(template, str) else json.dumps(template))


def _call_text(calls: list[dict[str, Any]]) -> str:
    listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
              for c in calls]
    return f"<tool_call>{json.dumps(listed, ensure_ascii=False)}</tool_call>"


def with_tools_in_messages(conversation: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The conversation as plain {'role', 'content'} messages carrying the tools, earlier
    calls and tool results as text."""
    messages: list[dict[str, str]] = []
    for m in conversation:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            content = (content + "\n" if content else "") + _call_text(m["tool_calls"])
            messages.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            messages.append({"role": "user",
                             "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            messages.append({"role": m["role"], "content": content})
    if tools:
        listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        text = _INSTRUCTIONS.format(tools=listed)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages
