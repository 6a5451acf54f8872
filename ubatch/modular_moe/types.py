"""Data handed between the all-to-all (prepare/finalize) and the expert computation.

Two layouts exist because the two DeepEP modes deliver tokens differently:
- ``contiguous`` (high-throughput shape): received tokens as rows ``[M, H]`` with their top-k ids remapped
  to this rank's local expert ids (``-1`` where the expert lives elsewhere) and weights; experts return the
  weighted sum over local experts per row, ``[M, H]``.
- ``masked`` (low-latency shape): a fixed-capacity buffer ``[E_local, capacity, H]`` plus
  ``expert_num_tokens[E_local]``; experts return the unweighted output per slot, same shape. Rows at or
  beyond ``expert_num_tokens[e]`` are padding and must come back as zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["contiguous", "masked"]


@dataclass
class ExpertTokens:
    layout: Layout
    hidden: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    expert_num_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.layout == "contiguous":
            if self.topk_ids is None or self.topk_weights is None:
                raise ValueError("contiguous ExpertTokens need topk_ids and topk_weights")
        elif self.layout == "masked":
            if self.expert_num_tokens is None or self.hidden.dim() != 3:
                raise ValueError("masked ExpertTokens need a 3-D hidden [E_local, capacity, H] and expert_num_tokens")
        else:
            raise ValueError(f"unknown layout {self.layout!r}; expected 'contiguous' or 'masked'")


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
