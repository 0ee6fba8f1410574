"""How many KV blocks fit: from a byte budget on CPU, from the memory left after a
profiling forward pass on CUDA; --num-gpu-blocks-override wins over both. On CPU the
pool is never larger than max_num_seqs sequences of max_model_len can use, and its
pages become resident only as blocks are written (lazy_zeros). The accounting
printed at start (KvAccounting) follows vLLM's: weights, KV per token, the pool in
blocks and tokens, and the concurrency it allows at full length."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from worker_svc.model.config import ModelConfig

# 512 MiB = 11.6k tokens of the default model in fp32 (45 KiB a token): 1.4 requests
# at its full 8192 tokens, dozens of chat-sized ones, and the default stack stays
# under 2 GB with the pool full (docs/tuning.md, "Memory"); --kv-cache-memory raises it.
DEFAULT_CPU_KV_BYTES = 512 << 20
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
    """min(512 MiB, a quarter of available memory): a 2 GB stack, polite on a shared host.
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


def usable_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks the scheduler can ever hold at once: every sequence at full
    length, plus block 0 (reserved). A pool beyond this is memory nothing can use."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory, which the kernel maps page by page on
    first write: resident memory follows the blocks in use, not the pool reserved.
    Page-aligned (the C kernels load whole cache lines)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def kv_cache_tensors(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> list[torch.Tensor]:
    """One [2, blocks, block_size, kv_heads, head_dim] cache per layer: on CPU resident
    as blocks are written (lazy_zeros), on a GPU allocated whole."""
    if device.type == "cpu":
        return [lazy_zeros(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


@dataclass(slots=True, frozen=True)
class KvAccounting:
    """What the worker prints at start, as vLLM does: enough to see why a request
    waits (the pool) and what a flag would change (KV per token)."""
    weight_bytes: int
    kv_bytes_per_token: int
    num_blocks: int  # block 0 included (reserved, never handed out)
    block_size: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the pool holds at once."""
        return self.num_tokens / self.max_model_len

    def fields(self) -> dict:
        return {"weight_mib": round(self.weight_bytes / 2**20, 1),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_pool_blocks": self.num_blocks, "kv_pool_tokens": self.num_tokens,
                "kv_pool_mib": round(self.pool_bytes / 2**20, 1),
                "max_concurrency": round(self.max_concurrency, 2)}

    def describe(self) -> str:
        return (f"model weights {self.weight_bytes / 2**20:.1f} MiB; KV cache "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB per token; pool {self.num_blocks} "
                f"blocks x {self.block_size} = {self.num_tokens} tokens "
                f"({self.pool_bytes / 2**20:.0f} MiB); maximum concurrency for "
                f"{self.max_model_len} tokens per request: {self.max_concurrency:.2f}x")


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
