"""Every request field a client can send is honoured (and a test here or elsewhere
proves it), refused with a 400 naming it, or accepted as having no effect by its
own definition (docs/api.md says why, and a test here that it changes nothing);
never silently ignored. The walk is driven by the installed `openai` package's
request types and by vLLM's extra fields (structured outputs and tools:
tests/integration/test_structured_http.py). Then the honoured newcomers: best_of,
continue_final_message, chat echo, request_id; and the error details: a lone
surrogate, invalid JSON, top_logprobs, a wrong method."""

from __future__ import annotations

import importlib
import json

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from frontend_svc.api.protocol import (
    NO_EFFECT, REFUSED, ChatCompletionRequest, CompletionRequest)
from tests.integration.test_resilience import wait_until

COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0.0, "ignore_eos": True}

# vLLM's extra fields (vllm/entrypoints/openai/protocol.py, CompletionRequest and
# ChatCompletionRequest, beyond OpenAI's; the later releases' fields from
# vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py)
VLLM_SHARED = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words", "add_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs",
    # later releases
    "watermarking", "truncation_side", "logprob_token_ids", "session_id",
    "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs",
    "ec_transfer_params", "repetition_detection", "thinking_token_budget",
    "stream_interval"}
VLLM_COMPLETION = VLLM_SHARED | {"prompt_embeds", "echo"}
VLLM_CHAT = VLLM_SHARED | {"best_of", "echo", "add_generation_prompt",
                           "continue_final_message", "documents", "chat_template",
                           "chat_template_kwargs", "mm_processor_kwargs",
                           "include_reasoning", "media_io_kwargs", "return_prompt_text"}
COMPLETION_FIELDS = set(completion_create_params.CompletionCreateParamsBase.__annotations__) \
    | {"stream"} | VLLM_COMPLETION
CHAT_FIELDS = set(chat_create_params.CompletionCreateParamsBase.__annotations__) \
    | {"stream"} | VLLM_CHAT

