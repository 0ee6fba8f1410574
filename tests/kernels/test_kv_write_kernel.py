"""KV-cache write: each token's key and value land in exactly its slot; padding
slots (-1) are skipped; nothing else in the cache changes."""

import pytest
import torch

from worker_svc.kernels.kv_write import write_kv


def expected_cache(cache, key, value, slots):
    want = cache.clone()
    flat = want.view(2, -1, cache.shape[3], cache.shape[4])
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            flat[0, s], flat[1, s] = key[i], value[i]
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keys_and_values_land_in_their_slots_and_padding_is_skipped(dtype):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 3, 64, generator=g).to(dtype)
    key = torch.randn(5, 3, 64, generator=g).to(dtype)
    value = torch.randn(5, 3, 64, generator=g).to(dtype)
    slots = torch.tensor([5, -1, 23, 4, -1])  # blocks 1 and 5, last slot of the cache
    want = expected_cache(cache, key, value, slots)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_key_and_value_may_be_views_of_a_fused_qkv_output():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 9 + 3 + 3, 8, generator=g)  # 9 query, 3 key, 3 value heads
    key, value = qkv[:, 9:12], qkv[:, 12:]
    cache = torch.zeros(2, 2, 4, 3, 8)
    slots = torch.tensor([4, 7, 0])
    want = expected_cache(cache, key, value, slots)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_mismatched_inputs_raise_and_leave_the_cache_unchanged():
    cache = torch.zeros(2, 2, 4, 3, 8)
    key = torch.ones(2, 3, 8)
    for bad in [
        (key, torch.ones(2, 3, 4), cache, torch.tensor([1, 2])),  # value shape
        (key, key, cache, torch.tensor([1])),  # one slot for two tokens
        (key.half(), key.half(), cache, torch.tensor([1, 2])),  # dtype
        (torch.ones(2, 2, 8), torch.ones(2, 2, 8), cache, torch.tensor([1, 2])),  # kv heads
    ]:
        with pytest.raises(ValueError):
            write_kv(*bad)
    assert not cache.any()
