"""Every kind of bad input is refused at the door with OpenAI's error JSON and the
right 4xx, nothing reaches the scheduler, and the server keeps answering correctly."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

GOOD = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
LONG_PROMPT = "word " * 600  # the tiny stack's max_model_len is 512

BAD_COMPLETIONS = [
    ("prompt longer than max_model_len", {"prompt": LONG_PROMPT}, 400),
    ("prompt + max_tokens beyond max_model_len", {"max_tokens": 510}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("empty token list", {"prompt": []}, 400),
    ("token id outside the vocabulary", {"prompt": [1, 2, 10**6]}, 400),
    ("negative temperature", {"temperature": -0.5}, 400),
    ("top_p of zero", {"top_p": 0.0}, 400),
    ("top_k below -1", {"top_k": -5}, 400),
    ("min_p above one", {"min_p": 2.0}, 400),
    ("max_tokens zero", {"max_tokens": 0}, 400),
    ("presence penalty out of range", {"presence_penalty": 9}, 400),
    ("repetition penalty zero", {"repetition_penalty": 0}, 400),
    ("logprobs too many", {"logprobs": 50}, 400),
    ("n zero", {"n": 0}, 400),
    ("empty stop string", {"stop": [""]}, 400),
    ("stop token outside the vocabulary", {"stop_token_ids": [10**6]}, 400),
    ("min_tokens above max_tokens", {"min_tokens": 50}, 400),
    ("max_tokens of the wrong type", {"max_tokens": "many"}, 400),
    ("temperature of the wrong type", {"temperature": "hot"}, 400),
    ("prompt of the wrong type", {"prompt": {"text": "x"}}, 400),
    ("stop of the wrong type", {"stop": 5}, 400),
    ("missing prompt", {"prompt": None}, 400),
    ("unknown model", {"model": "no-such-model"}, 404),
]


def post(stack, path: str, body) -> httpx.Response:
    return httpx.post(stack.http_url + path, json=body, timeout=30)


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]


def steps(stack, timeout_s: float = 30.0) -> int:
    """The scheduler's step count once it is idle (an idle scheduler runs no steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.get(stack.http_url + "/v1/status").json()
        if status["num_running"] == 0 and status["num_waiting"] == 0:
            return status["num_steps_total"]
        assert time.monotonic() < deadline, f"the scheduler never became idle: {status}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tiny_stack) -> str:
    """The correct greedy answer, taken before any bad input."""
    return post(tiny_stack, "/v1/completions", GOOD).json()["choices"][0]["text"]


@pytest.mark.parametrize("case, change, status", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_is_refused_and_nothing_is_queued(tiny_stack, reference, case, change,
                                                         status):
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    before = steps(tiny_stack)
    for stream in (False, True):
        assert_openai_error(post(tiny_stack, "/v1/completions", {**body, "stream": stream}),
                            status)
    assert steps(tiny_stack) == before  # nothing reached the scheduler
    assert post(tiny_stack, "/v1/completions", GOOD).json()["choices"][0]["text"] == reference


@pytest.mark.parametrize("change", [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {"messages": "not a list"},
    {"messages": [{"role": "user", "content": LONG_PROMPT}]},
    {"top_logprobs": 3},
    {"temperature": -1},
    {"max_completion_tokens": 0},
])
def test_bad_chat_request_is_refused(tiny_stack, reference, change):
    assert_openai_error(post(tiny_stack, "/v1/chat/completions", {**CHAT, **change}), 400)
    assert post(tiny_stack, "/v1/completions", GOOD).json()["choices"][0]["text"] == reference


def test_malformed_json_is_a_400(tiny_stack):
    response = httpx.post(tiny_stack.http_url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_bad_tokenize_and_detokenize_input(tiny_stack):
    assert_openai_error(post(tiny_stack, "/detokenize", {"tokens": [-1]}), 400)
    assert_openai_error(post(tiny_stack, "/detokenize", {"tokens": "abc"}), 400)
    assert_openai_error(post(tiny_stack, "/tokenize", {}), 400)


def test_the_openai_client_sees_typed_errors(tiny_stack, reference):
    client = tiny_stack.openai()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=tiny_stack.served_model_name, prompt=LONG_PROMPT)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    again = client.completions.create(model=tiny_stack.served_model_name, **GOOD)
    assert again.choices[0].text == reference
