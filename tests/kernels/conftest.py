"""Run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated (module import) and again by
the interpreter at launch, so it is set here, before the kernel modules load
(reloaded if another test imported them compiled), and left set."""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
for _name in ["worker_svc.kernels.common", "worker_svc.kernels.kv_write",
              "worker_svc.kernels.decode", "worker_svc.kernels.prefill",
              "worker_svc.attention.triton_backend"]:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
    else:
        importlib.import_module(_name)
