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


# cgroup v2, then v1: (limit, usage) files. A container's /proc/meminfo shows the
# host's memory, not its limit.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def cgroup_available(files: tuple[tuple[str, str], ...] | None = None) -> int | None:
    """Bytes left under this process's cgroup memory limit, or None without one."""
    for limit_path, usage_path in CGROUP_FILES if files is None else files:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None  # v2 "max"; v1 reports no limit as a huge number
        return max(int(limit) - usage, 0)
    return None


def default_cpu_kv_memory() -> int:
    """min(2 GiB, a quarter of available memory): roomy, yet polite on a shared host.
    Available is the lesser of MemAvailable and what the cgroup limit leaves."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = None
    in_cgroup = cgroup_available()
    if in_cgroup is not None:
        available = in_cgroup if available is None else min(available, in_cgroup)
    if available is None:
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
