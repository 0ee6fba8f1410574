"""The CPU attention backend writes K/V to the right slots and matches the reference,
with the C decode kernel (each ISA build this CPU runs, as an image ships them) and
with the pure torch path."""

import dataclasses
import shutil

import pytest
import torch

from tests.worker.attention_cases import random_case
from worker_svc import native
from worker_svc.attention import cpu_kernel, torch_backend
from worker_svc.attention.reference import reference_attention

CASES = {
    "decodes_only": ([1, 1, 1, 1], [0, 5, 17, 30]),
    "one_fresh_prefill": ([13], [0]),
    "chunk_after_context": ([6], [9]),
    "mixed_ragged_batch": ([1, 7, 1, 5, 1, 1], [20, 0, 3, 11, 0, 44]),
    "many_decodes_split_across_threads": ([1] * 16, [3 * i % 40 for i in range(16)]),
}


@pytest.fixture(params=[*(f"c_kernel-{v.name}" for v in native.supported_variants()),
                        "torch"])
def decode_path(request, monkeypatch):
    """The backend as a compute plan binds it: the C kernel's library, or None."""
    if request.param == "torch":
        return torch_backend.TorchBackend(None)
    # this ISA level's build, as on a CPU whose best it is
    variant = next(v for v in native.supported_variants()
                   if request.param == f"c_kernel-{v.name}")
    monkeypatch.setattr(native, "_cpu_features", lambda: variant.needs)
    cpu_kernel.load.cache_clear()
    request.addfinalizer(cpu_kernel.load.cache_clear)
    if cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the torch path serves decodes")
    return torch_backend.TorchBackend(cpu_kernel.load())


def test_c_decode_kernel_builds_where_a_compiler_exists():
    if shutil.which("cc") or shutil.which("gcc"):
        assert cpu_kernel.load() is not None


@pytest.mark.parametrize("name", CASES)
def test_torch_backend_matches_reference_attention(name, decode_path):
    q_lens, ctx_lens = CASES[name]
    query, key, value, kv_cache, meta = random_case(len(name), q_lens, ctx_lens,
                                                    num_blocks=200)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # lets the C kernel split a large batch across two threads
    try:
        _check_against_reference(decode_path, query, key, value, kv_cache, meta)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_decode_kernel_vector_paths_match_reference_attention(head_dim, decode_path):
    # 16-slot blocks: 8 keys at a time plus remainders; head_dim 64 and 128 take the
    # 64-dims-a-pass value sum, 24 the plain loop
    ctx = [0, 6, 7, 8, 15, 16, 17, 40, 100]
    query, key, value, kv_cache, meta = random_case(head_dim, [1] * len(ctx), ctx,
                                                    block_size=16, num_blocks=120,
                                                    head_dim=head_dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_against_reference(decode_path, query, key, value, kv_cache, meta)
    finally:
        torch.set_num_threads(threads)


def _check_against_reference(backend, query, key, value, kv_cache, meta):
    backend.write_kv(key, value, kv_cache, meta.slot_mapping)
    want = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35)
    got = backend.attention(query, kv_cache, meta, 0.35)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the step's decodes took the path the backend was bound to
    if meta.backend_state.decode_rows is not None:
        assert (meta.backend_state.decode_kernel is None) == (backend.decode_kernel is None)
    # a second layer reuses the per-step plan and still gets the right answer
    got_again = backend.attention(query * 2, kv_cache, meta, 0.35)
    torch.testing.assert_close(got_again, reference_attention(query * 2, kv_cache, meta, 0.35),
                               rtol=1e-5, atol=1e-5)


def test_write_kv_puts_each_token_in_its_slot_and_skips_negative_slots():
    kv_cache = torch.zeros(2, 4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    value = -key
    torch_backend.write_kv(key, value, kv_cache, torch.tensor([5, -1, 2]))
    flat_k, flat_v = kv_cache[0].view(-1, 1, 3), kv_cache[1].view(-1, 1, 3)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_v[2], value[2])
    assert int((flat_k != 0).any(-1).sum()) == 2  # the -1 row was written nowhere


@pytest.mark.parametrize("window", [1, 5, 16, 1000])
@pytest.mark.parametrize("name", CASES)
def test_sliding_window_hides_keys_a_window_or_more_behind_the_query(name, window,
                                                                     decode_path):
    """The C kernel serves the full layers of a step, the windowed ones take their own
    plan; both against the reference with its window (1000: wider than any context)."""
    q_lens, ctx_lens = CASES[name]
    query, key, value, kv_cache, meta = random_case(len(name) + window, q_lens, ctx_lens,
                                                    num_blocks=200)
    decode_path.write_kv(key, value, kv_cache, meta.slot_mapping)
    want_full = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35)
    want = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35,
                               window=window)
    got_full = decode_path.attention(query, kv_cache, meta, 0.35)
    got = decode_path.attention(query, kv_cache, meta, 0.35, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_full, want_full, rtol=1e-5, atol=1e-5)
    if window == 1:  # each query sees only itself: out is its own value
        assert not torch.allclose(got, got_full)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 1000])
@pytest.mark.parametrize("name", ["decodes_only", "many_decodes_split_across_threads"])
def test_c_decode_kernel_takes_a_sliding_window_as_the_reference(name, window, decode_path):
    """The window the C layer loops hand the kernel (Gemma 3's sliding layers): keys from
    the window's first, mid-block included, against the reference's window."""
    if decode_path.decode_kernel is None:
        pytest.skip("the torch path has no C kernel")
    q_lens, ctx_lens = CASES[name]
    query, key, value, kv_cache, meta = random_case(len(name) + window, q_lens, ctx_lens,
                                                    num_blocks=200)
    decode_path.write_kv(key, value, kv_cache, meta.slot_mapping)
    want = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35,
                               window=window)
    plan = torch_backend.decode_kernel_plan(meta, query.shape[1], kv_cache, 0.35,
                                            decode_path.decode_kernel)
    got = torch.full_like(query, float("nan"))
    plan(query, kv_cache, got, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", CASES)
def test_soft_capped_scores_match_the_reference(name, window, decode_path):
    q_lens, ctx_lens = CASES[name]
    query, key, value, kv_cache, meta = random_case(len(name), q_lens, ctx_lens,
                                                    num_blocks=200)
    query = query * 8  # scores well past the cap, where tanh bends them
    decode_path.write_kv(key, value, kv_cache, meta.slot_mapping)
    want = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35,
                               window=window, softcap=2.0)
    got = decode_path.attention(query, kv_cache, meta, 0.35, window=window, softcap=2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncapped = reference_attention(query, kv_cache, dataclasses.replace(meta), 0.35,
                                   window=window)
    assert not torch.allclose(got, uncapped, rtol=1e-3, atol=1e-3)