TRANSLATE = "tests.frontend.test_translate"
OPENAI_API = "tests.integration.test_openai_api"
STRUCTURED = "tests.integration.test_structured_http"
PASSED_THROUGH = f"{TRANSLATE}:test_sampling_fields_reach_sampling_params"
# honoured field -> the test that proves it does what it says
HONOURED = {
    "model": "tests.integration.test_bad_input:test_the_openai_client_sees_typed_errors",
    "prompt": f"{OPENAI_API}:test_n_choices_echo_and_token_id_prompts",
    "messages": f"{OPENAI_API}:test_chat_completion_streamed_and_not",
    "max_tokens": f"{OPENAI_API}:test_max_tokens_bounds_the_output",
    "max_completion_tokens":
        f"{TRANSLATE}:test_chat_content_parts_are_joined_and_logprobs_translated",
    "n": f"{OPENAI_API}:test_seeded_sampling_is_reproducible",
    "best_of": "test_best_of_returns_the_n_most_likely_of_best_of_candidates",
    "echo": f"{OPENAI_API}:test_n_choices_echo_and_token_id_prompts",
    "stream": f"{OPENAI_API}:test_completion_streamed_equals_completion_not_streamed",
    "stream_options": f"{OPENAI_API}:test_completion_streamed_equals_completion_not_streamed",
    "seed": f"{OPENAI_API}:test_seeded_sampling_is_reproducible",
    "stop": f"{OPENAI_API}:test_stop_string_is_withheld_reported_and_ends_the_count",
    "logprobs": f"{OPENAI_API}:test_logprobs_are_returned_per_token",
    "return_tokens_as_token_ids":
        f"{OPENAI_API}:test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id",
    "top_logprobs": f"{TRANSLATE}:test_chat_content_parts_are_joined_and_logprobs_translated",
    "logit_bias": "tests.integration.test_auth:test_logit_bias_steers_sampling_on_http_and_grpc",
    "cache_salt":
        "tests.integration.test_auth:test_cache_salt_separates_prefix_caches_on_the_grpc_path",
    "priority": "tests.integration.test_auth:test_a_priority_claim_needs_a_priority_key",
    "include_stop_str_in_output":
        "tests.frontend.test_output_stream:test_include_stop_str_in_output_keeps_the_stop",
    "skip_special_tokens": "tests.frontend.test_detokenizer:test_special_tokens_are_skipped",
    "add_special_tokens": f"{TRANSLATE}:test_add_special_tokens_adds_the_tokenizer_s_own",
    "add_generation_prompt":
        "tests.frontend.test_chat_template:test_chat_template_renders_exactly_like_transformers",
    "continue_final_message": "test_continue_final_message_extends_the_assistant_message",
    "response_format": f"{STRUCTURED}:test_response_format_json_schema_validates_streamed_and_not",
    **{name: f"{STRUCTURED}:test_vllm_s_fields_and_the_removed_ones_are_honoured" for name in (
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "tools": f"{STRUCTURED}:test_tool_choice_required_calls_validate_and_finish_with_tool_calls",
    "tool_choice":
        f"{STRUCTURED}:test_a_named_tool_choice_calls_that_function_and_finishes_with_stop",
    "parallel_tool_calls": f"{STRUCTURED}:test_parallel_tool_calls_false_gives_at_most_one_call",
    "chat_template": f"{STRUCTURED}:test_chat_template_flag_and_the_llama3_json_parser",
    "chat_template_kwargs":
        "test_chat_template_kwargs_are_taken_and_a_request_template_needs_trust",
    "request_id": "test_request_id_names_the_response_as_vllm_s_does",
    **{name: PASSED_THROUGH for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens")},
}
# a value each refused field is refused with (default True)
REFUSED_VALUES = {"modalities": ["audio"], "functions": [{"name": "f"}],
                  "function_call": {"name": "f"},
                  "length_penalty": 2.0, "spaces_between_special_tokens": False,
                  "suffix": "tail", "prompt_logprobs": 1, "service_tier": "priority",
                  "stream_interval": 4, "logprob_token_ids": [1],
                  "repetition_detection": {"max_pattern_size": 4}}
# the values a client sends them with; include_reasoning's true is vLLM's default
NO_EFFECT_VALUES = {"metadata": {"a": "b"}, "prompt_cache_options": {},
                    "prompt_cache_retention": "24h", "include_reasoning": False,
                    "return_token_offsets": True, "return_mm_kwargs": False}


def post(stack, path: str, body) -> httpx.Response:
    return httpx.post(stack.http_url + path, json=body, timeout=60)


def test_every_field_of_the_openai_client_and_vllm_is_honoured_refused_or_documented_inert():
    for endpoint, fields, model in (("completions", COMPLETION_FIELDS, CompletionRequest),
                                    ("chat", CHAT_FIELDS, ChatCompletionRequest)):
        for name in sorted(fields):
            kinds = [name in HONOURED, name in REFUSED, name in NO_EFFECT]
            assert kinds.count(True) == 1, f"{endpoint}.{name}: {kinds}"
            if name in HONOURED:  # a declared field, and its test exists
                assert name in model.model_fields, f"{endpoint}.{name} is not parsed"
                module, _, test = HONOURED[name].rpartition(":")
                assert callable(getattr(importlib.import_module(module or __name__), test))


def test_docs_api_md_lists_every_honoured_refused_and_inert_field():
    from pathlib import Path
    text = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    missing = [name for name in (*HONOURED, *REFUSED, *NO_EFFECT) if f"`{name}`" not in text]
    assert not missing, missing


@pytest.mark.parametrize("endpoint,name", sorted(
    [("/v1/completions", n) for n in COMPLETION_FIELDS if n in REFUSED]
    + [("/v1/chat/completions", n) for n in CHAT_FIELDS if n in REFUSED]))
def test_a_refused_field_is_a_400_naming_it(tiny_stack, endpoint, name):
    base = COMPLETION if endpoint == "/v1/completions" else CHAT
    reply = post(tiny_stack, endpoint, {**base, name: REFUSED_VALUES.get(name, True)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == name and name in error["message"]
    assert error["type"] == "invalid_request_error"


def test_chat_template_kwargs_are_taken_and_a_request_template_needs_trust(tiny_stack):
    """vLLM's rules: kwargs reach the template (here the tiny model's, which reads
    none: the prompt is unchanged); a template of the request's own is refused
    without --trust-request-chat-template, with vLLM's message."""
    from frontend_svc.structured.chat_template import UNTRUSTED
    plain = post(tiny_stack, "/v1/chat/completions", CHAT).json()
    kwargs = post(tiny_stack, "/v1/chat/completions",
                  {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.status_code == 200, kwargs.text
    assert kwargs.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    for body, param in (({"chat_template": "{{ messages }}"}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}},
                         "chat_template_kwargs.chat_template")):
        reply = post(tiny_stack, "/v1/chat/completions", {**CHAT, **body})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
        assert reply.json()["error"]["message"] == UNTRUSTED


def test_inert_fields_are_accepted_and_change_nothing(tiny_stack):
    plain = post(tiny_stack, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    for name in sorted(NO_EFFECT):
        body = {**CHAT, name: NO_EFFECT_VALUES.get(name, "x")}
        reply = post(tiny_stack, "/v1/chat/completions", body)
        assert reply.status_code == 200, (name, reply.text)
        assert reply.json()["choices"][0]["message"] == plain, name  # greedy: the same
    for tier in ("auto", "default"):  # the one tier there is; others are refused
        body = {**CHAT, "service_tier": tier}
        assert post(tiny_stack, "/v1/chat/completions", body).status_code == 200, tier


def test_request_id_names_the_response_as_vllm_s_does(tiny_stack):
    """vLLM's rule: the response id is cmpl- / chatcmpl- and the body's request_id,
    or the X-Request-Id header, which wins; it names the request in the frontend's
    log; two requests may share one (the scheduler's ids stay unique); too long is a
    400 naming it."""
    url = tiny_stack.http_url
    assert post(tiny_stack, "/v1/completions",
                {**COMPLETION, "request_id": "rid-1"}).json()["id"] == "cmpl-rid-1"
    assert post(tiny_stack, "/v1/chat/completions",
                {**CHAT, "request_id": "rid-2"}).json()["id"] == "chatcmpl-rid-2"
    chunks = httpx.post(url + "/v1/chat/completions", timeout=60,
                        json={**CHAT, "request_id": "rid-3", "stream": True}).text
    assert {json.loads(line[6:])["id"] for line in chunks.splitlines()
            if line.startswith("data: {")} == {"chatcmpl-rid-3"}
    header = httpx.post(url + "/v1/completions", json={**COMPLETION, "request_id": "body"},
                        headers={"X-Request-Id": "rid-4"}, timeout=60).json()
    assert header["id"] == "cmpl-rid-4"
    # the log line of a constrained request names it by that id
    post(tiny_stack, "/v1/completions", {**COMPLETION, "request_id": "rid-5",
                                         "structured_outputs": {"choice": ["p", "q"]}})
    # the supervisor copies a service's output into its log file on its own thread:
    # the line may land a moment after the response
    def logged() -> bool:
        lines = [json.loads(line) for p in tiny_stack.log_dir.glob("frontend*.log")
                 for line in p.read_text(errors="replace").splitlines() if line.startswith("{")]
        return any(r.get("event") == "constrained request"
                   and r.get("request_id") == "cmpl-rid-5" for r in lines)
    wait_until(logged, "the constrained request's log line", timeout_s=30)
    # the same id while a request of that id runs: both are served
    long = {**COMPLETION, "max_tokens": 480, "stream": True, "request_id": "same"}
    with httpx.stream("POST", url + "/v1/completions", json=long, timeout=120) as first:
        events = first.iter_lines()
        assert next(e for e in events if e.startswith("data: {"))
        again = post(tiny_stack, "/v1/completions", {**COMPLETION, "request_id": "same",
                                                     "n": 2})
        assert again.status_code == 200 and again.json()["id"] == "cmpl-same", again.text
        # the first ran on to its end under its own id: not cancelled nor merged (its
        # last chunk says why it stopped; an engine-status read here raced its end)
        rest = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        assert {c["id"] for c in rest} == {"cmpl-same"}
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    for body, headers in (({**COMPLETION, "request_id": "x" * 257}, None),
                          ({**COMPLETION, "request_id": ""}, None),
                          (COMPLETION, {"X-Request-Id": "x" * 257})):
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "request_id"


def test_prompt_logprobs_is_refused_as_not_supported_yet(tiny_stack):
    reply = post(tiny_stack, "/v1/completions", {**COMPLETION, "prompt_logprobs": 2})
    assert "prompt_logprobs is not supported yet" in reply.json()["error"]["message"]


def test_detokenize_and_tokenize_refuse_unknown_fields(tiny_stack):
    reply = post(tiny_stack, "/detokenize", {"tokens": [1, 2], "skip_special": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "skip_special"
    reply = post(tiny_stack, "/tokenize", {"prompt": "x", "add_special": False})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "add_special"


def test_a_user_message_without_content_is_a_400(tiny_stack):
    reply = post(tiny_stack, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.0"


# ---- the honoured newcomers


def test_best_of_returns_the_n_most_likely_of_best_of_candidates(tiny_stack):
    body = {**COMPLETION, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    # the candidates: best_of choices with the same seeds, with their logprobs
    every = post(tiny_stack, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]}
    best = post(tiny_stack, "/v1/completions", {**body, "n": 2, "best_of": 4}).json()
    texts = [c["text"] for c in best["choices"]]
    assert texts == sorted(score, key=score.get, reverse=True)[:2]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for
    assert best["usage"]["completion_tokens"] == 12  # the returned choices, as vLLM counts
    chat = post(tiny_stack, "/v1/chat/completions", {**CHAT, "temperature": 1.0, "seed": 3,
                                                     "best_of": 3}).json()
    assert len(chat["choices"]) == 1
    for change in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        reply = post(tiny_stack, "/v1/completions", {**COMPLETION, **change})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "best_of"


def test_continue_final_message_extends_the_assistant_message(tiny_stack):
    start = "The quick brown"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": start}]
    body = {**CHAT, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    tokens = post(tiny_stack, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()["tokens"]
    text = post(tiny_stack, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text.endswith(start)  # no end of turn: the model continues the message
    reply = post(tiny_stack, "/v1/chat/completions", body).json()
    continued = post(tiny_stack, "/v1/completions", {**COMPLETION, "prompt": tokens}).json()
    assert reply["choices"][0]["message"]["content"] == continued["choices"][0]["text"]
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    both = post(tiny_stack, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_starts_the_reply_with_the_last_message_of_the_reply_s_role(tiny_stack):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {**CHAT, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = post(tiny_stack, "/v1/chat/completions", body).json()["choices"][0]
    echoed = post(tiny_stack, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Well," + plain["message"]["content"]
    chunks = httpx.post(tiny_stack.http_url + "/v1/chat/completions",
                        json={**body, "echo": True, "stream": True}, timeout=60).text
    assert '"delta":{"content":"Well,"}' in chunks
    # after a user message, the reply is the assistant's: nothing of the user's is echoed
    user_last = post(tiny_stack, "/v1/chat/completions", {**CHAT, "echo": True}).json()
    assert user_last["choices"][0]["message"]["content"] == \
        post(tiny_stack, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]


# ---- error details


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 3}', "prompt.1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/tokenize", b'{"prompt": "a\\ud83d"}', "prompt"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 3}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(tiny_stack, path, body, param):
    reply = httpx.post(tiny_stack.http_url + path, content=body, timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert "surrogate" in reply.json()["error"]["message"]
    logs = sorted(tiny_stack.log_dir.glob("frontend*.log"))
    assert logs
    frontend_log = "".join(p.read_text(errors="replace") for p in logs)
    assert "Traceback" not in frontend_log and "unexpected error" not in frontend_log


def test_invalid_json_says_where_and_names_no_param(tiny_stack):
    reply = httpx.post(tiny_stack.http_url + "/v1/completions", content=b'{"prompt": "x",}',
                       headers={"content-type": "application/json"}, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] is None
    assert "line 1 column 16" in error["message"]


def test_top_logprobs_out_of_range_names_top_logprobs(tiny_stack):
    reply = post(tiny_stack, "/v1/chat/completions", {**CHAT, "logprobs": True,
                                                      "top_logprobs": 50})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"


def test_too_many_choices_has_one_wording_whichever_bound(tiny_stack):
    for body in ({**COMPLETION, "n": 300}, {**COMPLETION, "prompt": ["a"] * 100, "n": 3}):
        message = post(tiny_stack, "/v1/completions", body).json()["error"]["message"]
        assert message.startswith("this request asks for") and "choices" in message


def test_get_on_a_post_route_is_a_405_invalid_request_error(tiny_stack):
    reply = httpx.get(tiny_stack.http_url + "/v1/completions", timeout=60)
    assert reply.status_code == 405
    assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", -5),
                                         ("min_tokens", 99), ("logprobs", 50),
                                         ("stop_token_ids", [10**6]), ("stop", [""])])
def test_a_bad_sampling_value_names_its_field(tiny_stack, field, value):
    reply = post(tiny_stack, "/v1/completions", {**COMPLETION, field: value})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field
