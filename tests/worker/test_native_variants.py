"""The C kernels build per ISA level and the worker picks the best one its CPU runs:
an image built on one CPU (baseline + its own level) keeps the C path on another CPU
instead of silently falling back to torch."""

from __future__ import annotations

import ctypes
import logging
import platform

import pytest

from worker_svc import native
from worker_svc.attention import cpu_kernel
from worker_svc.model.cpu import fused_ops

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")

V2 = frozenset({"sse4_2", "sse4_1", "ssse3", "popcnt", "cx16"})
AVX2 = V2 | {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512vl"}


def test_a_cpu_runs_its_level_and_every_lower_one_best_first():
    names = lambda feats: [v.name for v in native.supported_variants(feats)]  # noqa: E731
    assert names(AVX512) == ["avx512", "avx2", "x86-64-v2"]
    assert names(AVX2) == ["avx2", "x86-64-v2"]
    assert names(V2) == ["x86-64-v2"]
    assert names(frozenset({"sse2"})) == []  # older than the baseline: no C kernel


def test_the_image_build_makes_the_baseline_and_each_level_up_to_the_build_cpus(
        tmp_path, monkeypatch):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_cpu_features", lambda: AVX2)  # no AVX-512 build
    built = native.build_for_image("decoder_ops", fused_ops.FLAGS)
    assert [p.name for p in built] == [
        native.library_path("decoder_ops", v, fused_ops.FLAGS).name
        for v in (native.X86_VARIANTS[1], native.X86_VARIANTS[2])]
    for path in built:
        ctypes.PyDLL(str(path))


def test_without_a_compiler_another_cpu_loads_the_best_prebuilt_level(tmp_path, monkeypatch,
                                                                       caplog):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path))
    baseline = native.compile_variant("paged_decode", native.X86_VARIANTS[2], cpu_kernel.FLAGS)
    assert baseline is not None
    # now an AVX-512 CPU in a runtime image: no compiler, only the baseline built
    monkeypatch.setattr(native, "_cpu_features", lambda: AVX512)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.build("paged_decode", cpu_kernel.FLAGS) == baseline
    assert "using the x86-64-v2 build" in caplog.text
    ctypes.CDLL(str(baseline)).paged_decode_f32  # the symbol the worker calls


def test_without_a_compiler_and_without_a_build_it_says_the_torch_path_runs(tmp_path,
                                                                           monkeypatch, caplog):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.build("paged_decode", cpu_kernel.FLAGS) is None
    assert "torch path" in caplog.text


def test_gapserve_cpu_isa_caps_the_level_and_refuses_a_name_it_does_not_know():
    names = lambda env: [v.name for v in native.usable_variants(AVX512, env)]  # noqa: E731
    assert names({}) == ["avx512", "avx2", "x86-64-v2"]
    assert names({"GAPSERVE_CPU_ISA": "avx2"}) == ["avx2", "x86-64-v2"]
    assert names({"GAPSERVE_CPU_ISA": "x86-64-v2"}) == ["x86-64-v2"]
    # a cap above the CPU's level changes nothing: it is a ceiling, not a demand
    assert [v.name for v in native.usable_variants(AVX2, {"GAPSERVE_CPU_ISA": "avx512"})] \
        == ["avx2", "x86-64-v2"]
    with pytest.raises(ValueError, match="GAPSERVE_CPU_ISA='avx3' is not one of avx512, avx2"):
        native.usable_variants(AVX512, {"GAPSERVE_CPU_ISA": "avx3"})


def test_a_capped_build_runs_the_capped_level_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GAPSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GAPSERVE_CPU_ISA", "x86-64-v2")
    monkeypatch.setattr(native, "_cpu_features", lambda: AVX512)
    with caplog.at_level(logging.INFO, logger=native.__name__):
        path = native.build("decoder_ops", fused_ops.FLAGS)
    assert path == native.library_path("decoder_ops", native.X86_VARIANTS[2], fused_ops.FLAGS)
    assert "x86-64-v2 build (GAPSERVE_CPU_ISA caps it)" in caplog.text
