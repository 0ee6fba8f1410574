"""Tool calling as vLLM's server does it: `tools`, `tool_choice` (none, auto,
required, a named function) and `parallel_tool_calls` -> a ToolPlan: which chat
template renders the tools, which grammar (if any) enforces the call, and which
parser reads the calls out of the reply (frontend_svc/structured/tool_parsers.py).

`required` and a named function are enforced by the grammar (vLLM's schema: an
array, minItems 1, of {"name": enum, "parameters": schema}; a named function's
parameters alone), so their arguments always validate against the tool's schema.
`auto` needs --enable-auto-tool-choice and parses free text with
--tool-call-parser. The finish_reason follows vLLM's table (`finish_reason`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.config import FrontendFlags
from shared.flag_spec import from_flags
from shared.structured.spec import StructuredOutputSpec

from frontend_svc.request.caps import REJECTED
from frontend_svc.structured.chat_template import ChatTemplate
from frontend_svc.errors import FieldError
from frontend_svc.structured.response_format import Constraint
from frontend_svc.structured.tool_parsers import PARSERS, NamedParser, RequiredParser, ToolParser

SHIPPED_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"
NAME_RE = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


def _refuse(message: str, param: str) -> FieldError:
    REJECTED.labels("tools").inc()
    return FieldError(message, param)


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """The frontend's tool-calling set-up, from its flags (once, at start)."""

    enable_auto_tool_choice: bool = False
    parser: str | None = None  # --tool-call-parser
    template: ChatTemplate | None = None  # renders requests with tools; None: refused
    trust_request_chat_template: bool = False  # a request may send its own chat_template

    @classmethod
    def from_args(cls, args, model_template: ChatTemplate | None) -> "ToolConfig":
        """From the frontend's flags (shared/config.py FrontendServingFlags); the
        template is the model's (or --chat-template's), read at start."""
        return from_flags(cls, args, FrontendFlags, renames={"parser": "tool_call_parser"},
                          unset={"template": tools_template(model_template)})


def load_template(path: str | Path, special_tokens: dict[str, str],
                  origin: str) -> ChatTemplate:
    return ChatTemplate(Path(path).read_text(encoding="utf-8"), special_tokens, origin)


def tools_template(model_template: ChatTemplate | None) -> ChatTemplate | None:
    """The template for requests with tools: the model's (or --chat-template's) if it
    reads `tools`; gapserve's hermes-style ChatML template if the model's is ChatML
    and ignores them (SmolLM2); else none (such requests are refused)."""
    if model_template is None:
        return None
    if model_template.renders_tools:
        return model_template
    if "<|im_start|>" in model_template.source:
        return load_template(SHIPPED_TEMPLATE, model_template.special_tokens,
                             f"gapserve's {SHIPPED_TEMPLATE.name}")
    return None


@dataclass(slots=True)
class ToolPlan:
    """What one chat request's tools mean for its prompt, grammar and reply."""

    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None  # the named function
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    parser_name: str | None = None  # auto's --tool-call-parser

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def label(self) -> str:
        """tool_choice for metrics and logs: none, auto, required, named."""
        return self.mode

    def new_parser(self) -> ToolParser | None:
        if self.mode == "auto":
            return PARSERS[self.parser_name](max_calls=self.max_calls)
        if self.mode == "required":
            return RequiredParser(max_calls=self.max_calls)
        if self.mode == "named":
            return NamedParser(self.name)
        return None

    def finish_reason(self, finish: str | None, num_calls: int,
                      cut: bool = False) -> str | None:
        """vLLM's table: `tool_calls` when an `auto` reply holds calls, even one cut
        by max_tokens (vLLM's serving_chat says tool_calls whenever the parser found
        calls); `required` says it when the reply stopped (cut: length, its last call
        may be incomplete); a named function's reply ends as generated (`stop`).
        A reply with a cut call (dropped) keeps its own reason: `length`."""
        if not num_calls or cut:
            return finish
        if self.mode == "auto" and finish in ("stop", "length"):
            return "tool_calls"
        if self.mode == "required" and finish == "stop":
            return "tool_calls"
        return finish


def plan(req, config: ToolConfig) -> tuple[ToolPlan | None, Constraint | None]:
    """The request's ToolPlan (None without tools) and the constraint that
    enforces its calls (required / named); FieldError (400) for bad tools."""
    choice = req.tool_choice
    if req.tools is None:  # vLLM's check_tool_usage: any tool_choice but none needs tools
        if choice not in (None, "none"):
            raise _refuse("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None, None
    tools = _checked_tools(req.tools)
    if not tools and choice in (None, "none", "required"):
        return None, None  # OpenAI's (and vLLM's) rule: required with tools [] is none
    max_calls = None if req.parallel_tool_calls in (None, True) else 1
    if choice is None:  # OpenAI's default with tools
        choice = "auto"
    if isinstance(choice, str) and choice not in CHOICES:
        raise _refuse(f"tool_choice must be one of {', '.join(CHOICES)} or "
                      '{"type": "function", "function": {"name": ...}}; '
                      f"got {choice!r}", "tool_choice")
    if choice == "none":  # the template sees the tools (vLLM's way), nothing is parsed
        return ToolPlan("none", tools), None
    if config.template is None:
        raise _refuse("tools: this model's chat template does not render tools; start the "
                      "frontend with --chat-template FILE (a tools-aware template)", "tools")
    if isinstance(choice, str):
        if choice == "auto":
            if not (config.enable_auto_tool_choice and config.parser):
                raise _refuse('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
            return ToolPlan("auto", tools, None, max_calls, config.parser), None
        schema = required_schema(tools, max_calls)
        return ToolPlan("required", tools, None, max_calls), Constraint(
            StructuredOutputSpec("json", json.dumps(schema)), "tools", "tool_choice")
    name = _named(choice)
    index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
    if index is None:
        raise _refuse(f"tool_choice names the function {name!r}, which is not in tools",
                      "tool_choice.function.name")
    parameters = tools[index]["function"].get("parameters") or EMPTY_PARAMETERS
    return ToolPlan("named", tools, name, 1), Constraint(
        StructuredOutputSpec("json", json.dumps(parameters)),
        f"tools.{index}.function.parameters", "tool_choice")


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(name, str) or not name:
        raise _refuse('tool_choice must be none, auto, required or {"type": "function", '
                      '"function": {"name": ...}}', "tool_choice")
    return name


def _checked_tools(tools: list[Any]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _refuse(f"tools.{i}: only tools of type \"function\" are supported",
                          f"tools.{i}.type")
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _refuse(f"tools.{i}.function.name must be 1-64 letters, digits, _ . or "
                          f"-; got {name!r}", f"tools.{i}.function.name")
        if name in seen:
            raise _refuse(f"tools.{i}.function.name: {name!r} is given twice",
                          f"tools.{i}.function.name")
        seen.add(name)
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _refuse(f"tools.{i}.function.parameters must be a JSON schema object",
                          f"tools.{i}.function.parameters")
    return tools


def required_schema(tools: list[dict[str, Any]], max_calls: int | None) -> dict:
    """vLLM's schema for tool_choice required: a non-empty array of calls, each one
    of the tools by name with its parameters; the tools' $defs move to the top so
    their `#/$defs/...` references still resolve."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": _without_defs(t["function"].get("parameters") or EMPTY_PARAMETERS)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        for key, value in ((t["function"].get("parameters") or {}).get("$defs") or {}).items():
            if key in defs and defs[key] != value:
                raise _refuse(f"tools.{i}.function.parameters: $defs {key!r} differs from "
                              "another tool's of the same name", f"tools.{i}.function.parameters")
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


def _without_defs(parameters: dict) -> dict:
    return {k: v for k, v in parameters.items() if k != "$defs"}
