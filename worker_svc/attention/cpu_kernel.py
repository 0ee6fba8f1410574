"""The C paged-decode kernel for CPU (worker_svc/csrc/paged_decode.c), built once with the
system C compiler into the cache directory and called through ctypes.

Decode attention is memory-bound: the torch path gathers every request's blocks
into a padded copy before SDPA, so each K/V byte crosses memory three times; the
kernel reads each once, in place. Without a compiler (or with
GAPSERVE_CPU_ATTENTION=torch) `active()` returns None and the torch path is used.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker_svc import native

_I64, _F32P, _I64P = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
# below this many decodes a second thread costs more than it saves
MIN_REQUESTS_TO_SPLIT = 8


def active() -> ctypes.CDLL | None:
    """The kernel library, unless GAPSERVE_CPU_ATTENTION=torch asks for the torch path."""
    if os.environ.get("GAPSERVE_CPU_ATTENTION", "") == "torch":
        return None
    return load()


@functools.cache
def load() -> ctypes.CDLL | None:
    path = native.build("paged_decode")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    fn = lib.paged_decode_f32
    fn.argtypes = [_F32P, _I64, _I64, _F32P, _I64, _I64, _I64, _I64, _I64P, _I64, _I64P,
                   _I64P, _I64, ctypes.c_float, _F32P, _I64, _I64, _I64, _I64, _F32P, _F32P]
    fn.restype = None
    return lib


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
            and query.stride(2) == 1)


@functools.cache
def _helper() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-decode")


@dataclass(slots=True)
class PagedDecode:
    """One step's decode attention: built once per step with everything that is the
    same in every layer (tables, lengths, scratch), then called once per layer, so a
    layer pays for one ctypes call and nothing else."""

    fn: object
    keep_alive: tuple  # the int64 tables and scratch buffers the pointers point into
    step_args: tuple  # block_size .. scale, in the C signature's order
    ranges: list  # (begin, end, scores_ptr, acc_ptr) per thread

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Writes out[q_rows[i]] for each decode i."""
        head = (query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(),
                kv_cache.shape[1])
        tail = (out.data_ptr(), out.stride(0), out.stride(1))
        if len(self.ranges) == 1:
            self.fn(*head, *self.step_args, *tail, *self.ranges[0])
            return
        # a helper thread takes the second half; ctypes releases the GIL during the call
        other = _helper().submit(self.fn, *head, *self.step_args, *tail, *self.ranges[1])
        self.fn(*head, *self.step_args, *tail, *self.ranges[0])
        other.result()


def paged_decode_for_step(lib: ctypes.CDLL, num_heads: int, kv_cache_shape: torch.Size,
                          block_table: torch.Tensor, seq_lens: torch.Tensor,
                          q_rows: torch.Tensor, max_seq_len: int,
                          scale: float) -> PagedDecode:
    """block_table [decodes, max_blocks], seq_lens and q_rows [decodes]: int64, CPU."""
    block_table, seq_lens, q_rows = (t.contiguous().long() for t in (block_table, seq_lens,
                                                                     q_rows))
    _, _, block_size, num_kv_heads, head_dim = kv_cache_shape
    num_reqs = q_rows.shape[0]
    split = num_reqs >= MIN_REQUESTS_TO_SPLIT and torch.get_num_threads() >= 2
    bounds = [(0, num_reqs // 2), (num_reqs // 2, num_reqs)] if split else [(0, num_reqs)]
    scratch, ranges = [], []
    for begin, end in bounds:
        scores, acc = torch.empty(num_heads * max_seq_len), torch.empty(num_heads * head_dim)
        scratch += [scores, acc]
        ranges.append((begin, end, scores.data_ptr(), acc.data_ptr()))
    step_args = (block_size, num_kv_heads, head_dim, block_table.data_ptr(),
                 block_table.stride(0), seq_lens.data_ptr(), q_rows.data_ptr(), num_heads,
                 scale)
    return PagedDecode(lib.paged_decode_f32, (block_table, seq_lens, q_rows, *scratch),
                       step_args, ranges)
