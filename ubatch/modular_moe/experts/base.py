"""The expert-computation contract every backend (torch, triton, deep_gemm) implements."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ubatch.modular_moe.types import ExpertTokens, Layout


class MoEExperts(ABC):
    """Runs this rank's experts on tokens already delivered by the all-to-all.

    Weights follow vLLM's fused layout: ``w13 [E_local, 2*I, H]`` (gate rows first, then up rows) and
    ``w2 [E_local, H, I]``; the activation is SiLU-and-mul. Accumulation is fp32 whatever the input dtype;
    the result has the input's dtype. Experts never yield: the DBO yields live in prepare/finalize.
    """

    name: str = "base"
    supported_layouts: tuple[Layout, ...] = ("contiguous", "masked")

    @abstractmethod
    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """contiguous -> ``[M, H]`` weighted sum over local experts; masked -> ``[E_local, cap, H]`` unweighted."""
