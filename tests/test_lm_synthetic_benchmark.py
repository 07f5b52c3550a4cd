"""benchmarks/lm_synthetic_cpu.py, which docs/lm-path.md's tables come from, runs end to end at a
small size: both data rows of its table and the approximation table (it once stopped after its first
train run, on a changed signature, and nothing noticed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_lm_benchmark_prints_both_rows_and_the_approximation_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    args = ["--n", "60", "--iterations", "1", "--pretrain-steps", "5", "--approx-seeds", "1", "--approx-examples", "3",
            "--anchor-weighting", "nearest", "--anchor-draw", "by_length", "--root", str(tmp_path / "root")]
    out = subprocess.run([sys.executable, "benchmarks/lm_synthetic_cpu.py", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| m' = ")]
    assert [row[0] for row in rows] == ["| m' = m = 4 (no augmentation)", "| m' = 8 (4 below extras)"]
    for row in rows:
        start, end = (float(x) for x in row[1].split(" -> "))
        assert 0 <= start <= 1 and 0 <= end <= 1 and 0 <= float(row[2]) <= 1  # clustering accuracies
        assert float(row[4]) < 0  # held-out log-likelihood per ranking
    assert "Relative squared error (eps/r)^2 of single-anchor estimates" in out.stdout
