"""A chat request's own `chat_template` and `chat_template_kwargs`, as vLLM takes
them: the template only under --trust-request-chat-template (else vLLM's 400, word
for word), the kwargs always; what they render is byte-equal to transformers'
apply_chat_template with the same template and kwargs."""

from __future__ import annotations

import pytest

from frontend_svc.structured.chat_template import UNTRUSTED
from frontend_svc.errors import FieldError
from frontend_svc.api.protocol import ChatCompletionRequest
from frontend_svc.structured.tools import ToolConfig, tools_template
from frontend_svc.request.translate import ModelLimits, chat_input

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
OWN = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
       "{% endfor %}{% if tools %}<tools>{{ tools | length }}{% endif %}"
       "{% if add_generation_prompt %}<reply lang={{ lang | default('en') }}>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def config(tokenizer, trusted: bool) -> ToolConfig:
    return ToolConfig(True, "hermes", tools_template(tokenizer.chat_template), trusted)


def prompt(tokenizer, trusted: bool = True, **body) -> str:
    body.setdefault("messages", ASK)
    inp = chat_input(ChatCompletionRequest(**body), tokenizer, ModelLimits(2048, 49152),
                     config(tokenizer, trusted))
    return tokenizer.decode(inp.prompt_token_ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    from shared.model_files.default_model import ensure_default_model
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.mark.parametrize("body,param", [
    ({"chat_template": OWN}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": OWN}}, "chat_template_kwargs.chat_template")])
def test_an_untrusted_request_template_is_vllm_s_400(tokenizer, body, param):
    with pytest.raises(FieldError) as info:
        prompt(tokenizer, trusted=False, **body)
    assert info.value.param == param and str(info.value) == UNTRUSTED


@pytest.mark.parametrize("kwargs", [None, {"lang": "fr"}])
def test_a_trusted_request_template_renders_as_transformers_does(tokenizer, hf, kwargs):
    expected = hf.apply_chat_template(ASK, chat_template=OWN, tokenize=False,
                                      add_generation_prompt=True, **(kwargs or {}))
    assert prompt(tokenizer, chat_template=OWN, chat_template_kwargs=kwargs) == expected
    assert prompt(tokenizer, chat_template_kwargs={**(kwargs or {}), "chat_template": OWN}) \
        == expected  # vLLM's other spelling
    assert "<reply lang=" in expected and "<|im_start|>system" not in expected


def test_kwargs_alone_need_no_trust_and_reach_the_model_s_template(tokenizer, hf):
    """SmolLM2's template reads no extra variable, but a kwarg may override a
    special token it uses, as in transformers (kwargs over the special tokens)."""
    kwargs = {"eos_token": "<END>", "unused": [1, 2]}
    expected = hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True,
                                      **kwargs)
    assert prompt(tokenizer, trusted=False, chat_template_kwargs=kwargs) == expected
    assert prompt(tokenizer, trusted=False, chat_template_kwargs={}) == prompt(tokenizer)


def test_a_request_template_that_reads_tools_renders_them(tokenizer):
    text = prompt(tokenizer, chat_template=OWN, tools=[WEATHER])
    assert text.endswith("<user>Hi?<tools>1<reply lang=en>")


@pytest.mark.parametrize("body,param,words", [
    ({"chat_template": "{% for m in messages %}"}, "chat_template", "does not compile"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "set by the server"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the server"),
    ({"chat_template": "{{ raise_exception('no system turns') }}"}, "messages",
     "no system turns"),
])
def test_a_bad_request_template_or_kwarg_is_a_400_naming_it(tokenizer, body, param, words):
    with pytest.raises(FieldError) as info:
        prompt(tokenizer, **body)
    assert info.value.param == param and words in str(info.value)
