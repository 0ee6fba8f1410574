import pytest
from pydantic import ValidationError

from frontend_svc.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend_svc.request.translate import (
    ModelLimits, chat_input, completion_inputs, fan_out)
from shared.types import InvalidRequestError, SamplingParams

LIMITS = ModelLimits(max_model_len=64, vocab_size=49152)


def completion(tokenizer, **body):
    return completion_inputs(CompletionRequest(**body), tokenizer, LIMITS)


def test_text_prompt_is_tokenized_and_defaults_follow_openai(tokenizer):
    [inp] = completion(tokenizer, prompt="Hello there")
    assert inp.prompt_token_ids == tokenizer.encode("Hello there")
    assert inp.params.max_tokens == 16 and inp.params.temperature == 1.0
    assert inp.params.seed is None and inp.stops == []


def test_token_id_prompts_and_batches_of_them(tokenizer):
    [one] = completion(tokenizer, prompt=[1, 2, 3])
    assert one.prompt_token_ids == [1, 2, 3]
    many = completion(tokenizer, prompt=[[5, 6], [7]])
    assert [m.prompt_token_ids for m in many] == [[5, 6], [7]]
    texts = completion(tokenizer, prompt=["a", "b c"])
    assert len(texts) == 2


def test_sampling_fields_reach_sampling_params(tokenizer):
    [inp] = completion(tokenizer, prompt="x", max_tokens=5, temperature=0.0, top_p=0.5,
                       top_k=7, min_p=0.1, seed=3, stop="END", stop_token_ids=[9],
                       ignore_eos=True, min_tokens=2, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=2,
                       priority=4)
    p = inp.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (5, 0.0, 0.5, 7, 0.1, 3)
    assert (p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs) == ([9], True, 2, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert inp.stops == ["END"] and inp.priority == 4


@pytest.mark.parametrize("body, words", [
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": [[]]}, "empty"),
    ({"prompt": [1, 49152]}, "outside the vocabulary"),
    ({"prompt": [-1]}, "outside the vocabulary"),
    ({"prompt": [1] * 65, "max_tokens": 1}, "maximum context length"),
    ({"prompt": [1] * 60, "max_tokens": 5}, "maximum context length"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "n": 0}, "n must be"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop strings"),
    ({"prompt": "x", "stop_token_ids": [49152]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
])
def test_bad_completion_input_is_refused_with_a_message_naming_it(tokenizer, body, words):
    with pytest.raises(InvalidRequestError, match=words):
        completion(tokenizer, **body)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": "many"},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": {"text": "x"}},
    {"prompt": "x", "stop": 5},
    {"prompt": "x", "stream_options": 3},
])
def test_known_fields_of_the_wrong_type_fail_schema_validation(body):
    with pytest.raises(ValidationError):
        CompletionRequest(**body)


def test_unknown_fields_are_ignored(tokenizer):
    [inp] = completion(tokenizer, prompt="x", some_future_field={"a": 1})
    assert inp.prompt_token_ids


def test_chat_uses_the_template_and_defaults_to_the_rest_of_the_context(tokenizer):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    inp = chat_input(req, tokenizer, LIMITS)
    text = tokenizer.decode(inp.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert inp.params.max_tokens == LIMITS.max_model_len - len(inp.prompt_token_ids)


def test_chat_content_parts_are_joined_and_logprobs_translated(tokenizer):
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        logprobs=True, top_logprobs=3, max_completion_tokens=4)
    inp = chat_input(req, tokenizer, LIMITS)
    assert inp.params.logprobs == 3 and inp.params.max_tokens == 4
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        chat_input(ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                         top_logprobs=2), tokenizer, LIMITS)


def test_chat_prompt_filling_the_context_is_refused(tokenizer):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "word " * 80}])
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        chat_input(req, tokenizer, LIMITS)


def test_fan_out_gives_each_seeded_choice_its_own_seed():
    assert [p.seed for p in fan_out(SamplingParams(seed=10), 3)] == [10, 11, 12]
    assert [p.seed for p in fan_out(SamplingParams(), 2)] == [None, None]
    a, b = fan_out(SamplingParams(stop_token_ids=[1]), 2)
    assert a.stop_token_ids is not b.stop_token_ids


def test_add_special_tokens_adds_the_tokenizer_s_own(tokenizer):
    import copy

    from tokenizers import processors
    bos = tokenizer.fast.token_to_id("<|im_start|>")
    with_bos = copy.copy(tokenizer)  # the same tokenizer, but one that adds a BOS
    with_bos.fast = tokenizer.fast.__class__.from_str(tokenizer.fast.to_str())
    with_bos.fast.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    messages = [{"role": "user", "content": "Hi"}]
    plain = chat_input(ChatCompletionRequest(messages=messages), with_bos, LIMITS)
    added = chat_input(ChatCompletionRequest(messages=messages, add_special_tokens=True),
                       with_bos, LIMITS)
    assert added.prompt_token_ids == [bos] + plain.prompt_token_ids  # vLLM: off for chat
    [text] = completion_inputs(CompletionRequest(prompt="Hi"), with_bos, LIMITS)
    [bare] = completion_inputs(CompletionRequest(prompt="Hi", add_special_tokens=False),
                               with_bos, LIMITS)
    assert text.prompt_token_ids == [bos] + bare.prompt_token_ids  # on for completions
