"""--quantization int8: the small-batch kernel's weights as int8 with a scale per 32
inputs (worker_svc/model/cpu/small_linear.py). Quantizing keeps each weight within half a
scale step; the kernel computes x @ dequantize(w).T on every ISA build this CPU runs;
a worker decodes on the int8 copies and runs wider steps on its --dtype weights, and
on a checkpoint whose weights int8 holds exactly its greedy tokens are the fp32 ones."""

import ctypes

import pytest
import torch

from worker_svc import native
from worker_svc.config import WorkerConfig
from worker_svc.model.cpu import small_linear
from worker_svc.model.cpu.small_linear import GROUP, Int8Weight, quantize_int8
from worker_svc.model.loading.weights import weight_bytes

from .step_driver import run_outputs, tiny_cpu_runner

needs_kernel = pytest.mark.skipif(small_linear.load() is None,
                                  reason="no C compiler here: no small-batch kernel")


def test_each_weight_is_within_half_a_step_of_its_group_and_zero_groups_stay_zero():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 4 * GROUP, generator=g) * torch.logspace(-3, 1, 5).unsqueeze(1)
    w[2, GROUP:2 * GROUP] = 0.0
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.q.shape == w.shape
    assert qw.scales.shape == (5, 4) and qw.scales[2, 1] == 0
    assert int(qw.q.abs().max()) == 127  # each group's largest weight uses the full range
    step = qw.scales.repeat_interleave(GROUP, dim=1)
    assert bool(((qw.dequantize() - w).abs() <= step / 2 + 1e-12).all())
    assert bool((qw.dequantize()[2, GROUP:2 * GROUP] == 0).all())


def test_a_width_that_is_not_a_multiple_of_the_group_is_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(torch.zeros(4, 40))


@pytest.fixture(params=[v.name for v in native.supported_variants()])
def kernel(request):
    variant = next(v for v in native.supported_variants() if v.name == request.param)
    path = native.compile_variant("small_linear", variant, small_linear.FLAGS)
    if path is None:
        pytest.skip("no C compiler here")
    return small_linear.SmallLinear(ctypes.CDLL(str(path)))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("width", [GROUP, 576, 3 * GROUP])
def test_the_kernel_is_x_times_the_dequantized_weight_transposed(kernel, rows, width):
    g = torch.Generator().manual_seed(rows * 100 + width)
    qw = quantize_int8(torch.randn(67, width, generator=g))
    x = torch.randn(rows, 2 * width + 3, generator=g)[:, 3:3 + width]  # strided rows
    bias = torch.randn(67, generator=g)
    w = qw.dequantize().double()
    want = x.double() @ w.T + bias.double()
    # x meets the int8 weights as int16 with a scale per group (max|x| / 32767): each
    # element within half that step; then fp32 sums of exact int32 group sums
    group_max = x.abs().reshape(rows, -1, GROUP).amax(-1, keepdim=True)
    half_step = (group_max / 32767 / 2).expand(-1, -1, GROUP).reshape(rows, width)
    bound = half_step.double() @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    got = kernel(x, qw, bias).double()
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


