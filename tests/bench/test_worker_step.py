"""benchmarks/worker_step.py --tensor-parallel-size 2: the same points on one rank,
then on two (this process and a helper rank over gloo), and the table of the two."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.integration.tiny_model import tiny_llama_dir

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_against_tp1_prints_the_comparison_on_the_tiny_model(tmp_path):
    out = tmp_path / "steps.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "worker_step.py"),
         "--model", str(tiny_llama_dir()), "--max-model-len", "256",
         "--tensor-parallel-size", "2", "--threads", "1", "--decode-batches", "1,2",
         "--prefill-chunks", "16", "--decode-steps", "2", "--reps", "1", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "threads, TP=1" in text and "thread(s) per rank, TP=2" in text
    table = text.split("# step time, TP=1 vs TP=2\n", 1)[1].splitlines()
    assert table[0].split() == ["kind", "seqs", "prefill", "TP=1", "ms", "TP=2", "ms",
                                "speed-up"]
    rows = [line.split() for line in table[1:4]]
    assert [r[:3] for r in rows] == [["decode", "1", "0"], ["decode", "2", "0"],
                                     ["prefill", "1", "16"]]
    for r in rows:
        tp1, tp2, speedup = float(r[3]), float(r[4]), r[5]
        assert tp1 > 0 and tp2 > 0 and re.fullmatch(r"\d+\.\d\dx", speedup)
    result = json.loads(out.read_text())
    assert result["tensor_parallel"]["size"] == 2
    assert len(result["tensor_parallel"]["rows"]) == len(result["rows"]) == 3
    assert "ranks_on_host=2" in result["tensor_parallel"]["compute_plan"]
