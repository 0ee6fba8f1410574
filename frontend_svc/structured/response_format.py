"""Structured outputs over HTTP: the request shapes that ask for one (OpenAI's
`response_format`, vLLM's `structured_outputs`, vLLM's removed `guided_*`
fields) -> one `StructuredOutputSpec`, and its validation before anything is
queued. The engine side (compiling, masking) is shared/structured/.

Every constraint remembers the request field it came from, so a schema that does
not compile is a 400 whose `param` names that field (e.g.
`response_format.json_schema.schema`), and two constraints in one request are a
400 rather than one silently winning.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import grpc

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.structured.compile_cache import validate
from shared.structured.spec import CompileCapacityError, StructuredOutputError, \
    StructuredOutputSpec

from frontend_svc.request.caps import REJECTED
from frontend_svc.errors import EngineError, FieldError

# structured_outputs' kinds (vLLM's StructuredOutputsParams), exactly one per request
KIND_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's removed fields, mapped onto structured_outputs
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# other keys of structured_outputs: honoured, inert, or refused with a reason
# disable_fallback: no fallback here; disable_additional_properties: vLLM's switch to
# strict objects, which every schema here already is (shared.structured.spec.strict_schema)
OPTION_FIELDS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
REFUSED_OPTIONS = {
    "whitespace_pattern": "use disable_any_whitespace (whitespace is otherwise bounded)",
    "structural_tag": "structural tags are not supported",
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's structured output and where it came from."""

    spec: StructuredOutputSpec
    param: str  # the request field an error names
    source: str  # response_format | structured_outputs | guided | tool_choice


def request_constraint(req) -> Constraint | None:
    """The one constraint a chat or completion request asks for, or None;
    FieldError (400) for a malformed one or for more than one."""
    found = [c for c in (_response_format(req.response_format),
                         _structured_outputs(req.structured_outputs), _legacy(req))
             if c is not None]
    if len(found) > 1:
        raise _refuse(f"{found[1].param}: give one structured output per request; "
                      f"{found[0].param} already asks for one", found[1].param)
    return found[0] if found else None


def _refuse(message: str, param: str) -> FieldError:
    REJECTED.labels("structured_output").inc()
    return FieldError(message, param)


def _response_format(value: dict[str, Any] | None) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(StructuredOutputSpec("json_object"), "response_format",
                          "response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise _refuse("response_format.json_schema: an object with the schema is "
                          "required for type json_schema", "response_format.json_schema")
        schema = body.get("schema", body.get("json_schema"))  # vLLM reads both names
        param = "response_format.json_schema.schema"
        if not isinstance(schema, dict):
            raise _refuse(f"{param}: a JSON schema object is required", param)
        return Constraint(StructuredOutputSpec("json", json.dumps(schema)), param,
                          "response_format")
    raise _refuse(f"response_format.type must be one of text, json_object, json_schema; "
                  f"got {kind!r}", "response_format.type")


def _structured_outputs(value: dict[str, Any] | None) -> Constraint | None:
    if value is None:
        return None
    for key in value:
        if key in REFUSED_OPTIONS and value[key] not in (None, False):
            raise _refuse(f"structured_outputs.{key} is not supported: "
                          f"{REFUSED_OPTIONS[key]}", f"structured_outputs.{key}")
        if key not in KIND_FIELDS and key not in OPTION_FIELDS and key not in REFUSED_OPTIONS:
            raise _refuse(f"structured_outputs.{key} is not a field of structured_outputs "
                          f"(one of {', '.join(KIND_FIELDS)}, disable_any_whitespace)",
                          f"structured_outputs.{key}")
    given = [k for k in KIND_FIELDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise _refuse(f"structured_outputs needs exactly one of {', '.join(KIND_FIELDS)}; "
                      f"got {', '.join(given) or 'none'}", "structured_outputs")
    kind = given[0]
    for option in ("disable_additional_properties",):
        if not isinstance(value.get(option, False), bool):
            raise _refuse(f"structured_outputs.{option} must be a boolean",
                          f"structured_outputs.{option}")
    whitespace = value.get("disable_any_whitespace") or False
    if not isinstance(whitespace, bool):
        raise _refuse("structured_outputs.disable_any_whitespace must be a boolean",
                      "structured_outputs.disable_any_whitespace")
    param = f"structured_outputs.{kind}"
    return Constraint(_spec(kind, value[kind], param, whitespace), param,
                      "structured_outputs")


def _legacy(req) -> Constraint | None:
    given = [name for name in LEGACY_FIELDS if getattr(req, name) is not None]
    if len(given) > 1:
        raise _refuse(f"{given[1]}: give one structured output per request; {given[0]} "
                      "already asks for one (these fields were removed from vLLM: use "
                      "structured_outputs)", given[1])
    if not given:
        return None
    name = given[0]
    return Constraint(_spec(LEGACY_FIELDS[name], getattr(req, name), name), name, "guided")


def _spec(kind: str, value: Any, param: str,
          disable_any_whitespace: bool = False) -> StructuredOutputSpec:
    """The spec of one kind from its JSON value, checking the value's type."""
    if kind == "json_object":
        if value is not True:
            raise _refuse(f"{param} must be true", param)
        return StructuredOutputSpec("json_object", "", disable_any_whitespace)
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as an object or as its text
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _refuse(f"{param}: the schema is not valid JSON: {exc}", param) \
                    from None
        if not isinstance(value, (dict, bool)):
            raise _refuse(f"{param}: a JSON schema must be an object", param)
        return StructuredOutputSpec("json", json.dumps(value), disable_any_whitespace)
    if kind == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise _refuse(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredOutputSpec("choice", json.dumps(value), disable_any_whitespace)
    if not isinstance(value, str) or not value:
        raise _refuse(f"{param} must be a non-empty string", param)
    return StructuredOutputSpec(kind, value, disable_any_whitespace)


def check(constraint: Constraint, vocab_of, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
          ) -> tuple[float, bool]:
    """Compile the constraint's grammar (a cache hit after the first time) within
    timeout_s; a 400 naming its field if it does not compile or takes too long; a
    503 if no grammar can be compiled now (the compiles stuck past the timeout are
    at their cap: shared/structured/compile_cache.py). Returns the seconds it
    took and whether it was a cache hit. Call it off the event loop (the grammar pool)."""
    if vocab_of is None:  # a frontend built without the model's grammar vocabulary
        raise _refuse(f"{constraint.param}: structured outputs are not available on this "
                      "frontend", constraint.param)
    start = time.perf_counter()
    try:
        hit = validate(constraint.spec, vocab_of(), timeout_s)
    except CompileCapacityError as exc:
        REJECTED.labels("compile_capacity").inc()
        raise EngineError(grpc.StatusCode.UNAVAILABLE,
                          f"{constraint.param}: {exc.message}") from None
    except StructuredOutputError as exc:
        raise _refuse(f"{constraint.param}: {exc.message}", constraint.param) from None
    return time.perf_counter() - start, hit
