"""The Triton mode scheme of tests/conftest.py: a test marked ``triton_interpreter`` runs Triton's CPU
interpreter whatever the machine has, in a child process when this one compiles Triton (a GPU machine)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from child_pytest import child_pytest_env
from ubatch.modular_moe.experts import make_experts
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.types import ExpertTokens

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.triton_interpreter
def test_interpreted_kernels_run_on_cpu_tensors() -> None:
    pytest.importorskip("triton")
    from triton import knobs

    assert os.environ["TRITON_INTERPRET"] == "1" and knobs.runtime.interpret
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 48, 16, generator=g) * 0.2, torch.randn(4, 16, 24, generator=g) * 0.2
    tokens = ExpertTokens("contiguous", torch.randn(5, 16, generator=g), torch.tensor([[0, 3], [1, 2], [2, 0],
                          [3, 1], [0, 1]]), torch.rand(5, 2, generator=g))
    out = make_experts("triton", block_m=16, block_n=64, block_k=32).apply(tokens, w13, w2)
    torch.testing.assert_close(out, TorchExperts().apply(tokens, w13, w2), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_compiling_process_hands_interpreter_tests_to_a_child() -> None:
    """What ``pytest`` on a GPU machine does: its process compiles Triton (TRITON_INTERPRET=0), where the
    interpreter cannot run, so the marked CPU test above must be run by a TRITON_INTERPRET=1 child.
    Simulated by starting pytest here with TRITON_INTERPRET=0."""
    pytest.importorskip("triton")
    node = f"{Path(__file__).relative_to(REPO)}::test_interpreted_kernels_run_on_cpu_tensors"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rP", node],
                          cwd=REPO, env=child_pytest_env(TRITON_INTERPRET="0"), capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in proc.stdout, output[-4000:]
    assert "ran in a TRITON_INTERPRET=1 child process" in proc.stdout, output[-4000:]
