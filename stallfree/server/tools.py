"""Tool calling on the chat API: what `tool_choice` constrains, and each choice's output
as OpenAI's `tool_calls` (whole, or streamed as deltas).

`none`: the tools are not shown to the model and its text is the answer. `auto`: the
model sees the tools and decides; calls it writes in its own format (a ToolCallParser,
chosen per server: tool_parser_registry) become tool_calls. `required`: decoding is
constrained to a JSON list of one or more calls of the given tools. A named function:
decoding is constrained to that function's arguments.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ..structured_outputs import ConstraintError, StructuredOutputs
from .structured_protocol import Tool, ToolChoice
from .tool_parser import (
    HERMES,
    ParsedCall,
    ToolCallParser,
    ToolCallSplitter,
    parse_calls,
    split_tool_calls,
)
from .tool_parser_specials import NO_SPECIALS, SpecialTexts, SpecialTokenStripper

_NO_PARAMETERS = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return _NO_PARAMETERS if params is None else params


@dataclass
class ToolUse:
    """A chat request's tools and its resolved tool_choice."""

    tools: list[Tool]
    choice: str  # "none", "auto", "required", or the name of the function it must call
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None,
           parallel: bool | None) -> ToolUse | None:
        """None when the request involves no tools; ConstraintError when it is inconsistent."""
        tools = tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ConstraintError("tools", "function names must be unique")
        if choice is None:
            choice = "auto" if tools else "none"
        if not isinstance(choice, str):
            choice = choice.function.name
            if choice not in names:
                raise ConstraintError("tool_choice", f"names function {choice!r}, which is "
                                                     f"not among the tools")
        elif choice == "required" and not tools:
            raise ConstraintError("tool_choice", "is 'required' but no tools are given")
        if not tools:
            return None
        return cls(tools, choice, parallel is not False)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (none for tool_choice none)."""
        if self.choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def parameter_schemas(self) -> list[StructuredOutputs]:
        """Every tool's parameters as a constraint, to check that each is a JSON schema."""
        return [StructuredOutputs(json=_parameters(t), source=f"tools[{i}].function.parameters")
                for i, t in enumerate(self.tools)]

    def constraint(self) -> StructuredOutputs | None:
        """What decoding must follow: a forced call's arguments, or a list of calls."""
        if self.choice == "required":
            call = [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": _parameters(t)},
                "required": ["name", "arguments"], "additionalProperties": False}
                for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": call[0] if len(call) == 1 else {"anyOf": call}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs(json=schema, source="tools")
        if self.forced:
            tool = next(t for t in self.tools if t.function.name == self.choice)
            index = self.tools.index(tool)
            return StructuredOutputs(json=_parameters(tool),
                                     source=f"tools[{index}].function.parameters")
        return None

    def reply(self, parser: ToolCallParser = HERMES,
              specials: SpecialTexts | None = None) -> Reply:
        """A fresh reader of one choice's output; `parser`: how the model writes calls
        (read with tool_choice auto; the other choices constrain the output's form);
        `specials`: special tokens' texts to strip from its content (see ToolReply)."""
        known = [t.function.name for t in self.tools]
        if self.choice == "auto":
            return ToolReply(known, self.parallel, parser, specials)
        if self.choice == "required":
            return RequiredReply(known, self.parallel)
        if self.forced:
            return NamedReply(self.choice)
        return TextReply()


class Reply(Protocol):
    """One choice's output read as a message (whole) or as deltas (streamed)."""

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]: ...

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]: ...


def _call(call: ParsedCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class TextReply:
    """No tools: the text is the content."""

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        return {"content": text}, finish

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        return ({"content": text} if text else {}), finish


class ToolReply(TextReply):
    """tool_choice auto: calls in the model's own format become tool_calls.

    With `specials`, the text was decoded with special tokens kept for the parser (its
    markers): the other special tokens' texts (a stray end-of-turn or header token) are
    stripped from the content. Only from the content: a call's text is parsed as written,
    so that a literal "</s>" in its arguments stays (EOS itself is never in the text:
    request_group.py leaves the token that ends a sequence out).
    """

    def __init__(self, known: list[str], parallel: bool = True,
                 parser: ToolCallParser = HERMES, specials: SpecialTexts | None = None) -> None:
        self.known = known
        self.parallel = parallel
        self.parser = parser
        self.specials = specials or NO_SPECIALS
        self._splitter = ToolCallSplitter(known, parser)
        self._stripper = SpecialTokenStripper(self.specials)
        self._num_calls = 0  # streamed so far: the next call's index

    def _calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.parallel else calls[:max(0, 1 - self._num_calls)]

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = split_tool_calls(text, self.known, self.parser)
        calls = self._calls(calls)
        if not calls:
            return {"content": self.specials.strip(text)}, finish
        return ({"content": self.specials.strip(content).strip() or None,
                 "tool_calls": [_call(c) for c in calls]},
                "tool_calls" if finish == "stop" else finish)

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = self._splitter.feed(text)
        if finish is not None:
            rest, more = self._splitter.finish()
            content, calls = content + rest, calls + more
        content = self._stripper.feed(content, last=finish is not None)
        return self._delta(content, self._calls(calls), finish)

    def _delta(self, content: str, calls: list[ParsedCall],
               finish: str | None) -> tuple[dict[str, Any], str | None]:
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": self._num_calls + k, **_call(c)}
                                   for k, c in enumerate(calls)]
            self._num_calls += len(calls)
        if finish == "stop" and self._num_calls:
            finish = "tool_calls"
        return delta, finish


class RequiredReply(ToolReply):
    """tool_choice required: the whole output is a JSON list of calls (the constraint)."""

    def __init__(self, known: list[str], parallel: bool = True) -> None:
        super().__init__(known, parallel)
        self._text = ""

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        calls = self._parse(text)
        if not calls:  # cut short by max_tokens: the text as it is
            return {"content": text}, finish
        return ({"content": None, "tool_calls": [_call(c) for c in calls]},
                "tool_calls" if finish == "stop" else finish)

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        # The calls are known once the list is complete, at the end.
        self._text += text
        if finish is None:
            return {}, None
        calls = self._parse(self._text)
        return self._delta("" if calls else self._text, calls or [], finish)

    def _parse(self, text: str) -> list[ParsedCall] | None:
        calls = parse_calls(text, self.known)
        return self._calls(calls) if calls else None


class NamedReply:
    """A named tool_choice: the whole output is the function's arguments (the constraint).
    As OpenAI does for a forced function, finish_reason stays "stop"."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id: str | None = None

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        return {"content": None, "tool_calls": [
            {"id": call_id(), "type": "function",
             "function": {"name": self.name, "arguments": text}}]}, finish

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if self._id is None:  # the first delta names the call, as OpenAI's do
            self._id = call_id()
            call = {"index": 0, "id": self._id, "type": "function",
                    "function": {"name": self.name, "arguments": text}}
        elif not text:
            return {}, finish
        return {"tool_calls": [call]}, finish
