"""The small-batch matmul kernel (worker_svc/csrc/small_linear.c) computes x @ w.T for
fp32 and bf16 weights, any row count and width (tails included), on every ISA build
this CPU runs; the worker uses it for steps of at most MAX_ROWS tokens, on plain
copies of its prepacked weights, and a decode gives the greedy tokens it gives without
it."""

import ctypes

import pytest
import torch

from worker_svc import native
from worker_svc.model.cpu import small_linear
from worker_svc.model.loading.weights import weight_bytes

from .step_driver import run_outputs, tiny_cpu_runner

pytestmark = pytest.mark.skipif(small_linear.load() is None,
                                reason="no C compiler here: oneDNN runs every step")


@pytest.fixture(params=[v.name for v in native.supported_variants()])
def kernel(request):
    variant = next(v for v in native.supported_variants() if v.name == request.param)
    path = native.compile_variant("small_linear", variant, small_linear.FLAGS)
    assert path is not None
    return small_linear.SmallLinear(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
@pytest.mark.parametrize("width", [576, 37, 1])
def test_the_kernel_is_x_times_w_transposed_in_fp32(kernel, dtype, rows, width):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    w = torch.randn(67, width, generator=g).to(dtype)
    x = torch.randn(rows, 2 * width + 3, generator=g)[:, 3:3 + width]  # strided rows
    # bf16 weights widen to fp32 exactly; x is not rounded to bf16
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(kernel(x, w), want, rtol=1e-5, atol=1e-5 * width ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("width", [576, 37])
def test_an_output_has_the_same_bits_whatever_the_rows_beside_it(kernel, dtype, width):
    # The argmax screen computes its candidates one row at a time and promises the
    # full projection's bits; five to eight rows a pass take another loop on AVX2.
    if dtype == "int8" and width % small_linear.GROUP:
        pytest.skip("int8 weights need whole groups of inputs")
    g = torch.Generator().manual_seed(width)
    w = torch.randn(45, width, generator=g)
    w = small_linear.quantize_int8(w) if dtype == "int8" else w.to(dtype)
    x = torch.randn(17, width, generator=g)
    alone = torch.cat([kernel(x[r:r + 1], w) for r in range(17)])
    for rows in range(2, 18):
        assert torch.equal(kernel(x[:rows], w), alone[:rows]), rows


def test_a_bias_is_added_and_zero_rows_give_an_empty_result(kernel):
    g = torch.Generator().manual_seed(3)
    w, b, x = (torch.randn(40, 64, generator=g), torch.randn(40, generator=g),
               torch.randn(2, 64, generator=g))
    torch.testing.assert_close(kernel(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert kernel(x[:0], w).shape == (0, 40)


def test_threads_split_the_rows_without_changing_the_result(kernel):
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(1001, 96, generator=g), torch.randn(3, 96, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w)
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, w), one)  # each output is one thread's sum
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_decode_steps_give_the_same_greedy_tokens_with_and_without_the_kernel(
        checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    # 3 requests decode 3 rows a step (the kernel); the prefill step has 60 (oneDNN)
    prompts = [list(range(3, 23)), list(range(40, 60)), list(range(7, 27))]
    on = tiny_cpu_runner(path)
    assert on.model.small is not None
    # one copy: the kernel's plain weights, which the wide steps read through oneDNN
    assert not on.model.w.layers[0].gate_up.is_mkldnn and on.model.w.plain_layers is None
    off = tiny_cpu_runner(path, cpu_small_batch=False)
    assert off.model.small is None and off.model.w.plain_layers is None
    if off.model.w.layers[0].gate_up.is_mkldnn:  # prepacked: the wide steps' only copy
        assert on.compute_plan.prepack and off.compute_plan.prepack
    assert run_outputs(on, prompts, 12) == run_outputs(off, prompts, 12)


def test_the_plain_weights_serve_wide_steps_as_the_prepacked_ones_do(tiny_llama_dir):
    # a prefill of 60 rows (past MAX_ROWS) on the one plain copy through oneDNN, and
    # the same on a prepacked copy (no small-batch kernel): the same logits
    from .test_model_matches_transformers import _chunk_logits, _state
    prompt = list(range(3, 63))
    one = tiny_cpu_runner(tiny_llama_dir)
    packed = tiny_cpu_runner(tiny_llama_dir, cpu_small_batch=False)
    assert one.compute_plan.prepack and not one.model.w.layers[0].gate_up.is_mkldnn
    torch.testing.assert_close(_chunk_logits(one, _state(prompt), len(prompt)),
                               _chunk_logits(packed, _state(prompt), len(prompt)),
                               rtol=1e-5, atol=1e-5)
    assert weight_bytes(one.model.w) <= weight_bytes(packed.model.w)
