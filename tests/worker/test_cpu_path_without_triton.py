"""The CPU worker never needs triton (the CPU image leaves it out): with triton
unimportable, the worker's modules import and a CPU plan gets the torch backend."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import worker_svc.server, worker_svc.runner
from worker_svc.attention.select import select_backend
from worker_svc.attention import torch_backend
from worker_svc.compute_plan import build_plan
from worker_svc.config import WorkerConfig
class Shape:
    head_dim, hidden_size = 64, 64
plan = build_plan(WorkerConfig(), torch.device("cpu"), Shape(), biases=False)
assert plan.attention in ("c_decode_kernel", "torch_sdpa")
assert isinstance(select_backend(plan), torch_backend.TorchBackend)
assert not any(m == "triton" or m.startswith(("triton.", "worker_svc.kernels"))
               for m in sys.modules if sys.modules[m] is not None)
print("ok")
"""


def test_the_cpu_worker_imports_and_selects_its_backend_without_triton():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
