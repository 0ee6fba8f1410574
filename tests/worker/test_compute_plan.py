"""One compute plan per worker (worker_svc/compute_plan.py): chosen at start from the
flags, the device and dtype, the model's shape, this machine's kernels and the ranks on
this host; reported in ModelInfo and followed by every step."""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from shared import config as flags
from shared.wire.common import model_info_from_proto, model_info_to_proto
from shared.types import ModelInfo
from worker_svc import fault_injection
from worker_svc.compute_plan import ComputePlan, Kernels, build_plan
from worker_svc.config import WorkerConfig
from worker_svc.model.cpu import fused_ops, small_linear
from worker_svc.server import worker_config

CPU = torch.device("cpu")
ALL = Kernels(attention=True, fused_ops=True, small_batch=True, decode_layers=True,
              prepack_fp32=True, prepack_bf16=True)
NONE = Kernels(*[False] * 6)


@dataclasses.dataclass
class Shape:  # what the plan reads of a model
    head_dim: int = 64
    hidden_size: int = 576


def plan(kernels=ALL, shape=Shape(), biases=False, ranks_on_host=1, cores=2,
         environ=None, **config) -> ComputePlan:
    return build_plan(WorkerConfig(**config), CPU, shape, biases=biases,
                      ranks_on_host=ranks_on_host, kernels=kernels, usable_cores=cores,
                      environ={} if environ is None else environ)


def test_an_fp32_cpu_worker_with_its_kernels_runs_every_c_path():
    p = plan()
    assert (p.attention, p.layer_loop, p.small_batch, p.prepack) == (
        "c_decode_kernel", "c_loop", "plain", True)
    assert p.small_max_rows == p.logits_max_rows == small_linear.MAX_ROWS
    assert p.argmax_screen and p.act_dtype == p.dtype == torch.float32


def test_int8_projects_the_vocabulary_of_as_many_rows_as_its_matmuls_take():
    p = plan(quantization="int8")
    assert p.small_batch == "int8"
    assert p.small_max_rows == p.logits_max_rows == small_linear.INT8_MAX_ROWS
    assert not p.argmax_screen  # its projection is int8 already


def test_each_cpu_switch_turns_off_only_its_own_part():
    base = plan()
    for name, changed in [("cpu_attention", {"attention": "torch_sdpa",
                                             "decode_layers": False}),
                          ("cpu_fused_ops", {"fused_ops": False, "decode_layers": False}),
                          ("cpu_decode_layers", {"decode_layers": False}),
                          ("cpu_prepack", {"prepack": False}),
                          ("cpu_argmax_screen", {"argmax_screen": False}),
                          ("cpu_small_batch", {"small_batch": "off", "small_max_rows": 0,
                                               "logits_max_rows": 0, "argmax_screen": False,
                                               "decode_layers": False})]:
        assert plan(**{name: False}) == dataclasses.replace(base, **changed), name


def test_without_a_compiler_everything_is_torch_and_int8_is_refused_with_a_reason():
    p = plan(kernels=NONE)
    assert (p.attention, p.layer_loop, p.small_batch, p.prepack) == (
        "torch_sdpa", "torch", "off", False)
    with pytest.raises(ValueError, match="needs the small-batch kernel"):
        plan(kernels=NONE, quantization="int8")
    with pytest.raises(ValueError, match="no-cpu-small-batch"):
        plan(quantization="int8", cpu_small_batch=False)


def test_what_the_model_or_the_split_cannot_take_falls_back_in_the_plan():
    assert plan(biases=True).layer_loop == "c_ops"  # no bias in the C loop
    assert plan(shape=Shape(head_dim=fused_ops.MAX_HEAD_DIM + 2)).layer_loop == "torch"
    assert not plan(shape=Shape(hidden_size=48)).argmax_screen  # not whole int8 groups
    split = plan(tensor_parallel_size=2)
    assert split.layer_loop == "c_ops" and not split.argmax_screen


def test_bf16_weights_keep_fp32_activations_and_fp16_runs_the_torch_path():
    bf16 = plan(dtype="bfloat16")
    assert (bf16.dtype, bf16.act_dtype, bf16.layer_loop) == (torch.bfloat16, torch.float32,
                                                             "c_loop")
    assert not plan(dtype="bfloat16", kernels=dataclasses.replace(ALL, prepack_bf16=False)
                    ).prepack  # no bf16 instructions: oneDNN would emulate them
    fp16 = plan(dtype="float16")
    assert (fp16.attention, fp16.layer_loop, fp16.small_batch, fp16.prepack) == (
        "torch_sdpa", "torch", "off", False)


def test_ranks_on_one_host_split_its_cores_and_an_explicit_count_wins():
    assert plan(cores=2).threads == 2
    assert plan(cores=2, ranks_on_host=2).threads == 1
    assert plan(cores=2, ranks_on_host=4).threads == 1  # never below one
    assert plan(cores=16, ranks_on_host=3).threads == 5
    assert plan(cores=2, ranks_on_host=2, cpu_threads=3).threads == 3
    # OMP_NUM_THREADS set: the count torch already runs with
    assert plan(cores=64, environ={"OMP_NUM_THREADS": "1"}).threads == torch.get_num_threads()


