"""The device the engine tests run on: one helper, so a test that starts N ranks runs on any host.

On a machine with CUDA the engine's ``--device auto`` picks NCCL, which needs one GPU per rank on a host: a
DP=2 test on a one-GPU machine would stop with "2 ranks on this host need 2 GPUs". The tests' expected
values (token equalities against in-process references) were worked out on the CPU, and the CPU runs every
rank count anywhere, so the tests' default is ``cpu``. ``UBATCH_TEST_DEVICE`` changes it for a run:

- ``cpu`` (default): every rank, and every in-process reference, on the CPU over gloo;
- ``auto``: CUDA where this host has a GPU per rank, else the CPU (per test, by its rank count);
- ``cuda``: CUDA; a test whose ranks do not fit this host's GPUs fails with the reason rather than
  quietly running elsewhere.

Every engine config, ``launch`` call and CLI command of a multi-rank test (and the single-rank references
they are compared with) takes its device from here.
"""
from __future__ import annotations

import os

ENV = "UBATCH_TEST_DEVICE"
CHOICES = ("cpu", "auto", "cuda")


def gpus_on_this_host() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for(num_ranks: int = 1) -> str:
    """The ``device`` setting (``cpu`` or ``cuda``) for a test running ``num_ranks`` ranks on this host."""
    choice = os.environ.get(ENV, "cpu")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}; expected one of {', '.join(CHOICES)}")
    if choice == "cpu":
        return "cpu"
    gpus = gpus_on_this_host()
    if gpus >= num_ranks:
        return "cuda"
    if choice == "cuda":
        raise RuntimeError(f"{ENV}=cuda but this test runs {num_ranks} ranks and this host has {gpus} GPUs; "
                           f"use {ENV}=auto or cpu")
    return "cpu"


def device_args(num_ranks: int = 1) -> list[str]:
    """``["--device", device_for(num_ranks)]`` for a CLI command."""
    return ["--device", device_for(num_ranks)]
