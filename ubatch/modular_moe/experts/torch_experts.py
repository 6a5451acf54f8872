"""Pure-torch experts: the numerical reference every other backend is tested against.

Deliberately plain -- one loop over local experts, gather with ``index_select``, scatter with ``index_add_``
-- so its correctness is evident by reading it. Everything is computed in fp32 and rounded to the input
dtype once at the end, which is the contract the fused backends are held to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.types import ClampedSwiGLU, ExpertMLPExtras, ExpertTokens


def check_expert_weights(tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes shared by every backend; returns ``(E_local, H, I)``.

    Shape mistakes in a fused kernel read out of bounds instead of failing, so they are caught here.
    """
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 dim 1 must be 2*intermediate (gate rows then up rows), got {two_i}")
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}, expected {(num_experts, hidden, inter)} from w13")
    if tokens.hidden.shape[-1] != hidden:
        raise ValueError(f"hidden size {tokens.hidden.shape[-1]} does not match the weights' {hidden}")
    if tokens.layout == "masked":
        assert tokens.expert_num_tokens is not None
        if tokens.hidden.shape[0] != num_experts or tokens.expert_num_tokens.numel() != num_experts:
            raise ValueError(
                f"masked hidden {tuple(tokens.hidden.shape)} / expert_num_tokens "
                f"{tuple(tokens.expert_num_tokens.shape)} do not match {num_experts} local experts"
            )
    else:
        assert tokens.topk_ids is not None and tokens.topk_weights is not None
        if tokens.hidden.dim() != 2:
            raise ValueError(f"contiguous hidden must be 2-D [M, H], got {tuple(tokens.hidden.shape)}")
        rows = tokens.hidden.shape[0]
        ids, weights = tokens.topk_ids, tokens.topk_weights
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != rows:
            raise ValueError(
                f"topk_ids {tuple(tokens.topk_ids.shape)} and topk_weights {tuple(tokens.topk_weights.shape)} "
                f"must both be [{rows}, top_k]"
            )
    return num_experts, hidden, inter


def gated_activation(gate_up: torch.Tensor, activation: ClampedSwiGLU | None) -> torch.Tensor:
    """``[..., 2I]`` (gate then up) in fp32 -> ``[..., I]``: SiLU-and-mul, or gpt-oss's clamped SwiGLU."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def expert_mlp_fp32(x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor,
                    extras: ExpertMLPExtras | None = None, e: int = 0) -> torch.Tensor:
    """One expert's (local index ``e``) gated MLP on fp32 rows; gate rows of ``w13_e`` come first, then up rows."""
    gate_up = x @ w13_e.float().t()
    if extras is not None and extras.w13_bias is not None:
        gate_up = gate_up + extras.w13_bias[e].float()
    y = gated_activation(gate_up, None if extras is None else extras.activation) @ w2_e.float().t()
    if extras is not None and extras.w2_bias is not None:
        y = y + extras.w2_bias[e].float()
    return y


class TorchExperts(MoEExperts):
    """Reference backend for both layouts; also the CPU production path (no extra dependencies)."""

    name = "torch"
    supports_extras = True

    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        check_expert_weights(tokens, w13, w2)
        if tokens.layout == "masked":
            return self._apply_masked(tokens, w13, w2, extras)
        return self._apply_contiguous(tokens, w13, w2, extras)

    def _apply_contiguous(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
                          extras: ExpertMLPExtras | None) -> torch.Tensor:
        hidden = tokens.hidden
        assert tokens.topk_ids is not None and tokens.topk_weights is not None
        topk_ids, topk_weights = tokens.topk_ids, tokens.topk_weights
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for e in range(w13.shape[0]):
            rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            x = hidden.index_select(0, rows).float()
            y = expert_mlp_fp32(x, w13[e], w2[e], extras, e)
            y = y * topk_weights[rows, slots].float().unsqueeze(1)
            out.index_add_(0, rows, y)
        return out.to(hidden.dtype)

    def _apply_masked(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
                      extras: ExpertMLPExtras | None) -> torch.Tensor:
        hidden = tokens.hidden
        assert tokens.expert_num_tokens is not None
        out = torch.zeros_like(hidden)
        capacity = hidden.shape[1]
        # One host sync for all experts; the reference does not aim to be graph-capturable.
        counts = tokens.expert_num_tokens.tolist()
        for e, n in enumerate(counts):
            n = int(n)
            if n > capacity:
                raise ValueError(f"expert_num_tokens[{e}]={n} exceeds the buffer capacity {capacity}")
            if n <= 0:
                continue
            rows = torch.arange(n, device=hidden.device)
            x = hidden[e].index_select(0, rows).float()
            out[e].index_copy_(0, rows, expert_mlp_fp32(x, w13[e], w2[e], extras, e).to(hidden.dtype))
        return out
