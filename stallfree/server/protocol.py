"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names and defaults follow OpenAI's; the extra sampling fields (top_k,
min_p, repetition_penalty, ...) follow vLLM's. Ranges that pydantic can check
are declared here so that the OpenAPI schema documents them; the rest is
checked by `SamplingParams`, whose errors name the field.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from ..sampling_params import SamplingParams
from ..structured_outputs import ConstraintError, StructuredOutputs
from .fields import Text
from .structured_protocol import ConstraintFields, Tool, ToolCall, ToolChoice
from .tools import ToolUse

# OpenAI's own caps where it has them; they also keep one request from
# swamping the engine (n sequences of up to max_model_len tokens each).
MAX_N = 128
MAX_STOP = 16

# Integer fields the engine and its workers carry in 64 bits: beyond is refused here, with
# the field's name, rather than failing (or overflowing) once the request is running.
INT64_MAX = 2**63 - 1
TokenCount = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# vLLM's prompt_logprobs: None for the first token, then per token
# {token id: {logprob, rank, decoded_token}}.
PromptLogprobsField = list[dict[str, dict[str, Any]] | None]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UnsupportedFeature(ValueError):
    """A valid OpenAI field this server does not implement (yet); answered with 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIModel(BaseModel):
    # Unknown fields are ignored as OpenAI and vLLM do; NaN/inf are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class _SamplingFields(OpenAIModel, ConstraintFields):
    """Sampling fields shared by completions and chat completions (constraints included)."""

    model: Text | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[StrictFloat, Field(ge=0)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    seed: Annotated[StrictInt, Field(ge=-2**63, le=2**64 - 1)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0)] | None = None
    min_tokens: TokenCount = 0
    # Each prompt token's logprob and this many alternatives, in vLLM's prompt_logprobs
    # format (on each completion choice; on a chat response). Completions' echo + logprobs
    # also gives them, in OpenAI's legacy format.
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    # False keeps special tokens' text in the output. Chat turns it off by itself where the
    # tool-call parser reads special tokens, unless the request says (`model_fields_set`).
    skip_special_tokens: StrictBool = True
    # stallfree's own: this request's time-between-tokens target in seconds (a server
    # started with --tbt-slo keeps every iteration it decodes in within it).
    tbt_slo: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] | None = None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFeature("stream_options",
                                     "stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise UnsupportedFeature("logit_bias", "logit_bias is not supported yet")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                         constraint: StructuredOutputs | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise UnsupportedFeature("stop", "stop strings must not be empty")
        kwargs: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=constraint or self.constraint(),
            tbt_slo=self.tbt_slo)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1),
                              ("min_p", 0.0), ("repetition_penalty", 1.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            value = getattr(self, name)
            kwargs[name] = default if value is None else value
        return SamplingParams(**kwargs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- /v1/completions ---------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    # 0 with echo (or prompt_logprobs) scores the prompt and generates nothing.
    max_tokens: TokenCount | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: a string, a list of strings, of ids or of id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise UnsupportedFeature("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFeature("best_of", "best_of other than n is not supported yet")
        if self.max_tokens == 0 and not self.scores_prompt:
            raise UnsupportedFeature("max_tokens", "max_tokens 0 generates nothing: it needs "
                                                   "echo or prompt_logprobs to return the prompt")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed tokens carry logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(self.max_tokens, self.logprobs,
                                     prompt_logprobs=prompt_logprobs)

    @property
    def scores_prompt(self) -> bool:
        return self.echo or self.prompt_logprobs is not None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsField | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ---- /v1/chat/completions ----------------------------------------------------
class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: {'role', 'content'} with text content,
    plus tool calls (arguments as data, as templates expect), tool_call_id and name."""
    conversation = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name, "arguments": _json_or_text(
                     c.function.arguments)}} for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        conversation.append(message)
    return conversation


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation_of(self.messages)

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice, resolved (None without tools)."""
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedFeature("top_logprobs", "top_logprobs needs logprobs: true")
        tools = self.tool_use()
        forced = tools.constraint() if tools is not None else None
        if forced is not None and self.constraint() is not None:
            raise ConstraintError("tool_choice", f"{self.tool_choice!r} constrains the output "
                                                 f"to tool calls: it cannot be combined with "
                                                 f"another constraint")
        # OpenAI's default: generate until the model stops (or max_model_len).
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedFeature("prompt_logprobs", "prompt_logprobs are not streamed by "
                                                        "chat completions: ask without stream")
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling_params(max_tokens,
                                     (self.top_logprobs or 0) if self.logprobs else None, forced,
                                     self.prompt_logprobs)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField | None = None


# ---- models, tokenizer -------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stallfree"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None  # with messages: as the chat template shows them


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
