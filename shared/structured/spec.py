"""What a request asks its output to match: plain data and its errors, no
dependencies, so the wire types (shared/types.py) carry it without a grammar engine."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# How many compiled grammars a process keeps (compile_cache.py); the scheduler tracks
# which a worker holds with the same bound (scheduler_svc/core/grammar_wait.py)
CACHE_SIZE = 256


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match. `value` per kind: JSON-schema text ("json"),
    a regex ("regex"), a JSON array of strings ("choice"), a Lark/EBNF grammar as
    llguidance takes it ("grammar"), "" for any JSON object ("json_object")."""

    kind: str
    value: str = ""
    disable_any_whitespace: bool = False

    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.value, self.disable_any_whitespace)


class StructuredOutputError(ValueError):
    """A spec that cannot be enforced; `field` names the spec part at fault (the
    kind: "json", "regex", "choice", "grammar", or "structured_output")."""

    def __init__(self, message: str, field: str = "structured_output") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class CompileCapacityError(StructuredOutputError):
    """No grammar can be compiled now: the cache's limit of compiles running past
    the timeout is reached (CompileCache). Not the spec's fault: HTTP 503 / gRPC
    RESOURCE_EXHAUSTED, and a retry can succeed once one of them ends."""


def error_field(spec: StructuredOutputSpec) -> str:
    """The field an error about this spec names."""
    return spec.kind if spec.kind in KINDS else "structured_output"


# keywords whose value maps names to subschemas (not a schema itself)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema):
    """The schema with `"additionalProperties": false` on every object schema that
    declares properties and says nothing about others: what pydantic, LangChain and
    instructor send means "these keys", and a loose grammar lets a small model pad
    with invented keys until max_tokens (vLLM's default backend is strict too). A
    backend compiles this, whatever its own defaults."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: strict_schema(s) for n, s in v.items()}
               if k in _SCHEMA_MAPS and isinstance(v, dict) else strict_schema(v))
           for k, v in schema.items()}
    if ("properties" in out or "patternProperties" in out) and \
            "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
