"""The attention backend the compute plan chose (worker_svc/compute_plan.py): Triton
kernels on CUDA when they import, the torch path everywhere else, with the C decode
kernel on fp32 CPU unless the plan turned it off."""

from __future__ import annotations


def select_backend(plan):
    if plan.attention == "triton":
        from worker_svc.attention import triton_backend
        return triton_backend
    from worker_svc.attention import cpu_kernel, torch_backend
    kernel = cpu_kernel.load() if plan.attention == "c_decode_kernel" else None
    return torch_backend.TorchBackend(kernel)
