"""Experts on ``torch._grouped_mm``: PyTorch's grouped GEMM (CUTLASS on Hopper/Blackwell), no host sync.

Routes are sorted by local expert (``-1`` last), group ends counted on the device, two grouped GEMMs run, and
the undefined rows past the last group are dropped with ``torch.where``; routes are summed back in a fixed
order, so a graph replay equals an eager step. ``_grouped_mm``'s fused kernel takes bf16 on compute capability
9.x/10.x only (elsewhere torch's fallback syncs the host), so a CUDA device outside those raises and fp32/fp16
experts on CUDA run bf16 GEMMs (logged once); on CPU every dtype runs as is. Sizes must be multiples of 16
bytes. Design: docs/design_notes.md, "MoE layer and the DBO runtime".
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ubatch.log_once import log_once
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.experts.torch_experts import check_expert_weights, gated_activation
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens
from ubatch.sbo import DeviceProps

logger = logging.getLogger("ubatch.experts")

# Compute capability majors whose bf16 `_grouped_mm` is the fused CUTLASS kernel (`_scaled_mm_allowed_device(
# sm90_only=true, sm100_only=true)` in torch's GroupedBlas.cpp); elsewhere torch falls back to a host loop.
FUSED_CAPABILITY_MAJORS: tuple[int, ...] = (9, 10)
CPU_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN_BYTES = 16  # _grouped_mm's rule for base pointers and leading strides


def _capability(device: torch.device) -> tuple[int, int]:
    return DeviceProps.of(device).capability  # cached per device index


def has_fused_grouped_mm(device: torch.device | str) -> bool:
    """True on a CUDA device whose bf16 ``torch._grouped_mm`` is the fused kernel (no host sync)."""
    device = torch.device(device)
    return device.type == "cuda" and _capability(device)[0] in FUSED_CAPABILITY_MAJORS


def gemm_dtype_for(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the two GEMMs run in for ``dtype`` experts on ``device``; raises where none works."""
    if dtype not in CPU_DTYPES:
        raise ValueError(f"experts backend grouped_mm computes float32, bfloat16 or float16 experts, got {dtype}")
    if device.type == "cpu":
        return dtype
    if device.type != "cuda":
        raise ValueError(f"experts backend grouped_mm runs on CPU or CUDA, got device {device}")
    if not has_fused_grouped_mm(device):
        major, minor = _capability(device)
        raise RuntimeError(
            f"experts backend grouped_mm needs a GPU of compute capability 9.x or 10.x: torch._grouped_mm has no "
            f"fused kernel for {major}.{minor} and falls back to a loop that copies the group offsets to the host "
            f"(a sync per GEMM, not CUDA-graph capturable). Use --experts-backend triton (capturable) or torch")
    if dtype != torch.bfloat16:
        log_once(logger, logging.WARNING,
                 f"experts backend grouped_mm: torch._grouped_mm's fused kernel is bf16-only, so {dtype} experts "
                 f"run their GEMMs on bf16-rounded operands (fp32 accumulation, {dtype} result); use "
                 "--experts-backend triton or torch for full-precision expert GEMMs")
    return torch.bfloat16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte-aligned base (a view at an odd offset is copied; metadata only, no sync)."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN_BYTES == 0 else t.clone()


