"""Build the worker's C kernels for an image: the baseline ISA and every level up to
the build CPU's, and check each library loads. The Dockerfile runs `python -m worker_svc.build_kernels`;
the runtime image has no compiler, so these are all the variants it will have.
"""

from __future__ import annotations

import ctypes
import sys

from worker_svc import native
from worker_svc.attention import cpu_kernel
from worker_svc.model.cpu import decode_layers, fused_ops, small_linear

# (csrc name, extra flags) of every C kernel the worker loads
KERNELS = (("paged_decode", cpu_kernel.FLAGS), ("decoder_ops", fused_ops.FLAGS),
           ("small_linear", small_linear.FLAGS), ("decode_layers", decode_layers.FLAGS))


def main() -> int:
    for name, flags in KERNELS:
        for path in native.build_for_image(name, flags):
            ctypes.CDLL(str(path))  # a library that does not load fails the build here
            print(f"built {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
