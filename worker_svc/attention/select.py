"""Pick the attention backend for a device: Triton kernels on CUDA when they import,
the torch path everywhere else."""

from __future__ import annotations

import types

import torch


def select_backend(device: torch.device) -> types.ModuleType:
    if device.type == "cuda":
        try:
            from worker_svc.attention import triton_backend
            return triton_backend
        except ImportError:  # no triton in this environment: the torch path still works
            pass
    from worker_svc.attention import torch_backend
    return torch_backend
