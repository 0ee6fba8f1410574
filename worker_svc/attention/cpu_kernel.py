"""The C paged-decode kernel for CPU (worker_svc/csrc/paged_decode.c), built once with the
system C compiler into the cache directory and called through ctypes.

Decode attention is memory-bound: the torch path gathers every request's blocks
into a padded copy before SDPA, so each K/V byte crosses memory three times; the
kernel reads each once, in place. Without a compiler `load()` returns None, and the
compute plan (worker_svc/compute_plan.py; --no-cpu-attention turns it off) gives the
torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from worker_svc import native

_I64, _F32P, _I64P = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
# OpenMP: (request, head) items split across torch's own compute threads (the .c says why)
FLAGS = ("-fopenmp",)


@functools.cache
def load() -> ctypes.CDLL | None:
    lib = native.open_library("paged_decode", FLAGS)
    if lib is None:
        return None
    fn = lib.paged_decode_f32
    fn.argtypes = [_F32P, _I64, _I64, _F32P, _I64, _I64, _I64, _I64, _I64P, _I64, _I64P,
                   _I64P, _I64, ctypes.c_float, _F32P, _I64, _I64, _I64, _I64, _F32P, _I64,
                   _I64, ctypes.c_int]
    fn.restype = None
    return lib


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
            and query.stride(2) == 1)


@dataclass(slots=True)
class PagedDecode:
    """One step's decode attention: built once per step with everything that is the
    same in every layer (tables, lengths, scratch), then called once per layer, so a
    layer pays for one ctypes call and nothing else."""

    fn: object
    keep_alive: tuple  # the int64 tables and scratch buffers the pointers point into
    step_args: tuple  # block_size .. scale, in the C signature's order
    tail_args: tuple  # begin .. num_threads

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                 window: int | None = None) -> None:
        """Writes out[q_rows[i]] for each decode i; window: each query sees the keys at
        most window - 1 positions behind it (None: all)."""
        *head, threads = self.tail_args
        self.fn(query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(),
                kv_cache.shape[1], *self.step_args, out.data_ptr(), out.stride(0),
                out.stride(1), *head, window or 0, threads)

    def tables(self) -> tuple[int, ...]:
        """block_table, its row stride, seq_lens, q_rows, scratch, max_seq_len and the
        number of decodes: what a caller running the layers in C (model/decode_layers)
        passes for this step."""
        step, tail = self.step_args, self.tail_args
        return step[3], step[4], step[5], step[6], tail[2], tail[3], tail[1]

    @property
    def scale(self) -> float:
        return self.step_args[8]


def paged_decode_for_step(lib: ctypes.CDLL, num_heads: int, kv_cache_shape: torch.Size,
                          block_table: torch.Tensor, seq_lens: torch.Tensor,
                          q_rows: torch.Tensor, max_seq_len: int,
                          scale: float) -> PagedDecode:
    """block_table [decodes, max_blocks], seq_lens and q_rows [decodes]: int64, CPU."""
    block_table, seq_lens, q_rows = (t.contiguous().long() for t in (block_table, seq_lens,
                                                                     q_rows))
    _, _, block_size, num_kv_heads, head_dim = kv_cache_shape
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * (max_seq_len + head_dim))  # scores, acc per thread
    step_args = (block_size, num_kv_heads, head_dim, block_table.data_ptr(),
                 block_table.stride(0), seq_lens.data_ptr(), q_rows.data_ptr(), num_heads,
                 scale)
    tail_args = (0, q_rows.shape[0], scratch.data_ptr(), max_seq_len, threads)
    return PagedDecode(lib.paged_decode_f32, (block_table, seq_lens, q_rows, scratch),
                       step_args, tail_args)
