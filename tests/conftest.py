"""Test-wide settings that must be in place before torch or any Triton kernel module is imported."""
import os

# The Triton interpreter must be selected before any @triton.jit decorator runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# fork-based multi-process tests are only safe when OpenMP pools stay single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
