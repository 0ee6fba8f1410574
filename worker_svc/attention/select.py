"""Pick the attention backend for a device: Triton kernels on CUDA when they import,
the torch path everywhere else."""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)


def select_backend(device: torch.device) -> types.ModuleType:
    if device.type == "cuda":
        try:
            from worker_svc.attention import triton_backend
            return triton_backend
        except ImportError as exc:  # no triton here: the torch path still works, slower
            log.warning("Triton attention kernels unavailable on %s (%s); using the torch "
                        "path. Install gapserve[cuda] for them.", device, exc)
    from worker_svc.attention import torch_backend
    return torch_backend
