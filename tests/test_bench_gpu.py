"""benchmarks/bench_gpu.py: refuses to run without a GPU, and the overlap arithmetic its 'link hidden %' uses
(``ubatch.trace_metrics``: the sleep kernels' time that overlaps compute kernels)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ubatch.trace_metrics import intersect, length

REPO = Path(__file__).resolve().parents[1]


def test_exits_2_and_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gpu.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_union_counts_overlapping_intervals_once() -> None:
    assert length([]) == 0.0
    assert length([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert length([(5, 6), (0, 10)]) == 10.0


def test_overlap_is_the_time_both_sets_run() -> None:
    sleeps = [(0.0, 4.0), (10.0, 12.0)]
    compute = [(1.0, 2.0), (3.0, 11.0)]
    # [1,2] + [3,4] + [10,11] = 3
    assert length(intersect(sleeps, compute)) == 3.0
    assert length(intersect(sleeps, [])) == 0.0
