"""How many KV blocks fit: from a byte budget on CPU, from the memory left after a
profiling forward pass on CUDA; --num-gpu-blocks-override wins over both."""

from __future__ import annotations

import torch

from worker_svc.model.config import ModelConfig

DEFAULT_CPU_KV_BYTES = 2 << 30
DEFAULT_CPU_KV_SHARE = 0.25  # of the memory available at start-up, for shared machines


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * element


def default_cpu_kv_memory() -> int:
    """min(2 GiB, a quarter of available memory): roomy, yet polite on a shared host."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return DEFAULT_CPU_KV_BYTES
    return min(DEFAULT_CPU_KV_BYTES, int(available * DEFAULT_CPU_KV_SHARE))


def cpu_num_blocks(kv_cache_memory: int | None, per_block: int) -> int:
    budget = kv_cache_memory if kv_cache_memory is not None else default_cpu_kv_memory()
    return budget // per_block


def cuda_num_blocks(device: torch.device, gpu_memory_utilization: float,
                    per_block: int) -> int:
    """Call right after the profiling pass: the budget is utilization x total memory,
    less this process's peak torch usage and what others (CUDA context, other
    processes) hold outside torch's allocator."""
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - peak - max(outside_torch, 0)
    return max(budget, 0) // per_block
