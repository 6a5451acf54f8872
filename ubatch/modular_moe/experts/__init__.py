"""Expert-computation backends, chosen by name so configs and CLIs need not import optional dependencies.

Backends are imported only inside ``make_experts``: ``triton`` (about 1 GB) and ``deep_gemm`` (CUDA only) are
optional, and Triton kernels must be decorated after ``TRITON_INTERPRET`` is settled.

``auto`` (the engine's default) is not a backend but a rule. Where a layer's shape is known (``FusedMoE``
builds its kernel: :func:`~ubatch.modular_moe.experts.auto.experts_for_layer`), a CUDA device with a
backend-choice table for that shape and GPU (written by ``benchmarks/tune_moe.py``, :mod:`.backend_choice`) gets
the fastest measured backend per token-count bucket (:class:`~.bucketed_experts.BucketedExperts`, ``triton`` or
``grouped_mm`` per call size). Otherwise, and for callers that know only the device,
:func:`resolve_experts_backend`: ``grouped_mm`` on a GPU whose ``torch._grouped_mm`` is the fused kernel
(capturable, so CUDA graphs stay on), ``torch`` everywhere else (the CPU figures in docs/benchmarks.md were
measured with it; the CPU never reads a table).
"""
from __future__ import annotations

from typing import Any

import torch

from ubatch.modular_moe.experts.base import MoEExperts

EXPERTS_BACKENDS: tuple[str, ...] = ("torch", "triton", "deep_gemm", "grouped_mm")
AUTO = "auto"
EXPERTS_CHOICES: tuple[str, ...] = (AUTO,) + EXPERTS_BACKENDS  # what a config or CLI accepts

__all__ = ["AUTO", "EXPERTS_BACKENDS", "EXPERTS_CHOICES", "MoEExperts", "make_experts", "resolve_experts_backend"]


def resolve_experts_backend(name: str, device: torch.device | str) -> str:
    """The backend ``name`` means on ``device``: ``auto`` becomes a backend, any other name passes through.

    ``auto``: ``grouped_mm`` on a CUDA device of compute capability 9.x/10.x (where ``torch._grouped_mm`` is
    the fused kernel, no host sync), ``torch`` on CPU and on other GPUs (there ``torch._grouped_mm`` would sync
    with the host on every GEMM, so ``grouped_mm`` refuses to run).

    This is the device-only answer, for decisions made without a layer's shape (CUDA-graph capture blockers,
    SBO modes, benchmarks). A layer may run per-bucket members from a backend-choice table instead; those are
    only ``triton`` and ``grouped_mm``, both capturable and neither ``deep_gemm``, so for these decisions they
    behave as ``grouped_mm`` (and where this answer is ``torch``, graphs are merely refused, never wrong).
    """
    if name != AUTO:
        if name not in EXPERTS_BACKENDS:
            raise ValueError(f"unknown experts backend {name!r}; expected one of {', '.join(EXPERTS_CHOICES)}")
        return name
    device = torch.device(device)
    if device.type != "cuda":
        return "torch"
    from ubatch.modular_moe.experts.grouped_mm_experts import has_fused_grouped_mm

    return "grouped_mm" if has_fused_grouped_mm(device) else "torch"


def make_experts(name: str, **kwargs: Any) -> MoEExperts:
    """Build the backend called ``name``; ``kwargs`` go to its constructor (e.g. Triton block sizes)."""
    if name == "torch":
        from ubatch.modular_moe.experts.torch_experts import TorchExperts

        return TorchExperts(**kwargs)
    if name == "grouped_mm":
        from ubatch.modular_moe.experts.grouped_mm_experts import GroupedMMExperts

        return GroupedMMExperts(**kwargs)
    if name == "triton":
        from ubatch.modular_moe.experts.triton_experts import TritonExperts

        return TritonExperts(**kwargs)
    if name == "deep_gemm":
        from ubatch.modular_moe.experts.deep_gemm_experts import DeepGemmExperts

        return DeepGemmExperts(**kwargs)
    if name == AUTO:
        raise ValueError("experts backend 'auto' depends on the device: resolve it first with "
                         "resolve_experts_backend('auto', device)")
    raise ValueError(f"unknown experts backend {name!r}; expected one of {', '.join(EXPERTS_BACKENDS)}")
