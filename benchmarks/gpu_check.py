"""``make gpu-check``: prove the GPU paths on one NVIDIA GPU in one command (see ``gpucheck/__init__.py``).

Usage: ``python benchmarks/gpu_check.py [--out DIR] [--parts ...] [--tests gpu|full] [--time-limit-s 420]``;
``GPU_CHECK_OUT`` sets the report directory (default ``build/gpu-check``). Exits 2 without a CUDA GPU.
docs/gpu_check.md says what it runs and how to run it on a lent GPU machine.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the repo's packages, and benchmarks/ (common, bench_gpu, gpucheck)

from gpucheck.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
