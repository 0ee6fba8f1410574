import pytest

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_exactly_like_transformers(tokenizer, add_generation_prompt):
    from transformers import AutoTokenizer  # the reference; the frontend never imports it

    from shared.default_model import ensure_default_model
    hf = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    for messages in CHATS:
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt)
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert ids == hf.encode(expected, add_special_tokens=False)


def test_eos_token_comes_from_the_tokenizer_config(tokenizer):
    assert tokenizer.eos_token_id == tokenizer.fast.token_to_id("<|im_end|>")
