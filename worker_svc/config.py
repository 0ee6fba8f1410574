"""Worker start-up configuration; flag names follow the reference system (vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class WorkerConfig:
    model: str | Path | None = None  # local checkpoint directory; None = the default model
    served_model_name: str | None = None  # reported in ModelInfo; default: the dir's name
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    # "int8": the CPU small-batch kernel reads int8 weights (model/cpu/small_linear.py)
    quantization: str | None = None
    # a GGUF's quantized path: "int8" quantizes the matmuls' activations (csrc/quant_packed.h)
    quant_activations: str = "float32"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None  # wins over both memory budgets
    kv_cache_memory: int | None = None  # bytes of KV cache on CPU; None = sized for the machine
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # None: 8192 on GPUs of >= 70 GiB, else 2048
    max_num_seqs: int = 256
    seed: int = 0  # seeds the sampling of requests that bring no seed of their own
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    # tensor-parallel rendezvous: rank 0 hosts a TCPStore here (see worker_svc.parallel)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_timeout: float = 60.0  # seconds a collective or a peer's heartbeat may stall
    distributed_backend: str = "auto"  # auto = nccl on cuda, gloo on cpu
    # benchmarks of the stack itself: random weights of the real shapes (vLLM's
    # --load-format dummy), and steps that skip the forward pass (zero_cost.py)
    load_format: str = "auto"
    zero_cost_steps: bool = False
    # CPU compute switches (--cpu-*; worker_svc/compute_plan.py), all on by default
    cpu_prepack: bool = True
    cpu_fused_ops: bool = True
    cpu_decode_layers: bool = True
    cpu_small_batch: bool = True
    cpu_argmax_screen: bool = True
    cpu_attention: bool = True
    cpu_threads: int = 0  # 0 = $OMP_NUM_THREADS if set, else cores // ranks on this host
    # --speculative-config (shared/speculative_config.py); the scheduler adopts it from
    # the handshake's ModelInfo (docs/spec_decode.md). None: no speculation.
    speculative_config: SpeculativeConfig | None = None
    # rank 0's bound on compiling a grammar (--structured-outputs-compile-timeout-s)
    structured_outputs_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # test/drill only: SIGSTOP after N steps (GAPSERVE_FAULT_STOP_AFTER_STEPS)
    fault_stop_after_steps: int | None = None
    # test/drill only: a step holding this token id raises (GAPSERVE_FAULT_FAIL_ON_TOKEN)
    fault_fail_on_token: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is reserved)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1 or (self.max_num_batched_tokens is not None
                                     and self.max_num_batched_tokens < 1):
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or unset, got {self.quantization}")
        if self.quant_activations not in ("float32", "int8"):
            raise ValueError(f"quant_activations must be float32 or int8, got "
                             f"{self.quant_activations}")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(f"rank {self.tensor_parallel_rank} must be in [0, "
                             f"tensor_parallel_size {self.tensor_parallel_size})")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got "
                             f"{self.distributed_timeout}")
        if self.distributed_backend not in ("auto", "gloo", "nccl"):
            raise ValueError("distributed_backend must be auto, gloo or nccl, got "
                             f"{self.distributed_backend}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError("load_format must be auto, safetensors or dummy, "
                             f"got {self.load_format}")
        if self.load_format == "dummy" and self.tensor_parallel_size > 1:
            raise ValueError("load_format dummy builds the whole model; it is not split "
                             "across tensor-parallel ranks: use tensor_parallel_size 1")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be 0 (auto) or more, got {self.cpu_threads}")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError("speculative_config must be a SpeculativeConfig "
                             f"(shared/speculative_config.py), got {type(spec).__name__}")
        if spec is not None and self.zero_cost_steps:
            raise ValueError("zero_cost_steps makes up tokens: nothing to verify drafts "
                             "against; run it without --speculative-config")
        if self.zero_cost_steps and self.load_format != "dummy":
            raise ValueError("zero_cost_steps answers with made-up tokens: it needs "
                             "load_format dummy, so no real deployment turns it on by mistake")
