"""Data handed between the all-to-all (prepare/finalize) and the expert computation.

Two layouts exist because the two DeepEP modes deliver tokens differently:
- ``contiguous`` (high-throughput shape): received tokens as rows ``[M, H]`` with their top-k ids remapped
  to this rank's local expert ids (``-1`` where the expert lives elsewhere) and weights; experts return the
  weighted sum over local experts per row, ``[M, H]``.
- ``masked`` (low-latency shape): a fixed-capacity buffer ``[E_local, capacity, H]`` plus
  ``expert_num_tokens[E_local]``; experts return the unweighted output per slot, same shape. Rows at or
  beyond ``expert_num_tokens[e]`` are padding and must come back as zeros.

A masked buffer may arrive already in FP8 (DeepEP's low-latency dispatch with ``use_fp8=True``, for experts that
take FP8 activations): ``hidden`` float8_e4m3fn and ``hidden_scales [E_local, capacity, H / 128]`` fp32, one
scale per token per 128 columns (``hidden * scale`` is the token), the layout DeepGEMM's masked GEMM reads.
The experts' output is bf16 then.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["contiguous", "masked"]
FP8_GROUP = 128  # columns per activation scale of an FP8 masked buffer (DeepEP's and DeepGEMM's 1 x 128)


@dataclass
class ExpertTokens:
    layout: Layout
    hidden: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None
    hidden_scales: torch.Tensor | None = None  # FP8 masked buffers only: fp32 [E_local, capacity, H / 128]

    @property
    def is_fp8(self) -> bool:
        return self.hidden_scales is not None

    @property
    def output_dtype(self) -> torch.dtype:
        """What the experts return: the activations' dtype, bf16 for an FP8 buffer (DeepEP combines bf16)."""
        return torch.bfloat16 if self.is_fp8 else self.hidden.dtype

    def __post_init__(self) -> None:
        if self.layout == "contiguous":
            if self.topk_ids is None or self.topk_weights is None:
                raise ValueError("contiguous ExpertTokens need topk_ids and topk_weights")
        elif self.layout == "masked":
            if self.expert_num_tokens is None or self.hidden.dim() != 3:
                raise ValueError("masked ExpertTokens need a 3-D hidden [E_local, capacity, H] and expert_num_tokens")
        else:
            raise ValueError(f"unknown layout {self.layout!r}; expected 'contiguous' or 'masked'")
        fp8 = self.hidden.dtype == torch.float8_e4m3fn
        if fp8 != (self.hidden_scales is not None):
            given = "given" if self.hidden_scales is not None else "None"
            raise ValueError(f"hidden_scales go with (and only with) float8_e4m3fn hidden; got hidden "
                             f"{self.hidden.dtype} and hidden_scales {given}")
        if self.hidden_scales is not None:
            want = (*self.hidden.shape[:-1], -(-self.hidden.shape[-1] // FP8_GROUP))
            if self.layout != "masked" or self.hidden_scales.dtype != torch.float32 \
                    or tuple(self.hidden_scales.shape) != want:
                raise ValueError(f"FP8 ExpertTokens are masked with fp32 hidden_scales {want}; got layout "
                                 f"{self.layout!r}, hidden_scales {self.hidden_scales.dtype} "
                                 f"{tuple(self.hidden_scales.shape)}")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' ``GptOssExperts._apply_gate``): the gate clamped above at
    ``limit``, the up projection clamped to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass
class ExpertMLPExtras:
    """What an expert MLP may add to bias-free SiLU-and-mul (gpt-oss): per-expert biases after each GEMM,
    ``w13_bias [E_local, 2*I]`` (gate entries then up entries, as ``w13``'s rows) and ``w2_bias [E_local, H]``,
    and the clamped SwiGLU activation. Backends that implement them say so (``MoEExperts.supports_extras``)."""

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    activation: ClampedSwiGLU | None = None
