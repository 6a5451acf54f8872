"""The expert-computation contract every backend (torch, triton, deep_gemm) implements."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens, Layout


class MoEExperts(ABC):
    """Runs this rank's experts on tokens already delivered by the all-to-all.

    Weights follow vLLM's fused layout: ``w13 [E_local, 2*I, H]`` (gate rows first, then up rows) and
    ``w2 [E_local, H, I]``; the activation is SiLU-and-mul. Accumulation is fp32 whatever the input dtype;
    the result has the input's dtype. Experts never yield: the DBO yields live in prepare/finalize.
    """

    name: str = "base"
    supported_layouts: tuple[Layout, ...] = ("contiguous", "masked")
    #: implements ``ExpertMLPExtras`` (expert biases, clamped SwiGLU: gpt-oss)
    supports_extras: bool = False

    @abstractmethod
    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """contiguous -> ``[M, H]`` weighted sum over local experts; masked -> ``[E_local, cap, H]`` unweighted.
        ``extras`` only where :attr:`supports_extras` (else a ``ValueError`` naming the backend)."""

    def check_extras(self, extras: ExpertMLPExtras | None) -> None:
        if extras is not None and not self.supports_extras:
            raise ValueError(f"experts backend {self.name!r} does not implement expert biases or the clamped "
                             "SwiGLU activation (gpt-oss); use --experts-backend torch or grouped_mm")
