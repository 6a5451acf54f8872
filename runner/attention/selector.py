"""``--attention-backend auto|torch|triton``: which backend an engine rank runs.

``auto`` is ``triton`` (paged decode kernel, SDPA prefill) on CUDA and ``torch`` (the plain reference, whose
figures the CPU documentation was measured with) elsewhere. ``triton`` on a CPU runs the kernel in the
Triton interpreter, which only tests want (``TRITON_INTERPRET=1``; tiny shapes).
"""
from __future__ import annotations

import logging

import torch

from runner.attention.backend import AttentionBackend
from runner.config import ATTENTION_BACKENDS
from ubatch.log_once import log_once

logger = logging.getLogger("ubatch.attention")


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend name for ``name`` on ``device``; an unknown name raises ``ValueError`` naming it."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(ATTENTION_BACKENDS)}")
    if name != "auto":
        return name
    return "triton" if torch.device(device).type == "cuda" else "torch"


def make_attention_backend(name: str, device: torch.device | str, *, log: bool = True) -> AttentionBackend:
    """A backend instance for ``name`` (``auto`` resolved by ``device``); logs once what ``auto`` picked."""
    resolved = resolve_attention_backend(name, device)
    if name == "auto" and log:
        log_once(logger, logging.INFO, f"attention backend auto: {resolved} on {torch.device(device).type}")
    if resolved == "torch":
        from runner.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from runner.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
