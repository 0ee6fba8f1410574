import pytest

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_exactly_like_transformers(tokenizer, add_generation_prompt):
    from transformers import AutoTokenizer  # the reference; the frontend never imports it

    from shared.model_files.default_model import ensure_default_model
    hf = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    for messages in CHATS:
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt)
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert ids == hf.encode(expected, add_special_tokens=False)


def test_eos_token_comes_from_the_tokenizer_config(tokenizer):
    assert tokenizer.eos_token_id == tokenizer.fast.token_to_id("<|im_end|>")


def test_continue_final_message_renders_like_transformers_and_needs_the_message(tokenizer):
    from transformers import AutoTokenizer

    from frontend_svc.errors import FieldError
    from shared.model_files.default_model import ensure_default_model
    hf = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    for final in ("The capital is", "Trailing space kept ", "  padded  "):
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": final}]
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=False,
                                          continue_final_message=True)
        ids = tokenizer.apply_chat_template(messages, False, continue_final_message=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert expected.rstrip().endswith(final.strip())  # no end-of-turn after it
    with pytest.raises(FieldError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "  "}], False,
                                      continue_final_message=True)
    assert info.value.param == "continue_final_message"