def _prequantized_copy(src, dst):
    """The checkpoint with every matmul weight (the tied embedding too) replaced by its
    int8 value: quantizing it again gives the same numbers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(quantize_int8(p).dequantize())
    model.save_pretrained(str(dst))
    return dst


@pytest.fixture(scope="module")
def int8_exact_dir(tiny_llama_dir, tmp_path_factory):
    return _prequantized_copy(tiny_llama_dir, tmp_path_factory.mktemp("int8_exact"))


@needs_kernel
def test_small_steps_read_int8_copies_and_wide_steps_the_dtype_weights(tiny_llama_dir):
    int8 = tiny_cpu_runner(tiny_llama_dir, quantization="int8")
    plain = tiny_cpu_runner(tiny_llama_dir)
    model = int8.model
    # int8 copies serve steps of up to INT8_MAX_ROWS tokens (short prefills too)
    assert model.small_max_rows == small_linear.INT8_MAX_ROWS > small_linear.MAX_ROWS
    assert plain.model.small_max_rows == small_linear.MAX_ROWS
    small_layers, _ = model._matmuls(small_linear.INT8_MAX_ROWS)
    wide_layers, _ = model._matmuls(small_linear.INT8_MAX_ROWS + 1)
    assert plain.model._matmuls(small_linear.MAX_ROWS + 1)[0] is plain.model.w.layers
    assert isinstance(small_layers[0].gate_up, Int8Weight)
    assert isinstance(model._small_lm_head, Int8Weight)
    assert wide_layers is model.w.layers and wide_layers[0].gate_up.dtype == torch.float32
    assert int8.compute_plan.small_batch == "int8"
    assert plain.compute_plan.small_batch == "plain"
    # plain: one fp32 copy (cpu_dtype); int8: its int8 copies on top of the fp32 one, a
    # quarter of its bytes plus the scales, counted for the KV sizing
    fp32 = weight_bytes(plain.model.w)
    assert fp32 < weight_bytes(int8.model.w) < 1.5 * fp32


@needs_kernel
def test_on_weights_int8_holds_exactly_the_greedy_tokens_are_the_fp32_ones(int8_exact_dir):
    # 3 requests decode 3 rows a step (int8); the prefill step has 60 rows (fp32)
    prompts = [list(range(3, 23)), list(range(40, 60)), list(range(7, 27))]
    int8 = tiny_cpu_runner(int8_exact_dir, quantization="int8")
    fp32 = tiny_cpu_runner(int8_exact_dir)
    # the vocabulary projection of a small step: the same logits, to rounding
    x = torch.randn(3, int8.model_config.hidden_size, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(int8.model._logits(x), fp32.model._logits(x),
                               rtol=1e-4, atol=1e-4)  # x as int16: within 1/65534
    assert run_outputs(int8, prompts, 12) == run_outputs(fp32, prompts, 12)
    # a lone 20-token prompt: its prefill step (20 rows) reads the int8 copies too
    int8 = tiny_cpu_runner(int8_exact_dir, quantization="int8")
    fp32 = tiny_cpu_runner(int8_exact_dir)
    assert run_outputs(int8, prompts[:1], 12) == run_outputs(fp32, prompts[:1], 12)


def test_int8_is_refused_with_a_reason_when_nothing_would_run_it(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be int8"):
        WorkerConfig(quantization="int4").validate()
    with pytest.raises(ValueError, match="needs the small-batch kernel"):
        tiny_cpu_runner(tiny_llama_dir, quantization="int8", cpu_small_batch=False)


@needs_kernel
def test_the_vocabulary_projection_takes_int8_for_as_many_rows_as_the_matmuls(int8_exact_dir):
    """One gate for a step: up to INT8_MAX_ROWS sampling rows project through the
    int8 copy (bit for bit the kernel's), wider steps through the --dtype weights."""
    from worker_svc.model.llama import _linear
    model = tiny_cpu_runner(int8_exact_dir, quantization="int8").model
    assert model.logits_max_rows == model.small_max_rows == small_linear.INT8_MAX_ROWS
    g = torch.Generator().manual_seed(7)
    for rows, int8 in [(small_linear.MAX_ROWS + 4, True), (small_linear.INT8_MAX_ROWS, True),
                       (small_linear.INT8_MAX_ROWS + 1, False)]:
        x = torch.randn(rows, model.cfg.hidden_size, generator=g)
        want = model.small(x, model._small_lm_head) if int8 else _linear(x, model.w.lm_head)
        assert torch.equal(model._logits(x), want), rows
    # 12 requests decode 12 rows a step: their greedy tokens are still the fp32 ones
    prompts = [list(range(3 + 5 * i, 20 + 5 * i)) for i in range(12)]
    assert run_outputs(tiny_cpu_runner(int8_exact_dir, quantization="int8"), prompts, 8) == \
        run_outputs(tiny_cpu_runner(int8_exact_dir), prompts, 8)