def _silu_and_mul(gate_up: torch.Tensor, dtype: torch.dtype, extras: ExpertMLPExtras | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) * up (or ``extras``' clamped SwiGLU, after adding ``bias``, the routes' gate/up biases) in fp32
    on the GEMM's output, rounded to the next GEMM's operand dtype."""
    if extras is None:
        inter = gate_up.shape[-1] // 2
        return (F.silu(gate_up[..., :inter].float()) * gate_up[..., inter:].float()).to(dtype)
    gate_up = gate_up.float() if bias is None else gate_up.float() + bias.float()
    return gated_activation(gate_up, extras.activation).to(dtype)


class GroupedMMExperts(MoEExperts):
    """Both layouts on ``torch._grouped_mm``; CUDA-graph capturable (no host sync) on Hopper/Blackwell."""

    name = "grouped_mm"
    supports_extras = True

    def apply(self, tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor,
              extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        num_experts, hidden_size, inter = check_expert_weights(tokens, w13, w2)
        device = tokens.hidden.device
        gemm_dtype = gemm_dtype_for(device, tokens.hidden.dtype)
        align = _ALIGN_BYTES // gemm_dtype.itemsize
        if hidden_size % align or inter % align:
            raise ValueError(
                f"experts backend grouped_mm needs hidden and intermediate sizes that are multiples of {align} "
                f"for {gemm_dtype} GEMMs (torch._grouped_mm's 16-byte stride rule); got hidden={hidden_size}, "
                f"intermediate={inter}")
        # [E, K, N] views of the [E, N, K] weights: column-major B, the layout the fused kernel reads directly.
        w13_t = _aligned(w13.to(gemm_dtype)).transpose(1, 2)
        w2_t = _aligned(w2.to(gemm_dtype)).transpose(1, 2)
        if tokens.layout == "masked":
            return self._apply_masked(tokens, w13_t, w2_t, gemm_dtype, extras)
        return self._apply_contiguous(tokens, w13_t, w2_t, gemm_dtype, extras)

    def _apply_contiguous(self, tokens: ExpertTokens, w13_t: torch.Tensor, w2_t: torch.Tensor,
                          gemm_dtype: torch.dtype, extras: ExpertMLPExtras | None) -> torch.Tensor:
        hidden = tokens.hidden
        assert tokens.topk_ids is not None and tokens.topk_weights is not None
        rows, top_k = tokens.topk_ids.shape
        num_experts, hidden_size = w13_t.shape[0], hidden.shape[1]
        if rows == 0 or num_experts == 0:
            return torch.zeros_like(hidden)
        ids = tokens.topk_ids.reshape(-1).long()
        # Ids outside [0, E_local) mean "no expert on this rank" (-1), as for every backend: sort them last.
        keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
        sorted_keys, order = torch.sort(keys, stable=True)
        experts = torch.arange(num_experts, device=hidden.device, dtype=sorted_keys.dtype)
        offs = torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)  # group ends, on device
        x = hidden.index_select(0, order // top_k).to(gemm_dtype)
        # Each route's expert for the biases; the no-expert routes borrow the last one (their rows are dropped).
        route_expert = sorted_keys.clamp(max=num_experts - 1)
        b13 = None if extras is None or extras.w13_bias is None else extras.w13_bias.index_select(0, route_expert)
        act = _silu_and_mul(torch._grouped_mm(x, w13_t, offs=offs), gemm_dtype, extras, b13)
        y = torch._grouped_mm(act, w2_t, offs=offs).float()
        if extras is not None and extras.w2_bias is not None:
            y = y + extras.w2_bias.index_select(0, route_expert).float()
        route_weights = tokens.topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
        # Rows past offs[-1] are whatever memory held (NaN included): select zeros there, never multiply.
        y = torch.where((sorted_keys < num_experts).unsqueeze(1), y * route_weights, 0.0)
        per_route = torch.empty_like(y).index_copy_(0, order, y)  # back to (row, k) order
        return per_route.view(rows, top_k, hidden_size).sum(dim=1).to(hidden.dtype)

    def _apply_masked(self, tokens: ExpertTokens, w13_t: torch.Tensor, w2_t: torch.Tensor,
                      gemm_dtype: torch.dtype, extras: ExpertMLPExtras | None) -> torch.Tensor:
        hidden = tokens.hidden
        assert tokens.expert_num_tokens is not None
        counts = tokens.expert_num_tokens
        num_experts, capacity, _ = hidden.shape
        if counts.device.type == "cpu":  # readable without a device sync; on a GPU it would need one
            for e, n in enumerate(counts.tolist()):
                if n > capacity:
                    raise ValueError(f"expert_num_tokens[{e}]={n} exceeds the buffer capacity {capacity}")
        if num_experts == 0 or capacity == 0:
            return torch.zeros_like(hidden)
        x = _aligned(hidden.to(gemm_dtype))
        b13 = None if extras is None or extras.w13_bias is None else extras.w13_bias[:, None, :]
        act = _silu_and_mul(torch._grouped_mm(x, w13_t), gemm_dtype, extras, b13)
        y = torch._grouped_mm(act, w2_t)
        if extras is not None and extras.w2_bias is not None:
            y = (y.float() + extras.w2_bias[:, None, :].float()).to(y.dtype)
        slots = torch.arange(capacity, device=hidden.device)
        valid = slots.unsqueeze(0) < counts.to(hidden.device).unsqueeze(1)  # [E, capacity]
        # Padding slots may hold NaN (the buffer is never zero-filled): select, do not multiply.
        return torch.where(valid.unsqueeze(-1), y, 0.0).to(hidden.dtype)
