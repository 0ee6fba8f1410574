"""benchmarks/async_overlap.py end to end on the tiny model: a real worker process,
both modes, and the --json shape the issue asks for."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "benchmarks" / "async_overlap.py"
_spec = importlib.util.spec_from_file_location("async_overlap", _path)
async_overlap = importlib.util.module_from_spec(_spec)
sys.modules["async_overlap"] = async_overlap  # dataclasses look their module up there
_spec.loader.exec_module(async_overlap)

KEYS = {"tokens_per_s", "mean_itl_ms", "worker_idle_ms_mean", "worker_idle_ms_p99",
        "worker_idle_share"}


def test_async_overlap_json_reports_both_modes_from_worker_timings(tiny_model_dir, capsys):
    async_overlap.main(["--model", str(tiny_model_dir), "--num-requests", "4",
                        "--max-tokens", "6", "--prompt-len", "8", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"async", "sync"}
    for mode, r in report.items():
        assert KEYS <= set(r), mode
        assert r["num_output_tokens"] == 4 * 6, mode
        assert r["num_steps"] == 6, mode  # one prompt step, then one step per token
        assert r["tokens_per_s"] > 0 and r["mean_itl_ms"] > 0, mode
        assert 0.0 <= r["worker_idle_share"] < 1.0, mode
        assert r["worker_idle_ms_mean"] >= 0.0 and r["worker_idle_ms_p99"] >= 0.0, mode
