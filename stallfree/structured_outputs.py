"""What a constrained request must generate: a JSON schema, a regex, a choice or a grammar.

Plain data, checked for shape here (every error names the field); whether a schema,
regex or grammar is actually valid is decided when it is turned into a grammar
(`stallfree.structured.grammar`), still before the request is queued.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Nesting of a schema's JSON: real schemas stay far below; the grammar's construction
# grows steeply with depth (seconds at a few hundred levels).
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class CompileLimits:
    """Bounds on compiling constraints, named as the server's flags (`--max-constraint-bytes`
    ...), which each refusal names. The defaults are generous multiples of OpenAI's own
    schema limits (~15K characters of enum values): a 150K-value enum is refused at once."""

    max_constraint_bytes: int = 256 << 10  # the constraint's text, checked before compiling
    max_grammar_compile_seconds: int = 10  # a compile running longer is killed
    max_grammar_bytes: int = 64 << 20  # one compiled grammar (a 10K-value enum: ~35 MB)
    grammar_cache_bytes: int = 256 << 20  # compiled grammars kept for reuse, in all

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @staticmethod
    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"


class ConstraintError(ValueError):
    """A bad constraint; `param` names the request field (the server answers 400 with it)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


@dataclass
class StructuredOutputs:
    """Exactly one constraint, by vLLM's names (`structured_outputs` in its API).

    json: a JSON schema (a dict, a bool, or its JSON text); regex: a regular expression
    the whole output must match; choice: the output is one of these strings; grammar:
    an EBNF grammar whose rule `root` the output must match; json_object: any JSON object.
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # The request field the constraint came from, named in errors (`response_format`, ...).
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if self._is_set(k)]
        if len(set_) != 1:
            raise ConstraintError(self.source, f"must set exactly one of {', '.join(KINDS)}; "
                                               f"got {', '.join(set_) or 'none'}")
        kind = self.kind
        if kind == "json":
            self.json = _schema(self.json, self.field("json"))
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ConstraintError(self.field(kind), "must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ConstraintError(self.field("choice"),
                                      "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        elif self.json_object is not True:  # set, but to something other than a bool
            raise ConstraintError(self.field("json_object"), "must be true")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value not in (None, False) if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def field(self, kind: str | None = None) -> str:
        """The request field to name in an error about this constraint."""
        if self.source != "structured_outputs":
            return self.source  # response_format..., guided_regex, tools[0]...: one field
        return f"{self.source}.{kind or self.kind}"

    @property
    def key(self) -> str:
        """The constraint as text: equal keys compile to the same grammar (the cache key)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            # Property order is kept: it is the order the output follows.
            value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        elif self.kind == "choice":
            value = json.dumps(value, ensure_ascii=False)
        return f"{self.kind}:{value}"


def _schema(value: object, field: str) -> dict[str, Any] | bool:
    """A JSON schema as data: JSON text is parsed; a schema is an object or a bool."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(field, f"is not valid JSON: {exc}") from None
        except RecursionError:  # Python's parser recurses once per level
            raise ConstraintError(field, f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    if not isinstance(value, (dict, bool)):
        raise ConstraintError(field, f"must be a JSON schema (an object), got "
                                     f"{type(value).__name__}")
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise ConstraintError(field, f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return value


def _depth(value: object) -> int:
    """How deeply objects and arrays nest in `value` (iterative: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest
