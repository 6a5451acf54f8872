"""Expert-computation backends, chosen by name so configs and CLIs need not import optional dependencies.

Backends are imported only inside ``make_experts``: ``triton`` (about 1 GB) and ``deep_gemm`` (CUDA only) are
optional, and Triton kernels must be decorated after ``TRITON_INTERPRET`` is settled.
"""
from __future__ import annotations

from typing import Any

from ubatch.modular_moe.experts.base import MoEExperts

EXPERTS_BACKENDS: tuple[str, ...] = ("torch", "triton", "deep_gemm")

__all__ = ["EXPERTS_BACKENDS", "MoEExperts", "make_experts"]


def make_experts(name: str, **kwargs: Any) -> MoEExperts:
    """Build the backend called ``name``; ``kwargs`` go to its constructor (e.g. Triton block sizes)."""
    if name == "torch":
        from ubatch.modular_moe.experts.torch_experts import TorchExperts

        return TorchExperts(**kwargs)
    if name == "triton":
        from ubatch.modular_moe.experts.triton_experts import TritonExperts

        return TritonExperts(**kwargs)
    if name == "deep_gemm":
        from ubatch.modular_moe.experts.deep_gemm_experts import DeepGemmExperts

        return DeepGemmExperts(**kwargs)
    raise ValueError(f"unknown experts backend {name!r}; expected one of {', '.join(EXPERTS_BACKENDS)}")
