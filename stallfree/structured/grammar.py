"""A constraint as an xgrammar `Grammar`: quick and tokenizer-free, so a bad schema, regex
or grammar is refused (ValueError naming the request field) before anything is queued."""
from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from ..structured_outputs import ConstraintError, StructuredOutputs

# Compact JSON (json.dumps' separators, no free whitespace): given free whitespace, a
# small model can pad until max_tokens and never close the object. Strict mode emits
# only the declared properties, a subset of what the schema admits, as vLLM does.
_JSON = {"any_whitespace": False, "strict_mode": True}
_ANY_OBJECT = '{"type": "object"}'
_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}
# Keywords xgrammar accepts but does not enforce: refused, as the output could break them.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas")
# Where subschemas sit: under a name (maps), alone, or in lists.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# xgrammar's messages start with a timestamp and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s+(Check failed: .*? is false: )?")


def build_grammar(spec: StructuredOutputs) -> xgr.Grammar:
    """The grammar of `spec`; ConstraintError (a ValueError) naming the field if invalid."""
    kind = spec.kind
    unenforced = _unenforced(spec.json) if kind == "json" else None
    if unenforced:
        raise ConstraintError(spec.field(), f"JSON schema keyword {unenforced} is not "
                                            f"supported")
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), **_JSON)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False,
                                                strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # JSON string literals are valid EBNF literals, escapes included.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input by several types
        reason = _LOCATION.sub("", str(exc).strip()).strip()
        raise ConstraintError(spec.field(), f"invalid {_WHAT[kind]}: {reason}") from None


def _unenforced(schema: Any) -> str | None:
    """The first keyword of `schema` (or its subschemas) that decoding cannot enforce."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema:
            return key
    if schema.get("uniqueItems") is True:
        return "uniqueItems"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        # xgrammar only warns and lets the subschema be any JSON: the output would not
        # follow the schema the client meant.
        return f"$ref to {ref!r} (only references within the schema, '#/...', are)"
    if len(schema.get("allOf") or []) > 1:
        return "allOf (of more than one schema)"
    subschemas = [schema.get(k) for k in _SCHEMA_ONE]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            subschemas.extend(schema[key].values())
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            subschemas.extend(schema[key])
    return next((found for sub in subschemas if (found := _unenforced(sub))), None)
