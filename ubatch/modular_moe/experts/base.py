"""The expert-computation contract every backend (torch, triton, deep_gemm) implements."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ubatch.fp8 import Fp8Tensor
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens, Layout

#: expert weights as a layer holds them: plain tensors, or a checkpoint's FP8 with its scales
ExpertWeight = torch.Tensor | Fp8Tensor


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
    #: computes with FP8 weights and their block scales itself (:meth:`apply_fp8`)
    supports_fp8_weights: bool = False
    #: takes a masked buffer already in FP8 (``ExpertTokens.hidden_scales``), so the dispatch may quantise
    accepts_fp8_activations: bool = False

    def wants_power_of_two_scales(self, device: torch.device) -> bool:
        """Whether FP8 activations handed over must have power-of-two scales (DeepGEMM on SM100 keeps only
        each scale's exponent); only asked of backends that :attr:`accepts_fp8_activations`."""
        return False

    def run(self, tokens: ExpertTokens, w13: ExpertWeight, w2: ExpertWeight,
            extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """:meth:`apply` on plain weights; on FP8 ones :meth:`apply_fp8` where the backend has it, else
        :meth:`apply` on the weights dequantised to the activations' dtype (W8A16: a full copy of this layer's
        experts each call, what the CPU and GPUs without an FP8 kernel run). FP8 tokens only for backends that
        :attr:`accepts_fp8_activations` (``TypeError`` otherwise)."""
        if tokens.is_fp8 and not self.accepts_fp8_activations:
            raise TypeError(f"experts backend {self.name!r} does not take FP8 activations; dispatch bf16 tokens "
                            "to it")
        if isinstance(w13, Fp8Tensor) and isinstance(w2, Fp8Tensor):
            if self.supports_fp8_weights:
                return self.apply_fp8(tokens, w13, w2, extras)
            dtype = tokens.hidden.dtype
            return self.apply(tokens, w13.dequantize(dtype), w2.dequantize(dtype), extras)
        if isinstance(w13, Fp8Tensor) or isinstance(w2, Fp8Tensor):
            raise TypeError("w13 and w2 must both be FP8 or both plain tensors")
        return self.apply(tokens, w13, w2, extras)

    def apply_fp8(self, tokens: ExpertTokens, w13: Fp8Tensor, w2: Fp8Tensor,
                  extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """:meth:`apply` with FP8 weights, for backends with :attr:`supports_fp8_weights`."""
        raise NotImplementedError(f"experts backend {self.name!r} does not compute with FP8 weights")

    @abstractmethod
    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        """contiguous -> ``[M, H]`` weighted sum over local experts; masked -> ``[E_local, cap, H]`` unweighted.
        ``extras`` only where :attr:`supports_extras` (else a ``ValueError`` naming the backend)."""

    def check_extras(self, extras: ExpertMLPExtras | None) -> None:
        if extras is not None and not self.supports_extras:
            raise ValueError(f"experts backend {self.name!r} does not implement expert biases or the clamped "
                             "SwiGLU activation (gpt-oss); use --experts-backend torch or grouped_mm")