def test_the_int8_self_draft_plan_is_the_served_plan_through_its_int8_copies_unscreened():
    target = plan()
    draft = build_plan(WorkerConfig(), CPU, Shape(), biases=False, kernels=ALL,
                       draft_of=target, self_draft=True)
    assert draft == dataclasses.replace(
        target, small_batch="int8", small_max_rows=small_linear.INT8_MAX_ROWS,
        logits_max_rows=small_linear.INT8_MAX_ROWS, argmax_screen=False)


def test_the_int8_self_draft_is_refused_without_the_small_batch_kernel():
    target = plan(cpu_small_batch=False)
    with pytest.raises(ValueError, match="int8 self-draft .* --cpu-small-batch"):
        build_plan(WorkerConfig(cpu_small_batch=False), CPU, Shape(), biases=False,
                   kernels=ALL, draft_of=target, self_draft=True)


def test_a_separate_draft_model_is_planned_for_its_shape_on_one_rank_in_the_served_threads():
    target = plan(tensor_parallel_size=2, ranks_on_host=2, cores=4)
    assert target.layer_loop == "c_ops" and target.threads == 2  # split, its share
    draft = build_plan(WorkerConfig(tensor_parallel_size=2), CPU,
                       Shape(head_dim=32, hidden_size=256), biases=False, kernels=ALL,
                       draft_of=target)
    assert draft.layer_loop == "c_loop" and draft.small_batch == "plain"  # rank 0 alone
    assert draft.threads == target.threads and not draft.argmax_screen


def test_the_summary_names_every_choice_and_travels_in_model_info():
    p = plan(quantization="int8", ranks_on_host=2)
    line = p.summary()
    for part in ("device=cpu", "dtype=float32", "attention=c_decode_kernel",
                 "layer_loop=c_loop", "prepack=on", "small_batch=int8:32",
                 "logits_small_rows=32", "argmax_screen=off", "threads=1",
                 "ranks_on_host=2"):
        assert part in line.split(), part
    info = ModelInfo("m", 256, 64, [2], 3, 2, 16, "float32", 10, 16, 2048, compute_plan=line)
    assert model_info_from_proto(model_info_to_proto(info)).compute_plan == line


def test_every_cpu_switch_is_a_worker_flag_also_read_from_its_gapserve_variable(capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(flags.worker_parser(), ["--help"], environ={})
    text = capsys.readouterr().out
    for name in (*flags.CPU_SWITCHES, "threads"):
        assert f"--cpu-{name}" in text, name
    args = flags.parse_args(flags.worker_parser(), ["--no-cpu-attention"],
                            environ={"GAPSERVE_CPU_PREPACK": "off",
                                     "GAPSERVE_CPU_THREADS": "3"})
    cfg = worker_config(args)
    assert (cfg.cpu_prepack, cfg.cpu_attention, cfg.cpu_threads) == (False, False, 3)
    assert cfg.cpu_fused_ops and cfg.cpu_small_batch and cfg.cpu_decode_layers


def test_the_fault_hook_is_bound_once_and_stops_the_process_at_its_step(monkeypatch):
    assert flags.fault_stop_after_steps({}) is None
    assert flags.fault_stop_after_steps({"GAPSERVE_FAULT_STOP_AFTER_STEPS": "2"}) == 2
    assert fault_injection.after_step_hook(None) is fault_injection.after_step_hook(None)
    sent = []
    monkeypatch.setattr(fault_injection.os, "kill", lambda pid, sig: sent.append(sig))
    hook = fault_injection.after_step_hook(2)
    for _ in range(4):
        hook()
    assert sent == [signal.SIGSTOP]  # after the second step, once


def test_the_fail_on_token_hook_raises_only_for_a_step_scheduling_that_token():
    from types import SimpleNamespace as Req
    assert flags.fault_fail_on_token({}) is None
    assert flags.fault_fail_on_token({"GAPSERVE_FAULT_FAIL_ON_TOKEN": "77"}) == 77
    assert fault_injection.before_step_hook(None) is fault_injection.before_step_hook(None)
    check = fault_injection.before_step_hook(77)
    held = Req(req_id="r", token_ids=[1, 77, 3, 4, 5], num_computed_tokens=2)
    check(0, [held], [3])  # 77 was computed in an earlier step: not scheduled here
    with pytest.raises(fault_injection.InjectedFault, match="step 9 schedules token 77 "
                                                             "for request r"):
        check(9, [Req(req_id="r", token_ids=[1, 77, 3], num_computed_tokens=0)], [2])


def test_zero_cost_steps_are_bound_at_start_and_never_reach_the_model(tiny_llama_dir):
    from tests.worker.step_driver import StepDriver
    from worker_svc.runner import ModelRunner
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama_dir), device="cpu",
                                      load_format="dummy", zero_cost_steps=True,
                                      max_model_len=64, num_gpu_blocks_override=16,
                                      max_num_seqs=2))
    assert runner.compute_plan.zero_cost_steps and runner._passes == runner._zero_cost_passes
    runner.model.forward = None  # a step that reached the model would fail here
    driver = StepDriver(runner)
    driver.add("a", [3, 4, 5], max_new=3)
    driver.run_to_completion()
    assert len(driver.requests["a"].output) == 3
