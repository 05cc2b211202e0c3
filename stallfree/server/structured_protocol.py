"""Request fields that constrain the output: OpenAI's `response_format` and `tools`, and
vLLM's `structured_outputs` with its older `guided_*` names (pydantic models).

`constraint_fields` turns whichever of them a request sets into one `StructuredOutputs`;
its errors name the field. Whether a schema, regex or grammar is valid is checked
when it is compiled (`ServerState.prepare_constraint`), still before anything is queued.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from ..structured_outputs import ConstraintError, StructuredOutputs
from .fields import Text
from .tool_parser import load_json

Schema = dict[str, Any] | StrictBool


class _Model(BaseModel):
    # As protocol.OpenAIModel (not imported: protocol imports this module).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JSONSchemaFormat(_Model):
    name: Text = "response"
    description: Text | None = None
    # "schema" and "json" would shadow BaseModel attributes: aliases keep the wire names.
    schema_: Schema | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Model):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: Schema | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None


class ConstraintFields(_Model):
    """The constraint fields every generating endpoint takes (a mixin of the requests)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Schema | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def constraint(self) -> StructuredOutputs | None:
        """The one constraint the request sets (None: free text); ConstraintError if it
        sets several or a malformed one."""
        found: list[StructuredOutputs] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(StructuredOutputs(json_object=True, source="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ConstraintError("response_format.json_schema",
                                      "is required when type is json_schema")
            schema = fmt.json_schema.schema_
            found.append(StructuredOutputs(json_object=True, source="response_format")
                         if schema is None else
                         StructuredOutputs(json=schema, source="response_format.json_schema"
                                                                ".schema"))
        so = self.structured_outputs
        if so is not None:
            found.append(StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice,
                                           grammar=so.grammar,
                                           json_object=bool(so.json_object)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append(StructuredOutputs(**{name: value}, source=f"guided_{name}"))
        if len(found) > 1:
            raise ConstraintError(found[1].source.split(".")[0],
                                  f"only one constraint may be given, but the request sets "
                                  f"{' and '.join(f.source.split('.')[0] for f in found)}")
        return found[0] if found else None


# ---- tools (chat) --------------------------------------------------------------
ToolName = Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[\w.-]+$")]


class FunctionDefinition(_Model):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Model):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _bounded(cls, arguments: str) -> str:
        """The chat template gets the arguments as data: bound how deeply they nest."""
        try:
            load_json(arguments)
        except json.JSONDecodeError:
            pass  # not JSON: passed on as text
        return arguments


class ToolCall(_Model):
    """A call in an earlier assistant turn, as the client sends it back."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction
