"""tools / tool_choice / parallel_tool_calls -> the plan (template, grammar,
parser), every 400, the shipped SmolLM2 template, vLLM's finish_reason table and
the frontend's flags."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import jsonschema
import pytest

from frontend_svc.errors import FieldError
from frontend_svc.api.protocol import ChatCompletionRequest
from frontend_svc.structured.tools import ToolConfig, ToolPlan, required_schema, tools_template
from frontend_svc.request.translate import ModelLimits, chat_input, check_constraints

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def limits():
    from shared.model_files.default_model import ensure_default_model
    from shared.structured.compile_cache import grammar_vocab
    return ModelLimits(2048, 49152, grammar_vocab=functools.partial(
        grammar_vocab, str(ensure_default_model())))


@pytest.fixture(scope="module")
def config(tokenizer):
    return ToolConfig(True, "hermes", tools_template(tokenizer.chat_template))


def chat(tokenizer, limits, config, **body):
    body.setdefault("messages", ASK)
    inp = chat_input(ChatCompletionRequest(**body), tokenizer, limits, config)
    return check_constraints([inp], limits)[0]  # the route's last step: compile


def rendered(tokenizer, inp) -> str:
    return tokenizer.decode(inp.prompt_token_ids, skip_special_tokens=False)


def test_the_shipped_template_is_smollm2_s_own_without_tools(tokenizer):
    template = tools_template(tokenizer.chat_template)
    assert template is not tokenizer.chat_template and template.renders_tools
    for messages in (ASK, [{"role": "system", "content": "Brief."}, *ASK,
                           {"role": "assistant", "content": "Sunny."}]):
        for agp in (True, False):
            assert template.render(messages, agp) == tokenizer.chat_template.render(messages, agp)


def test_tools_are_listed_in_the_system_turn_hermes_style(tokenizer, limits, config):
    text = rendered(tokenizer, chat(tokenizer, limits, config, tools=[WEATHER, TIME]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    assert "<tool_call>\n{\"name\": <function-name>" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    own = rendered(tokenizer, chat(tokenizer, limits, config, tools=[WEATHER], messages=[
        {"role": "system", "content": "Be terse."}, *ASK]))
    assert own.startswith("<|im_start|>system\nBe terse.\n\n# Tools") and \
        own.count("<|im_start|>system") == 1


def test_history_tool_calls_and_results_go_through_the_template(tokenizer, limits, config):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"temp": 21}'}]
    for tools in ([WEATHER], None):  # tool turns alone pick the tools-aware template too
        text = rendered(tokenizer, chat(tokenizer, limits, config, tools=tools,
                                        messages=history))
        assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
                '<|im_start|>tool\n{"temp": 21}<|im_end|>\n<|im_start|>assistant\n') in text


def test_tool_choice_plans(tokenizer, limits, config):
    none = chat(tokenizer, limits, config, tools=[WEATHER], tool_choice="none")
    assert none.tool_plan.mode == "none" and not none.tool_plan.parses
    assert none.params.structured_output is None
    auto = chat(tokenizer, limits, config, tools=[WEATHER])  # OpenAI's default with tools
    assert auto.tool_plan.mode == "auto" and auto.params.structured_output is None
    assert auto.tool_plan.parser_name == "hermes" and auto.tool_plan.max_calls is None
    required = chat(tokenizer, limits, config, tools=[WEATHER, TIME], tool_choice="required",
                    parallel_tool_calls=False)
    assert required.tool_plan.max_calls == 1
    schema = json.loads(required.params.structured_output.value)
    assert schema == required_schema([WEATHER, TIME], 1) and schema["maxItems"] == 1
    named = chat(tokenizer, limits, config, tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    assert named.tool_plan.name == "get_weather"
    assert json.loads(named.params.structured_output.value) == \
        WEATHER["function"]["parameters"]
    assert named.constraint.param == "tools.0.function.parameters"
    plain = chat(tokenizer, limits, config, tool_choice="none")
    assert plain.tool_plan is None
    # OpenAI's rule, which vLLM follows: required with an empty tools list is none
    assert chat(tokenizer, limits, config, tools=[], tool_choice="required").tool_plan is None
    assert chat(tokenizer, limits, config, tools=[]).tool_plan is None  # default: none


def test_the_required_schema_accepts_calls_and_only_calls():
    schema = required_schema([WEATHER, TIME], None)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"unit": "c"}}],
                [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, required_schema([WEATHER, TIME], 1))


def test_tool_defs_are_hoisted_so_references_resolve():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}},
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}}}}}
    schema = required_schema([tool], None)
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": {"x": "one"}}}], schema)


NEEDS_TOOLS = "When using `tool_choice`, `tools` must be set."  # vLLM's message


@pytest.mark.parametrize("body,param,words", [
    # vLLM's check_tool_usage, word for word: any tool_choice but none needs tools
    ({"tool_choice": "required"}, "tool_choice", NEEDS_TOOLS),
    ({"tool_choice": "auto"}, "tool_choice", NEEDS_TOOLS),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     NEEDS_TOOLS),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.0.function.parameters", "schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.0.function.parameters", "invalid"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "drop response_format"),
    ({"tools": [WEATHER], "echo": True}, "echo", "tool calling"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"function_call": {"name": "f"}}, "function_call", "use tools"),
])
def test_every_bad_tool_request_is_a_400_naming_its_field(tokenizer, limits, config, body,
                                                          param, words):
    with pytest.raises(FieldError) as info:
        chat(tokenizer, limits, config, **body)
    assert info.value.param == param and words in str(info.value)


def test_auto_needs_the_flag_and_a_template_that_renders_tools(tokenizer, limits, config):
    off = ToolConfig(False, None, config.template)
    with pytest.raises(FieldError, match="--enable-auto-tool-choice") as info:
        chat(tokenizer, limits, off, tools=[WEATHER])
    assert info.value.param == "tool_choice"
    assert chat(tokenizer, limits, off, tools=[WEATHER], tool_choice="required").tool_plan
    with pytest.raises(FieldError, match="--chat-template") as info:
        chat(tokenizer, limits, ToolConfig(True, "hermes", None), tools=[WEATHER],
             tool_choice="required")
    assert info.value.param == "tools"
    plain = chat(tokenizer, limits, ToolConfig(True, "hermes", None), tools=[WEATHER],
                 tool_choice="none")  # nothing to parse: the model's template, as vLLM
    assert plain.tool_plan.mode == "none"


def test_a_non_chatml_template_that_ignores_tools_gets_no_substitute(tokenizer):
    from frontend_svc.structured.chat_template import ChatTemplate
    assert tools_template(ChatTemplate("{{ messages[0]['content'] }}", {})) is None
    reads = ChatTemplate("{% if tools %}T{% endif %}", {})
    assert tools_template(reads) is reads


@pytest.mark.parametrize("mode,finish,calls,expected", [
    ("auto", "stop", 1, "tool_calls"), ("auto", "stop", 0, "stop"),
    # vLLM's serving_chat: an auto reply with parsed calls says tool_calls, cut or not
    ("auto", "length", 1, "tool_calls"), ("auto", "length", 0, "length"),
    ("auto", "abort", 1, "abort"), ("required", "stop", 2, "tool_calls"),
    ("required", "length", 1, "length"), ("named", "stop", 1, "stop"),
    ("none", "stop", 0, "stop")])
def test_finish_reasons_follow_vllm_s_table(mode, finish, calls, expected):
    assert ToolPlan(mode).finish_reason(finish, calls) == expected


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_a_reply_whose_last_call_was_cut_keeps_finish_reason_length(mode):
    assert ToolPlan(mode).finish_reason("length", 2, cut=True) == "length"


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_help_shows_the_tool_calling_flags(command):
    out = subprocess.run([sys.executable, "-m", "gapserve", command, "--help"],
                         capture_output=True, text=True, timeout=60).stdout
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--chat-template",
                 "--structured-outputs-compile-timeout-s"):
        assert flag in out, flag
    assert "hermes" in out and "llama3_json" in out


def test_auto_tool_choice_without_a_parser_is_refused_at_start(tmp_path):
    from gapserve.serve import serve_parser
    from shared import config
    args = config.parse_args(serve_parser(), ["--enable-auto-tool-choice"], environ={})
    assert config.tool_flags_problem(args) == "--enable-auto-tool-choice needs --tool-call-parser"
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    args = config.parse_args(serve_parser(), ["--enable-auto-tool-choice", "--tool-call-parser",
                                              "hermes", "--chat-template", str(template)],
                             environ={})
    assert config.tool_flags_problem(args) is None and args.chat_template == str(template)
    with pytest.raises(SystemExit):
        config.parse_args(serve_parser(), ["--chat-template", str(tmp_path / "missing")],
                          environ={})


def test_serve_hands_the_tool_flags_to_the_frontend(tmp_path):
    from gapserve.serve import children, serve_parser
    from shared import config
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
        "--chat-template", str(template)], environ={})
    [frontend] = [c for c in children(args) if c.name == "frontend"]
    parsed = config.parse_args(config.frontend_parser(), frontend.argv[1:], environ={})
    assert (parsed.enable_auto_tool_choice, parsed.tool_call_parser, parsed.chat_template) == \
        (True, "llama3_json", str(template))
    args = config.parse_args(serve_parser(), [
        "--model", "/m", "--structured-outputs-compile-timeout-s", "2.5"], environ={})
    [frontend] = [c for c in children(args) if c.name == "frontend"]
    parsed = config.parse_args(config.frontend_parser(), frontend.argv[1:], environ={})
    assert parsed.structured_outputs_compile_timeout_s == 2.5


def test_the_compile_timeout_flag_then_the_variable_then_the_default():
    from shared import config
    variable = "GAPSERVE_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S"
    for parser in (config.frontend_parser, config.worker_parser):  # one setting, both doors
        def parse(*argv, environ=None):
            return config.parse_args(parser(), list(argv), environ=environ or {}) \
                .structured_outputs_compile_timeout_s
        assert parse() == config.DEFAULT_COMPILE_TIMEOUT_S
        assert parse(environ={variable: "4"}) == 4.0
        assert parse("--structured-outputs-compile-timeout-s", "7", environ={variable: "4"}) == 7
        for bad in ("0", "-1", "soon"):
            with pytest.raises(SystemExit):
                parse("--structured-outputs-compile-timeout-s", bad)


def test_the_shipped_template_renders_as_transformers_renders_it(tokenizer):
    """The same template through transformers' own apply_chat_template (the
    reference Jinja environment): byte-equal, tools and tool turns included."""
    from transformers import AutoTokenizer

    from frontend_svc.structured.tools import SHIPPED_TEMPLATE
    from shared.model_files.default_model import ensure_default_model
    hf = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    source = SHIPPED_TEMPLATE.read_text()
    history = [{"role": "system", "content": "Be terse."}, *ASK,
               {"role": "assistant", "content": "Checking.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "21 °C"}]
    ours = tools_template(tokenizer.chat_template)
    for messages, tools in ((ASK, [WEATHER, TIME]), (history, [WEATHER]), (history, None)):
        expected = hf.apply_chat_template(messages, tools=tools, chat_template=source,
                                          tokenize=False, add_generation_prompt=True)
        assert ours.render(messages, True, tools=tools) == expected
