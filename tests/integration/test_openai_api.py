"""The OpenAI-compatible HTTP API through the real `openai` client against the
real stack (tiny random-weight model; the last test uses the default model)."""

from __future__ import annotations

import concurrent.futures

import json

import httpx
import pytest

from shared.proto import generate_pb2

PROMPT = "The quick brown fox"


def greedy(client, model, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=model, prompt=prompt, temperature=0.0,
                                     extra_body={"ignore_eos": True}, **kw)


def generated_ids(stack, prompt: str, max_tokens: int) -> list[int]:
    """Greedy token ids through the gRPC API (the HTTP API returns text)."""
    req = generate_pb2.GenerateRequest(text=prompt, sampling_params={
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    return [t for msg in stack.generation_stub().Generate(req, timeout=60) for t in msg.token_ids]


def test_models_lists_the_served_model(tiny_stack):
    [model] = tiny_stack.openai().models.list().data
    assert model.id == tiny_stack.served_model_name


def test_completion_streamed_equals_completion_not_streamed(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    whole = greedy(client, model)
    chunks = list(greedy(client, model, stream=True,
                         stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and streamed
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_usage_counts_prompt_and_completion_tokens_exactly(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    prompt_ids = httpx.post(tiny_stack.http_url + "/tokenize",
                            json={"prompt": PROMPT}).json()["tokens"]
    out = greedy(client, model, max_tokens=7)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7


def test_max_tokens_bounds_the_output(tiny_stack):
    ids = generated_ids(tiny_stack, PROMPT, 5)
    assert len(ids) == 5
    out = greedy(tiny_stack.openai(), tiny_stack.served_model_name, max_tokens=5)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_stop_string_is_withheld_reported_and_ends_the_count(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    full = greedy(client, model, max_tokens=20).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # likely spans a token boundary
    cut = full.index(stop)
    ids = generated_ids(tiny_stack, PROMPT, 20)
    tokenizer_text = [httpx.post(tiny_stack.http_url + "/detokenize",
                                 json={"tokens": ids[:i + 1]}).json()["prompt"]
                      for i in range(len(ids))]
    ending_token = next(i for i, t in enumerate(tokenizer_text) if stop in t)

    out = greedy(client, model, max_tokens=20, stop=[stop])
    choice = out.choices[0]
    assert choice.text == full[:cut]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert out.usage.completion_tokens == ending_token + 1

    streamed = "".join(c.choices[0].text for c in
                       greedy(client, model, max_tokens=20, stop=[stop], stream=True))
    assert streamed == full[:cut]


def test_chat_completion_streamed_and_not(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                           max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert whole.usage.completion_tokens == 10 == chunks[-1].usage.completion_tokens
    prompt_ids = httpx.post(tiny_stack.http_url + "/tokenize",
                            json={"messages": messages}).json()["tokens"]
    assert whole.usage.prompt_tokens == len(prompt_ids)


def test_seeded_sampling_is_reproducible(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name

    def sample(seed, n=1):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                        temperature=1.0, seed=seed, n=n,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    pair = sample(7, n=2)
    assert pair == sample(7, n=2) and pair[0] != pair[1] and pair[0] == sample(7)[0]


def test_n_choices_echo_and_token_id_prompts(tiny_stack):
    client, model = tiny_stack.openai(), tiny_stack.served_model_name
    single = greedy(client, model, max_tokens=4).choices[0].text
    out = greedy(client, model, max_tokens=4, n=3, echo=True)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.text == PROMPT + single for c in out.choices)
    assert out.usage.completion_tokens == 12
    ids = httpx.post(tiny_stack.http_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    batch = greedy(client, model, prompt=[ids, ids[:2]], max_tokens=4)
    assert batch.choices[0].text == single
    assert batch.usage.prompt_tokens == len(ids) + 2


def test_logprobs_are_returned_per_token(tiny_stack):
    out = greedy(tiny_stack.openai(), tiny_stack.served_model_name, max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and len(top) >= 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the top


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(tiny_stack):
    """vLLM's field: "token_id:<id>" where the text would be, on both endpoints,
    streamed and not; the ids are the tokens the text came from, and text_offset
    still counts characters of the text."""
    tok = httpx.post(tiny_stack.http_url + "/tokenize",
                     json={"prompt": "The quick brown fox", "add_special_tokens": False})
    base = {"model": tiny_stack.served_model_name, "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True}
    plain = httpx.post(tiny_stack.http_url + "/v1/completions", timeout=60, json={
        **base, "prompt": tok.json()["tokens"], "logprobs": 2}).json()["choices"][0]
    as_ids = httpx.post(tiny_stack.http_url + "/v1/completions", timeout=60, json={
        **base, "prompt": tok.json()["tokens"], "logprobs": 2,
        "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert as_ids["text"] == plain["text"]
    ids = [int(t.removeprefix("token_id:")) for t in as_ids["logprobs"]["tokens"]]
    assert all(t.startswith("token_id:") for t in as_ids["logprobs"]["tokens"])
    text = httpx.post(tiny_stack.http_url + "/detokenize", json={"tokens": ids}).json()
    assert text["prompt"] == plain["text"]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert as_ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    for top in as_ids["logprobs"]["top_logprobs"]:
        assert len(top) >= 2 and all(k.startswith("token_id:") for k in top)

    chat = {**base, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}
    whole = httpx.post(tiny_stack.http_url + "/v1/chat/completions", timeout=60,
                       json=chat).json()["choices"][0]["logprobs"]["content"]
    streamed = []
    with httpx.stream("POST", tiny_stack.http_url + "/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                lps = json.loads(line[6:])["choices"][0].get("logprobs")
                streamed += (lps or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert len(whole) == 5 and all(e["token"].startswith("token_id:") for e in whole)
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in whole)
    assert all(t["token"].startswith("token_id:") for e in whole for t in e["top_logprobs"])


def test_tokenize_and_detokenize_round_trip(tiny_stack):
    text = "Héllo 😀 world"
    tok = httpx.post(tiny_stack.http_url + "/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    back = httpx.post(tiny_stack.http_url + "/detokenize", json={"tokens": tok["tokens"]})
    assert back.json()["prompt"] == text
    assert httpx.get(tiny_stack.http_url + "/health").status_code == 200


def test_metrics_and_status_are_served(tiny_stack):
    greedy(tiny_stack.openai(), tiny_stack.served_model_name, max_tokens=2)
    metrics = httpx.get(tiny_stack.http_url + "/metrics").text
    assert "gapserve:time_to_first_token_seconds" in metrics
    status = httpx.get(tiny_stack.http_url + "/v1/status").json()
    assert status["max_num_seqs"] == 64 and isinstance(status["num_steps_total"], int)
    assert status["diagnosis"]
    assert "layer_loop=" in status["compute_plan"] and "threads=" in status["compute_plan"]


# ---------------------------------------------------------------------------
# the real default model against transformers


PROMPTS_32 = [f"Write one sentence about the number {i}." for i in range(24)] + [
    "The capital of France is", "def fibonacci(n):", "Once upon a time",
    "List three colours:", "Translate to French: good morning", "2 + 2 =",
    "The opposite of hot is", "Water boils at"]


@pytest.mark.e2e
def test_32_concurrent_greedy_requests_equal_transformers(default_stack):
    from transformers import GenerationConfig

    from frontend_svc.request.tokenizer import TextTokenizer
    from tests.integration.hf_reference import greedy_references, until_eos

    max_tokens = 16
    client, model = default_stack.openai(timeout=600), default_stack.served_model_name

    def one(prompt):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0.0, logprobs=0)
        return out.choices[0]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        choices = list(pool.map(one, PROMPTS_32))

    tokenizer = TextTokenizer.from_dir(default_stack.model_dir)
    eos = GenerationConfig.from_pretrained(default_stack.model_dir).eos_token_id
    # each prompt alone, greedy, cut where generate() stops
    expected_ids = [until_eos(ids, eos) for ids in greedy_references(
        default_stack.model_dir, [tokenizer.encode(p) for p in PROMPTS_32], max_tokens)]
    for prompt, choice, expected in zip(PROMPTS_32, choices, expected_ids):
        # token by token (logprobs carry each token's own text), then the whole text
        assert choice.logprobs.tokens == [tokenizer.token_text(t) for t in expected], prompt
        assert choice.text == tokenizer.decode(expected), prompt
        assert choice.finish_reason == ("stop" if expected[-1] == eos else "length"), prompt
