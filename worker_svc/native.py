"""Build a C source of the worker (worker_svc/csrc) into a shared library once.

The library goes into the cache directory under a name that hashes the source and
the compiler flags, so a changed source or another ISA's flags build anew, and a
library built earlier (e.g. at image build time) loads without a compiler.

Each source builds for an ISA level ("variant"): a baseline every x86-64 CPU of the
last 15 years runs (x86-64-v2), AVX2 + FMA, AVX-512. At run time the best variant
this CPU supports (or, with GAPSERVE_CPU_ISA set, the best up to that level) is used: built if a compiler is there, else the best one already
built (the image ships the baseline and every level up to its build CPU's), so an
image moved to another CPU runs the C kernels at that CPU's best prebuilt level
instead of falling back to torch. `build` returns None only when no usable variant exists or can be
built; callers then keep their torch path, and a warning says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared import config

SOURCE_DIR = Path(__file__).parent / "csrc"
# -O3; no trapping math and no errno: lets loops with float compares and exp vectorize.
COMMON_FLAGS = ("-O3", "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno", "-shared",
                "-fPIC")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]  # /proc/cpuinfo flags a CPU must have to run it


# Best first. AVX-512 is 1.5x AVX2 on the decode kernel here. F16C (every AVX2 CPU
# has it: Haswell, Zen 1 on) converts the GGUF blocks' fp16 scales in one instruction.
X86_VARIANTS = (
    Variant("avx512", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512vl"})),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})),
    Variant("x86-64-v2", ("-march=x86-64-v2",),
            frozenset({"sse4_2", "sse4_1", "ssse3", "popcnt", "cx16"})),
)
GENERIC = Variant("generic", (), frozenset())


def _cpu_features() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def all_variants() -> tuple[Variant, ...]:
    """Every variant this architecture builds, best first; the last is the baseline."""
    if platform.machine() in ("x86_64", "AMD64"):
        return X86_VARIANTS
    return (GENERIC,)


def supported_variants(features: frozenset[str] | None = None) -> list[Variant]:
    """The variants a CPU with these features (default: this one) runs, best first."""
    features = _cpu_features() if features is None else features
    return [v for v in all_variants() if v.needs <= features]


def usable_variants(features: frozenset[str] | None = None,
                    environ: dict[str, str] | None = None) -> list[Variant]:
    """supported_variants, from the level GAPSERVE_CPU_ISA names down when it is set
    (shared/config.py): a CPU with AVX-512 then runs, e.g., the AVX2 code."""
    supported = supported_variants(features)
    cap = config.cpu_isa(environ)
    if cap is None:
        return supported
    names = [v.name for v in all_variants()]
    if cap not in names:
        raise ValueError(f"{config.CPU_ISA_ENV}={cap!r} is not one of {', '.join(names)}")
    allowed = {v.name for v in all_variants()[names.index(cap):]}
    return [v for v in supported if v.name in allowed]


def library_path(name: str, variant: Variant, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where csrc/<name>.c built for `variant` lives: the name hashes the source,
    csrc's headers and the flags."""
    source = SOURCE_DIR / f"{name}.c"
    flags = [*COMMON_FLAGS, *variant.flags, *extra_flags]
    hashed = source.read_bytes() + b"".join(h.read_bytes()
                                            for h in sorted(SOURCE_DIR.glob("*.h")))
    digest = hashlib.sha256(hashed + " ".join(flags).encode()).hexdigest()[:16]
    from shared.model_files.default_model import cache_dir
    return cache_dir() / "kernels" / f"{source.stem}-{digest}.so"


def compile_variant(name: str, variant: Variant,
                    extra_flags: tuple[str, ...] = ()) -> Path | None:
    """csrc/<name>.c built for `variant` (compiled now if not there yet), or None
    without a compiler or when the compiler fails."""
    target = library_path(name, variant, extra_flags)
    if target.is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = SOURCE_DIR / f"{name}.c"
    flags = [*COMMON_FLAGS, *variant.flags, *extra_flags]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"],
                           check=True, capture_output=True)
            os.replace(built, target)  # atomic: a concurrent builder loses nothing
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("building %s for %s failed: %s", name, variant.name, exc)
        return None
    return target


def build(name: str, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The library of csrc/<name>.c for the best variant this CPU runs: that one
    (built if needed and a compiler is there), else the best one already built."""
    supported = usable_variants()
    if not supported:
        log.warning("C kernel %s: this CPU lacks even the baseline ISA; torch path", name)
        return None
    best = compile_variant(name, supported[0], extra_flags)
    if best is not None:
        capped = config.cpu_isa() is not None and supported[0] != supported_variants()[0]
        log.log(logging.WARNING if capped else logging.INFO, "C kernel %s: %s build%s", name,
                supported[0].name, f" ({config.CPU_ISA_ENV} caps it)" if capped else "")
        return best
    for variant in supported[1:]:
        path = library_path(name, variant, extra_flags)
        if path.is_file():
            log.warning("C kernel %s: no %s build and no compiler; using the %s build",
                        name, supported[0].name, variant.name)
            return path
    log.warning("C kernel %s: no build for this CPU and no compiler; torch path", name)
    return None


def open_library(name: str, extra_flags: tuple[str, ...] = (),
                 loader: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL | None:
    """csrc/<name>.c built as `build` does and loaded (loader: ctypes.CDLL, or PyDLL for
    calls that keep the GIL), or None when there is no build or it does not load."""
    path = build(name, extra_flags)
    if path is None:
        return None
    try:
        return loader(str(path))
    except OSError:
        return None


def build_for_image(name: str, extra_flags: tuple[str, ...] = ()) -> list[Path]:
    """Build, as an image ships them, the baseline variant and every level this (build)
    CPU runs: another CPU then finds its own best level if it is at most the build
    CPU's. Raises if one cannot be built: an image without its kernels would be slow."""
    wanted = [*supported_variants(), all_variants()[-1]]
    built = []
    for variant in dict.fromkeys(wanted):
        path = compile_variant(name, variant, extra_flags)
        if path is None:
            raise RuntimeError(f"could not build C kernel {name} for {variant.name}")
        built.append(path)
    return built
