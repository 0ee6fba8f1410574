"""Triton kernels that read and write the paged KV cache in place (GPU workers).

- kv_write: new keys/values into their slots (slot -1 = padding, skipped).
- decode: one query token per request, GQA, online softmax; split-K variant.
- prefill: several query tokens per request, causal over cached context + new tokens.

Layout and interface: see worker_svc/attention/__init__.py. Tiling choices and the
differences between the Triton interpreter (our CPU tests) and a GPU: docs/kernels.md.
"""
