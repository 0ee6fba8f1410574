"""Greedy rows of small CPU steps: the vocabulary projection screened by an int8 copy
(small_linear.screened_argmax_logits). Wherever a row's argmax can be, the screened
logits hold exactly what the full projection gives; so the argmax, ties included, is
the full projection's. A worker uses it only when every sampling row just takes its
argmax, and counts what it did."""

import pytest
import torch

from shared.types import SamplingParams
from worker_svc.model.cpu import small_linear
from worker_svc.model.cpu.small_linear import (SCREEN_MAX_CANDIDATES, quantize_int8,
                                           screened_argmax_logits)

from .step_driver import run_outputs, tiny_cpu_runner

pytestmark = pytest.mark.skipif(small_linear.load() is None,
                                reason="no C compiler here: no small-batch kernel")


def _check(kernel, x, exact):
    full = kernel(x, exact)
    got = screened_argmax_logits(kernel, x, quantize_int8(exact), exact)
    assert got is not None
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], full[kept])  # bit for bit where it is not -inf
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    return kept.sum(-1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_the_argmax_and_every_kept_logit_are_the_full_projections(rows, seed):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(3000, 576, generator=g) * 0.05
    # near ties: rows that differ from the best one by less than int8's rounding
    exact[1000:1040] = exact[7] + torch.randn(40, 576, generator=g) * 1e-4
    x = torch.randn(rows, 576, generator=g)
    x[:, 5] *= 40  # an outlier feature, as hidden states have
    x[0] = exact[7] * 30  # row 0's best logit is row 7's, with the near ties around it
    kept = _check(small_linear.load(), x, exact)
    assert int(kept.max()) < 300  # a screen, not the full projection
    assert int(kept[0]) > 1  # the near ties could not be told apart in int8


def test_the_bound_holds_where_int8_rounding_reverses_the_order_by_most():
    # Rows 0 and 1 against x = +-1: int8 rounds every weight of row 1 that x adds down
    # by 0.49 of a step and of row 0 up, so the int8 logits put row 0 ahead by 120
    # steps while the exact ones put row 1 ahead by 1.52. Row 1 stays a candidate only
    # if each logit's bound covers nearly half a step per input (the 0.5 term of
    # screen_factor): a smaller bound would drop it and take the wrong argmax.
    inp, per_group = 128, small_linear.GROUP
    x = torch.ones(1, inp)
    best, other = torch.full((inp,), 10.49), torch.full((inp,), 10.51)  # q 10 and 11
    x[0, ::per_group] = 0.0  # each group's first weight, 127, only fixes its scale (1.0)
    best[::per_group] = other[::per_group] = 127.0
    flipped = [1, 2, 33, 34]  # x = -1 here: row 1 at 9.51 (q 10), row 0 at 10.49
    x[0, flipped] = -1.0
    best[flipped], other[flipped] = 9.51, 10.49
    exact = torch.stack([other, best])
    assert quantize_int8(exact).scales.eq(1.0).all()
    kernel = small_linear.load()
    assert int(kernel(x, exact).argmax()) == 1
    assert int(kernel(x, quantize_int8(exact)).argmax()) == 0
    _check(kernel, x, exact)


def test_exact_ties_go_to_the_lowest_index_as_in_the_full_projection():
    g = torch.Generator().manual_seed(1)
    exact = torch.randn(500, 64, generator=g)
    exact[[40, 41, 300]] = exact[200].clone()  # four identical rows
    x = (exact[200] * 3).unsqueeze(0)
    _check(small_linear.load(), x, exact)
    assert int(screened_argmax_logits(small_linear.load(), x, quantize_int8(exact),
                                      exact).argmax()) == 40


def test_flat_logits_fall_back_to_the_full_projection_and_nan_too():
    kernel = small_linear.load()
    exact = torch.randn(SCREEN_MAX_CANDIDATES + 100, 64)
    approx = quantize_int8(exact)
    assert screened_argmax_logits(kernel, torch.zeros(1, 64), approx, exact) is None
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    assert screened_argmax_logits(kernel, x, approx, exact) is None


def _decode(runner, params: list[SamplingParams]) -> list[list[int]]:
    # 10 tokens each; a min_tokens of 12 keeps its suppression on the whole run
    return run_outputs(runner, [list(range(5 + i, 25 + i)) for i in range(len(params))],
                       10, params)


@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_steps_are_screened_and_give_the_unscreened_tokens(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    greedy = [SamplingParams(temperature=0.0)] * 3
    on = tiny_cpu_runner(path)
    assert on.compute_plan.argmax_screen
    tokens = _decode(on, greedy)
    assert on.model.screen_rows["screened"] >= 3 * 9  # every decode step's rows
    off = tiny_cpu_runner(path, cpu_argmax_screen=False)
    assert off.model.argmax_screen is None and not off.compute_plan.argmax_screen
    assert _decode(off, greedy) == tokens


@pytest.mark.parametrize("other", [
    SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
    SamplingParams(temperature=0.0, min_tokens=12, max_tokens=16)])
def test_a_step_with_any_row_that_needs_more_than_its_argmax_projects_in_full(
        tiny_llama_dir, other):
    runner = tiny_cpu_runner(tiny_llama_dir)
    _decode(runner, [SamplingParams(temperature=0.0), other])
    assert runner.model.screen_rows["screened"] == 0


def test_int8_weights_project_in_int8_and_need_no_screen(tiny_llama_dir):
    runner = tiny_cpu_runner(tiny_llama_dir, quantization="int8")
    assert runner.model.argmax_screen is None
    assert not runner.compute_plan.argmax_screen
