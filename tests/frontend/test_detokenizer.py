import pytest

from frontend_svc.request.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Emoji 😀🎉 and flags 🇫🇷🇯🇵 split over byte tokens.",
    "中文字符和日本語のテキスト、한국어도.",
    "naïve café — ünïcödé «quotes» ∑∫√ and\nnew lines\ttabs",
]


def stream(tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer.for_prompt(tokenizer.fast, list(prompt_ids))
    pieces = [detok.step(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_one_decode_of_all_tokens(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids) == text


def test_no_delta_ever_contains_a_broken_character(tokenizer):
    ids = tokenizer.encode("😀世界🇫🇷", add_special_tokens=False)
    assert len(ids) > 4  # the characters really are split across tokens
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "😀世界🇫🇷"


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    ids = tokenizer.encode(" Paris 😀.", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids, prompt)) == " Paris 😀."


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "Hi"


def test_invalid_bytes_are_emitted_after_four_tokens_not_held_forever(tokenizer):
    lone = tokenizer.encode("😀", add_special_tokens=False)[0]  # a leading byte alone
    ids = [lone] * 6 + tokenizer.encode(" ok", add_special_tokens=False)
    pieces = stream(tokenizer, ids)
    assert any(pieces[:6])  # emitted (as U+FFFD) before the valid text arrived
    assert "".join(pieces) == tokenizer.decode(ids)
