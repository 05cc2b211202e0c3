"""Which tool-call format the served model writes: `--tool-call-parser`, as vLLM's.

`auto` reads the chat template: it shows the model how to call tools, so the format it
teaches is the one the model writes. A template that ignores tools gets them written
into the messages in <tool_call> tags (model/tool_prompt.py): hermes.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from .tool_parser import HERMES, ToolCallParser
from .tool_parser_llama3 import Llama3JsonParser
from .tool_parser_mistral import TOOL_CALLS, MistralParser

logger = logging.getLogger("stallfree.server")

PARSERS: dict[str, ToolCallParser] = {
    parser.name: parser for parser in (HERMES, Llama3JsonParser(), MistralParser())}
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, *PARSERS)

# Llama 3.1 / 3.2's instructions: 'Respond in the format {"name": function name,
# "parameters": dictionary of argument name and its value}.'
_LLAMA3_INSTRUCTIONS = re.compile(r'"name":\s*function name,\s*"parameters"')

# (what in the template, the parser it means), in order: the first found wins, so a
# template that teaches <tool_call> gets hermes, whatever else it mentions.
_SIGNS: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("<tool_call>", re.compile(re.escape("<tool_call>")), "hermes"),
    (TOOL_CALLS, re.compile(re.escape(TOOL_CALLS)), "mistral"),
    ("<|python_tag|>", re.compile(re.escape("<|python_tag|>")), "llama3_json"),
    ('"parameters" JSON instructions', _LLAMA3_INSTRUCTIONS, "llama3_json"),
)


def template_text(template: object) -> str:
    """A chat template's text: transformers keeps one string, or several named ones (a
    dict, or a list of {"name", "template"}) of which any may be used."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(template_text(t) for t in template.values())
    if isinstance(template, list):
        return "\n".join(template_text(t.get("template") if isinstance(t, dict) else t)
                         for t in template)
    return ""


def detect_tool_parser(template: object) -> tuple[str, str]:
    """The parser a chat template's tool format implies, and why (for the log)."""
    text = template_text(template)
    for sign, pattern, name in _SIGNS:
        if pattern.search(text):
            return name, f"the chat template has {sign}"
    if "tool" in text:
        return HERMES.name, "the chat template shows no format it knows"
    return HERMES.name, "the chat template ignores tools: they are written into the " \
                        "messages in <tool_call> tags"


def check_tool_call_parser(setting: object) -> str:
    """The setting, if it names a parser or `auto` (else a ValueError listing them)."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {setting!r}")
    return str(setting)


def choose_tool_parser(setting: str, tokenizer: Any) -> ToolCallParser:
    """The parser `setting` names, or with `auto` the one the tokenizer's chat template
    implies; the choice and why are logged."""
    if check_tool_call_parser(setting) == AUTO:
        name, why = detect_tool_parser(getattr(tokenizer, "chat_template", None))
        logger.info("tool-call parser: %s (auto: %s)", name, why)
    else:
        name = setting
        logger.info("tool-call parser: %s (--tool-call-parser)", name)
    return PARSERS[name]
