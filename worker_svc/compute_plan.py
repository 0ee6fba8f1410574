"""The worker's compute plan: every choice of how a step is computed, made once at start.

Which attention kernel, which of the three layer loops (torch ops; a Python loop over
the C ops; every layer in one C call), which weight copies and up to how many rows the
small-batch kernel takes, whether greedy rows screen the vocabulary projection, how
many threads: `build_plan` decides them all from the flags (the --cpu-* switches in
shared/config.py), the device, dtype and quantization, the model's shape, the C
kernels this machine could build and the tensor-parallel ranks on this host. The
model, the attention backend and the runner then only read the plan; no step asks
the environment or a kernel's availability again. Which family serves the model
(worker_svc/model/registry.py) decides the layers: only the llama family's fast path
takes the C element-wise ops, layer loop and small-batch matmul ("layers=c"); every
other family runs its torch layers ("layers=torch"), sharing the attention backend,
and an option only the C path serves (--quantization int8) is refused for it by
name. A draft model (speculative decoding) asks `build_plan` for its own plan with
`draft_of`, and every model's weights are made ready for its plan by
`prepare_weights`, once. The worker logs it in one
`compute_plan` line and reports `summary()` in ModelInfo (GetModelInfo, /v1/status).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from shared.telemetry import get_logger
from worker_svc import cpu_threads
from worker_svc.config import WorkerConfig

log = get_logger(service="worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Kernels:
    """Which C kernels this machine has (built, or buildable with its compiler), and
    whether oneDNN can prepack a weight of each CPU dtype."""
    attention: bool
    fused_ops: bool
    small_batch: bool
    decode_layers: bool
    prepack_fp32: bool
    prepack_bf16: bool
    quant: bool = False  # csrc/quant_linear.c: GGUF blocks dequantized in the matmul


def probe_kernels() -> Kernels:
    from worker_svc.attention import cpu_kernel
    from worker_svc.model.cpu import (cpu_dtype, decode_layers, fused_ops, quant_weights,
                                      small_linear)
    return Kernels(attention=cpu_kernel.load() is not None,
                   fused_ops=fused_ops.load() is not None,
                   small_batch=small_linear.load() is not None,
                   decode_layers=decode_layers.load() is not None,
                   prepack_fp32=cpu_dtype.prepack_available(torch.float32),
                   prepack_bf16=cpu_dtype.prepack_available(torch.bfloat16),
                   quant=quant_weights.load() is not None)


@dataclass(frozen=True, slots=True)
class ComputePlan:
    device: torch.device
    dtype: torch.dtype  # the matmul weights' (what ModelInfo.dtype reports)
    act_dtype: torch.dtype  # activations and KV cache: fp32 under bf16 CPU weights
    attention: str  # "triton", "c_decode_kernel" or "torch_sdpa"
    prepack: bool  # matmul weights in oneDNN's packed layout (model/cpu/cpu_dtype.py)
    fused_ops: bool  # a layer's element-wise ops in C (model/cpu/fused_ops.py)
    decode_layers: bool  # small decode steps: every layer in one C call
    small_batch: str  # "off", "plain", "int8" or "quant" (a GGUF's blocks: weights below)
    small_max_rows: int  # steps of at most this many tokens run that kernel (0: none)
    logits_max_rows: int  # vocabulary projections of at most this many rows too
    argmax_screen: bool  # greedy rows of small steps screened in int8 (small_linear)
    threads: int  # torch (and the C kernels') threads of this rank
    cpu_quota: float | None  # CPUs of this process's cgroup quota; None: no quota
    wait_policy: str  # how idle OpenMP threads wait, as set before torch loaded
    ranks_on_host: int  # tensor-parallel ranks sharing this host's cores
    zero_cost_steps: bool  # test/benchmark only: steps skip the model (zero_cost.py)
    fault_stop_after_steps: int | None  # test/drill only: SIGSTOP after N steps
    fault_fail_on_token: int | None = None  # test/drill only: a step with this token raises
    family: str = "llama"  # the model's family module (model/registry.py)
    c_layers: bool = True  # its layers may take the C kernels (only the llama family)
    # some layers attend within a sliding window shorter than max_model_len: those take
    # the backends' windowed path, never the C decode kernel or the llama C layer loop
    # (Gemma 3's quantized C loop gives the decode kernel each layer's window)
    windowed: bool = False
    # "float": matmul weights as floats (a GGUF dequantized at load: the exact path);
    # "gguf_quantized": a GGUF's blocks held as they are and dequantized inside the
    # matmul (model/cpu/quant_weights.py), every step; weight_types names their types
    weights: str = "float"
    weight_types: str = ""
    # the quantized path's activations: "float32" exact, "int8" quantized per 32 values
    # against the weights repacked at load (model/cpu/quant_weights.pack)
    quant_activations: str = "float32"

    @property
    def layer_loop(self) -> str:
        """Which of the three layer loops a small decode step runs (wider steps run
        c_ops whenever fused_ops is on; docs/worker.md says why all three stay)."""
        return "c_loop" if self.decode_layers else "c_ops" if self.fused_ops else "torch"

    def summary(self) -> str:
        """One compact line for ModelInfo.compute_plan and /v1/status."""
        on = {True: "on", False: "off"}
        dtype = _name(self.dtype) if self.dtype == self.act_dtype else \
            f"{_name(self.dtype)}/{_name(self.act_dtype)}"
        parts = [f"device={self.device}", f"family={self.family}",
                 f"layers={'c' if self.c_layers else 'torch'}", f"dtype={dtype}",
                 f"attention={self.attention}", f"layer_loop={self.layer_loop}",
                 f"prepack={on[self.prepack]}",
                 f"small_batch={self.small_batch}:{self.small_max_rows}",
                 f"logits_small_rows={self.logits_max_rows}",
                 f"argmax_screen={on[self.argmax_screen]}", f"threads={self.threads}",
                 f"ranks_on_host={self.ranks_on_host}"]
        if self.cpu_quota is not None:
            parts.append(f"cpu_quota={self.cpu_quota:g}")
        if self.windowed:
            parts.append("sliding_window=on")
        if self.weights != "float":
            parts.append(f"weights={self.weights}:{self.weight_types}")
        if self.quant_activations != "float32":
            parts.append(f"quant_activations={self.quant_activations}")
        if self.zero_cost_steps:
            parts.append("zero_cost_steps=on")
        if self.fault_stop_after_steps is not None:
            parts.append(f"fault_stop_after_steps={self.fault_stop_after_steps}")
        if self.fault_fail_on_token is not None:
            parts.append(f"fault_fail_on_token={self.fault_fail_on_token}")
        return " ".join(parts)

    def log_fields(self) -> dict[str, object]:
        return {"device": str(self.device), "family": self.family,
                "layers": "c" if self.c_layers else "torch", "dtype": _name(self.dtype),
                "act_dtype": _name(self.act_dtype), "attention": self.attention,
                "layer_loop": self.layer_loop, "prepack": self.prepack,
                "fused_ops": self.fused_ops, "small_batch": self.small_batch,
                "small_max_rows": self.small_max_rows,
                "logits_max_rows": self.logits_max_rows, "argmax_screen": self.argmax_screen,
                "threads": self.threads, "ranks_on_host": self.ranks_on_host,
                "cpu_quota": self.cpu_quota, "wait_policy": self.wait_policy,
                "sliding_window": self.windowed, "weights": self.weights,
                "weight_types": self.weight_types,
                "quant_activations": self.quant_activations,
                "zero_cost_steps": self.zero_cost_steps,
                "fault_stop_after_steps": self.fault_stop_after_steps,
                "fault_fail_on_token": self.fault_fail_on_token}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def has_biases(model_cfg) -> bool:
    """Whether the model's matmuls carry biases (Qwen2's q/k/v), which the C layer
    loop has no place for; the rule weights and dummy_weights follow."""
    hf = model_cfg.hf_config
    return bool(model_cfg.qkv_bias or getattr(hf, "attention_bias", False)
                or getattr(hf, "mlp_bias", False))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def build_plan(config: WorkerConfig, device: torch.device, model_cfg, *, biases: bool,
               windowed: bool = False, ranks_on_host: int = 1, kernels: Kernels | None = None,
               usable_cores: int | None = None, quota_cpus: float | None = None,
               environ=None, fault_stop_after_steps: int | None = None,
               fault_fail_on_token: int | None = None, draft_of: ComputePlan | None = None,
               self_draft: bool = False, gguf_types: dict[str, int] | None = None
               ) -> ComputePlan:
    """The plan for this worker. model_cfg: the model as this rank holds it (head_dim,
    hidden_size); biases: whether any matmul has a bias (Qwen2's q/k/v); windowed:
    whether a sliding window applies (model.config.layer_windows). kernels,
    usable_cores (with quota_cpus, its cgroup's CPU quota) and environ default to this
    machine's; tests pass their own. draft_of: the served model's plan, when this is
    its draft model's (self_draft: the int8 self-draft's; else a separate checkpoint's).
    gguf_types: a GGUF's matmul tensor types and their bytes (gguf_tensors.matmul_types),
    None for a safetensors checkpoint: quantized ones take the quantized path
    (_quantized_path) unless --dtype names a float type."""
    from worker_svc.model.cpu import fused_ops, small_linear
    from worker_svc.model.registry import FAMILIES
    if draft_of is not None:
        return _draft_plan(config, device, model_cfg, biases, draft_of, self_draft, kernels,
                           windowed)
    dtype = resolve_dtype(config.dtype, device)
    cpu = device.type == "cpu"
    family = getattr(model_cfg, "family", "llama")
    c_layers = FAMILIES[family].c_kernels
    if config.quantization == "int8" and not cpu:
        raise ValueError("--quantization int8 is the CPU small-batch kernel's weight "
                         f"format; this worker runs on {device.type}")
    if config.quantization == "int8" and not c_layers:
        raise ValueError(f"--quantization int8 runs on the C layers of the llama family "
                         f"only; model family {family!r} runs torch layers")
    # bf16 on CPU: bf16 matmul weights, fp32 activations and KV cache (cpu_dtype)
    act_dtype = torch.float32 if cpu and dtype == torch.bfloat16 else dtype
    c_path = cpu and act_dtype == torch.float32  # the C kernels are fp32 CPU kernels
    # the C attention kernel is shared by every family; the C layer kernels are not
    c_layer_path = c_path and c_layers
    if cpu and kernels is None:
        kernels = probe_kernels()
    attention = "triton" if device.type == "cuda" and _triton_imports(device) else "torch_sdpa"
    if c_path and config.cpu_attention and kernels.attention:
        attention = "c_decode_kernel"
    prepack = cpu and c_layers and config.cpu_prepack and (
        kernels.prepack_fp32 if dtype == torch.float32
        else kernels.prepack_bf16 if dtype == torch.bfloat16 else False)
    fused = c_layer_path and config.cpu_fused_ops and kernels.fused_ops \
        and model_cfg.head_dim <= fused_ops.MAX_HEAD_DIM
    small = "off"
    if c_layer_path and config.cpu_small_batch and kernels.small_batch:
        small = "int8" if config.quantization == "int8" else "plain"
    if config.quantization == "int8" and small == "off":  # asked for, nothing would run it
        raise ValueError("--quantization int8 needs the small-batch kernel: a C compiler, "
                         "and not --no-cpu-small-batch (GAPSERVE_CPU_SMALL_BATCH=off)")
    small_rows = {"off": 0, "plain": small_linear.MAX_ROWS,
                  "int8": small_linear.INT8_MAX_ROWS}[small]
    tp = config.tensor_parallel_size > 1
    decode_layers = (fused and small != "off" and attention == "c_decode_kernel"
                     and config.cpu_decode_layers and kernels.decode_layers
                     and not tp and not biases and not windowed)
    if usable_cores is None:  # this machine's: its affinity and its cgroup's quota
        usable_cores, quota_cpus = cpu_threads.usable_cores(), cpu_threads.cpu_quota()
    # int8 projects in int8 already; the screen's copy needs whole int8 groups
    screen = (small == "plain" and not tp and config.cpu_argmax_screen
              and model_cfg.hidden_size % small_linear.GROUP == 0)
    weights, weight_types = "float", ""
    if _quantized_path(config, cpu, kernels, gguf_types):
        # every step on the blocks: no float copy to prepack, screen or hand to oneDNN
        weights = "gguf_quantized"
        weight_types = "+".join(sorted(gguf_types, key=lambda k: -gguf_types[k]))
        small, small_rows, prepack, screen = "quant", QUANT_MAX_ROWS, False, False
        # the llama family's C loop, or a torch family's own one over the blocks
        # (registry.Family.quant_c_loop: Gemma 3), which takes sliding windows
        own_loop = (c_path and kernels.fused_ops
                    and model_cfg.head_dim <= fused_ops.MAX_HEAD_DIM
                    and getattr(model_cfg, "model_type", None) in FAMILIES[family].quant_c_loop)
        decode_layers = (attention == "c_decode_kernel" and config.cpu_decode_layers
                         and kernels.decode_layers and not tp and not biases
                         and ((fused and not windowed) or own_loop))
    elif config.quant_activations != "float32":  # asked for, nothing would run it
        raise ValueError(f"--quant-activations {config.quant_activations} applies to a GGUF "
                         "served on its quantized path; this worker serves float weights "
                         "(a float checkpoint, a float --dtype, or the quantized path is "
                         "off: see the gguf_quantized_path_off warning)")
    return ComputePlan(
        device=device, dtype=dtype, act_dtype=act_dtype, attention=attention,
        prepack=bool(prepack), fused_ops=bool(fused), decode_layers=bool(decode_layers),
        small_batch=small, small_max_rows=small_rows,
        # the vocabulary projection follows the matmuls' gate: with int8, a step of
        # 9-32 sampling rows reads the int8 copy too, as --quantization's help says
        logits_max_rows=small_rows, argmax_screen=screen,
        threads=_threads(config.cpu_threads, ranks_on_host, usable_cores, quota_cpus, environ),
        cpu_quota=quota_cpus, wait_policy=cpu_threads.applied_wait_policy,
        ranks_on_host=ranks_on_host, zero_cost_steps=config.zero_cost_steps,
        fault_stop_after_steps=fault_stop_after_steps, fault_fail_on_token=fault_fail_on_token,
        family=family, c_layers=c_layers, windowed=windowed, weights=weights,
        weight_types=weight_types,
        quant_activations=config.quant_activations if weights == "gguf_quantized"
        else "float32")


# Steps of any width run the quantized kernel: each weight row is read and widened
# once a call and dotted with every token row from cache (csrc/quant_linear.c), so a
# wide step costs the multiply-adds, not a dequantized copy; no float copy is held
# for oneDNN (benchmarks/quant_matmul.py measures where that stands; docs/kernels.md).
QUANT_MAX_ROWS = 1 << 30


def _quantized_path(config: WorkerConfig, cpu: bool, kernels: Kernels | None,
                    gguf_types: dict[str, int] | None) -> bool:
    """Whether a GGUF's quantized blocks are served as they are. The default for a
    file with quantized matmul tensors; --dtype float32 (or any float --dtype) keeps
    the exact dequantized path. Every family with GGUF input takes it (the llama
    family's C layers and the torch layers alike call the kernel). Where the kernel
    cannot serve it (a GPU, tensor parallelism, no compiler), the exact path serves,
    and a warning says why."""
    from worker_svc.model.cpu.quant_weights import FLOAT_TYPES
    if not gguf_types or not set(gguf_types) - FLOAT_TYPES or config.dtype != "auto":
        return False
    why = None
    if not cpu:
        why = "the quantized kernel is a CPU kernel"
    elif config.tensor_parallel_size > 1:
        why = "tensor parallelism splits float weights"
    elif config.quantization is not None:
        why = f"--quantization {config.quantization} asks for its own copies"
    elif config.speculative_config:
        why = "speculative decoding's draft reads float weights"
    elif not kernels.quant:
        why = "the quantized kernel is not built (no C compiler)"
    if why is not None:
        log.warning("gguf_quantized_path_off", reason=why,
                    path="exact: dequantized to float32 on load")
        return False
    return True


def _draft_plan(config: WorkerConfig, device: torch.device, model_cfg, biases: bool,
                target: ComputePlan, self_draft: bool, kernels: Kernels | None,
                windowed: bool) -> ComputePlan:
    """A draft model runs in the served model's threads, between its passes, and never
    screens (its weights get no screen copy). The int8 self-draft is the served model
    through the small-batch kernel's int8 copies, at their row limits; a separate
    checkpoint is planned as a model of its own shape on one rank (rank 0 drafts alone)."""
    from worker_svc.model.cpu import small_linear
    if self_draft:
        if device.type != "cpu" or target.small_batch == "off":
            raise ValueError(
                "the int8 self-draft runs on the CPU small-batch kernel's int8 weights: "
                "it needs a CPU worker with a C compiler and --cpu-small-batch")
        return dataclasses.replace(
            target, small_batch="int8", small_max_rows=small_linear.INT8_MAX_ROWS,
            logits_max_rows=small_linear.INT8_MAX_ROWS, argmax_screen=False)
    plan = build_plan(dataclasses.replace(config, tensor_parallel_size=1), device, model_cfg,
                      biases=biases, kernels=kernels, windowed=windowed)
    return dataclasses.replace(plan, threads=target.threads, argmax_screen=False)


def prepare_weights(weights, plan: ComputePlan):
    """The loaded weights as `plan` computes with them: on the CPU the matmul weights
    in its dtype (prepacked if it says so) with the small-batch kernel's copies, and
    the argmax screen's int8 copy when it screens; on a GPU as loaded."""
    from worker_svc.model.cpu.cpu_dtype import prepare_matmul_weights
    if plan.device.type != "cpu" or plan.weights == "gguf_quantized":
        return weights  # (the quantized path's blocks are used as loaded)
    small = None if plan.small_batch == "off" else plan.small_batch
    weights = prepare_matmul_weights(weights, plan.dtype, plan.prepack, small=small)
    if plan.argmax_screen:
        weights.argmax_screen = _argmax_screen(weights)
    return weights


def _argmax_screen(weights):
    """The int8 copy that screens greedy rows: of the vocabulary projection the
    small-batch kernel reads, where its width divides into int8's groups."""
    from worker_svc.model.cpu import small_linear
    head = weights.lm_head if weights.plain_lm_head is None else weights.plain_lm_head
    if head.shape[1] % small_linear.GROUP:
        return None
    return small_linear.quantize_int8(head.float())


def _threads(requested: int, ranks_on_host: int, usable_cores: int,
             quota_cpus: float | None, environ) -> int:
    """--cpu-threads if given; else OMP_NUM_THREADS (which torch already follows) if
    set; else this host's usable cores, capped by the cgroup's CPU quota, split among
    its ranks (cpu_threads.thread_count): two ranks of 2 threads on 2 cores made a
    200-token stream take 102 s against 6 s with one rank."""
    if requested:
        return requested
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    return cpu_threads.thread_count(usable_cores, quota_cpus, ranks_on_host)


def _triton_imports(device: torch.device) -> bool:
    try:
        from worker_svc.attention import triton_backend  # noqa: F401
    except ImportError as exc:  # no triton here: the torch path still works, slower
        log.warning("triton_unavailable", device=str(device), error=str(exc),
                    hint="install gapserve[cuda] for the Triton attention kernels")
        return False
    return True
