"""Test-wide settings that must be in place before torch or any Triton kernel module is imported."""
import os

# fork-based multi-process tests are only safe when OpenMP pools stay single-threaded (set before torch loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# The Triton interpreter must be selected before any @triton.jit decorator runs (kernel modules import lazily,
# after this file); on a GPU machine the real compiler runs and the CUDA tests use it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
