"""Issue 28 item 6: tenants do not share the prefix cache. With API keys, each key
has its own scope (--prefix-cache-scope key, the default), so key B cannot learn
that key A sent a prompt from `cached_tokens` (or TTFT); a client's cache_salt
scopes within its key; --prefix-cache-scope global shares the cache again."""

from __future__ import annotations

import openai
import pytest

from frontend_svc.api.auth import key_scope
from shared.proto import common_pb2, generate_pb2
from tests.integration.conftest import TINY_FLAGS, start_stack

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
PROMPT = list(range(100, 180))  # five full blocks of 16


def cached(stack, key: str, prompt: list[int] = PROMPT, **extra) -> int:
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key=key, max_retries=0)
    reply = client.completions.create(model=stack.served_model_name, prompt=prompt,
                                      max_tokens=1, temperature=0.0, extra_body=extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def grpc_cached(stack, key: str, prompt: list[int]) -> int:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    messages = list(stack.generation_stub().Generate(
        request, metadata=(("authorization", f"Bearer {key}"),), timeout=60))
    return messages[-1].final.usage.cached_tokens


@pytest.fixture(scope="module", params=["key", "global"])
def stack(request, tiny_model_dir, tmp_path_factory):
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp(f"scope-{request.param}"),
                        flags=[*TINY_FLAGS, "--api-key", f"{KEY_A},{KEY_B}",
                               "--prefix-cache-scope", request.param])
    yield stack, request.param
    stack.stop()


def test_one_key_never_sees_another_keys_cached_prompt_unless_the_scope_is_global(stack):
    stack, scope = stack
    prompt = [t + (0 if scope == "key" else 1) for t in PROMPT]
    assert cached(stack, KEY_A, prompt) == 0  # first sight
    if scope == "key":
        assert cached(stack, KEY_B, prompt) == 0  # B cannot probe A's prompt
    else:
        assert cached(stack, KEY_B, prompt) >= 64  # one shared cache
    assert cached(stack, KEY_A, prompt) >= 64  # A's own prompt is still cached for A


def test_the_grpc_api_is_scoped_the_same_way(stack):
    stack, scope = stack
    prompt = [t + 3 for t in PROMPT]
    assert cached(stack, KEY_A, prompt) == 0  # A sends it over HTTP
    b_hits = grpc_cached(stack, KEY_B, prompt)
    assert b_hits == 0 if scope == "key" else b_hits >= 64
    assert grpc_cached(stack, KEY_A, prompt) >= 64


def test_a_cache_salt_scopes_within_the_key(stack):
    stack, scope = stack
    prompt = [t + 2 for t in PROMPT]
    assert cached(stack, KEY_A, prompt, cache_salt="s1") == 0
    assert cached(stack, KEY_A, prompt, cache_salt="s1") >= 64
    assert cached(stack, KEY_A, prompt, cache_salt="s2") == 0
    # the same salt under another key is another scope, unless the scope is global
    b_hits = cached(stack, KEY_B, prompt, cache_salt="s1")
    assert b_hits == 0 if scope == "key" else b_hits >= 64


def test_the_scope_names_a_key_by_a_digest_never_the_key_itself():
    scope = key_scope(KEY_A)
    assert KEY_A not in scope and scope == key_scope(KEY_A) != key_scope(KEY_B)
