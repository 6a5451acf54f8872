"""benchmarks/bench_gpu.py: refuses to run without a GPU, and its overlap arithmetic (what 'link hidden %' is)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_exits_2_and_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gpu.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_union_counts_overlapping_intervals_once() -> None:
    from bench_gpu import union_length

    assert union_length([]) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert union_length([(5, 6), (0, 10)]) == 10.0


def test_overlap_is_the_time_both_sets_run() -> None:
    from bench_gpu import overlap_length

    sleeps = [(0.0, 4.0), (10.0, 12.0)]
    compute = [(1.0, 2.0), (3.0, 11.0)]
    # [1,2] + [3,4] + [10,11] = 3
    assert overlap_length(sleeps, compute) == 3.0
    assert overlap_length(sleeps, []) == 0.0
