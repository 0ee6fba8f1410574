"""Small decode steps run every layer in one C call (worker_svc/model/cpu/decode_layers.py):
the same kernels in the same order as the Python loop, so the same bits; it takes
only the steps it can (all rows single-token decodes, no more than the small-batch
kernel's copies serve, no biases)."""

import pytest
import torch

from shared.types import SamplingParams
from worker_svc.model.cpu import decode_layers, small_linear

from .step_driver import StepDriver, tiny_cpu_runner

needs_kernels = pytest.mark.skipif(decode_layers.load() is None,
                                   reason="no C compiler here: the Python loop runs")


def _record(runner):
    """Every step's final hidden rows (what the vocabulary projection gets), and how
    many steps the C loop ran."""
    seen, model = {"x": [], "c_steps": 0}, runner.model
    logits, layers = model._logits, model.decode_layers

    def record_logits(x, argmax_only=False):
        seen["x"].append(x.clone())
        return logits(x, argmax_only)

    model._logits = record_logits
    if layers is not None:
        run = layers.run

        def counted(*args):
            seen["c_steps"] += 1
            return run(*args)

        layers.run = counted
    return seen


def _drive(runner, prompts, max_new=6):
    driver = StepDriver(runner)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, max_new=max_new,
                   params=SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=3))
    driver.run_to_completion()
    return [driver.requests[f"r{i}"].output for i in range(len(prompts))]


_CONFIGS = {"fp32": {}, "int8": {"quantization": "int8"}, "bf16_weights": {"dtype": "bfloat16"}}


@needs_kernels
@pytest.mark.parametrize("name,batch", [
    *((name, batch) for name in _CONFIGS for batch in (1, 3, 7)),
    # int8 copies serve up to INT8_MAX_ROWS rows, so wider decode steps take the C loop
    ("int8", small_linear.MAX_ROWS + 4)])
def test_the_c_loop_gives_the_python_loops_bits(tiny_llama_dir, name, batch):
    config = _CONFIGS[name]
    prompts = [list(range(3 + 7 * i, 20 + 7 * i)) for i in range(batch)]
    c_loop, py_loop = tiny_cpu_runner(tiny_llama_dir, **config), \
        tiny_cpu_runner(tiny_llama_dir, **config)
    py_loop.model.decode_layers = None
    seen_c, seen_py = _record(c_loop), _record(py_loop)
    assert _drive(c_loop, prompts) == _drive(py_loop, prompts)
    assert seen_c["c_steps"] == 5  # every decode step; the prefill step had 17+ rows
    assert len(seen_c["x"]) == len(seen_py["x"])
    for a, b in zip(seen_c["x"], seen_py["x"]):
        assert torch.equal(a, b)
    # and the KV caches it wrote hold the same bits
    for a, b in zip(c_loop.kv_caches, py_loop.kv_caches):
        assert torch.equal(a, b)


@needs_kernels
def test_steps_it_cannot_take_run_the_python_loop(tiny_llama_dir, tiny_qwen2_dir):
    # a step with a prompt chunk of few tokens beside a decode: not all single-token
    runner = tiny_cpu_runner(tiny_llama_dir)
    seen = _record(runner)
    driver = StepDriver(runner)
    driver.add("a", list(range(3, 20)), max_new=4)
    driver.step()  # a's prompt
    driver.add("b", [5, 6], max_new=2)
    driver.step()  # a decodes, b's two-token prompt: the Python loop
    assert seen["c_steps"] == 0
    driver.run_to_completion()  # a and b decode together: the C loop
    assert seen["c_steps"] >= 1
    # wider than the small-batch kernel's rows: the Python loop (oneDNN)
    wide = tiny_cpu_runner(tiny_llama_dir)
    seen = _record(wide)
    _drive(wide, [[3 + i, 9, 11] for i in range(small_linear.MAX_ROWS + 1)], max_new=3)
    assert seen["c_steps"] == 0
    # Qwen2's q/k/v biases: no C loop for that model at all
    assert tiny_cpu_runner(tiny_qwen2_dir).model.decode_layers is None


def test_off_switch_keeps_the_python_loop(tiny_llama_dir):
    runner = tiny_cpu_runner(tiny_llama_dir, cpu_decode_layers=False)
    assert runner.model.decode_layers is None
    assert runner.compute_plan.layer_loop == ("c_ops" if runner.model.fused else "torch")
