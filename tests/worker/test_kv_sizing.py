"""The default KV pool is what max_num_seqs x max_model_len can use, no more; its
pages become resident only as blocks are written; the worker prints vLLM-style
accounting (weights, KV per token, pool, concurrency) at start."""

from __future__ import annotations

import torch

from worker_svc.config import WorkerConfig
from worker_svc.kv_capacity import KvAccounting, lazy_zeros, usable_blocks
from worker_svc.runner import ModelRunner


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_usable_blocks_is_every_sequence_at_full_length_plus_the_reserved_block():
    assert usable_blocks(max_num_seqs=4, max_model_len=128, block_size=16) == 4 * 8 + 1
    # a partial last block is a whole block
    assert usable_blocks(max_num_seqs=2, max_model_len=17, block_size=16) == 2 * 2 + 1


def test_the_cpu_pool_is_capped_by_what_the_limits_can_use(tiny_llama_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama_dir), device="cpu",
                                      max_model_len=64, max_num_seqs=3,
                                      kv_cache_memory=1 << 30))
    assert runner.num_kv_blocks == usable_blocks(3, 64, 16) == 13


def test_the_accounting_counts_tokens_without_the_reserved_block(tiny_llama_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama_dir), device="cpu",
                                      max_model_len=64, max_num_seqs=3))
    acc = runner.kv_accounting
    assert acc.num_tokens == (runner.num_kv_blocks - 1) * 16 == 3 * 64
    assert acc.max_concurrency == 3.0
    # layers x (K and V) x KV heads x head dim x fp32
    assert acc.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4
    assert acc.weight_bytes == runner.weight_bytes > 0


def test_the_accounting_line_names_every_figure():
    acc = KvAccounting(weight_bytes=540 << 20, kv_bytes_per_token=46080, num_blocks=1025,
                       block_size=16, max_model_len=8192)
    line = acc.describe()
    for part in ("540.0 MiB", "45.0 KiB per token", "1025 blocks x 16 = 16384 tokens",
                 "for 8192 tokens per request: 2.00x"):
        assert part in line
    assert acc.fields()["kv_pool_tokens"] == 16384


def test_lazy_zeros_are_zeros_aligned_and_not_resident_until_written():
    before = _rss_bytes()
    t = lazy_zeros((2, 4096, 16, 64), torch.float32)  # 32 MiB
    assert t.shape == (2, 4096, 16, 64) and t.dtype == torch.float32
    assert t.data_ptr() % 4096 == 0 and t.is_contiguous()
    assert _rss_bytes() - before < (32 << 20) // 2  # reserved, not resident
    assert not t[1, 4095].any()  # reads of untouched pages are zero
    t[0, 0].fill_(1.0)
    assert t[0, 0].sum().item() == 16 * 64


def test_lazy_zeros_hold_bfloat16():
    t = lazy_zeros((3, 5), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and not t.any()
