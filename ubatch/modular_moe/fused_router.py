"""Router scoring and top-k in one Triton kernel: softmax or sigmoid, top-k, renormalise, scale.

:func:`fused_select_experts` is :func:`~ubatch.modular_moe.router.select_experts` without expert groups and
without a correction bias (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss; DeepSeek's grouped or biased
routing stays on the torch path): one program per token holds its row of scores in registers, picks the
``top_k`` best by repeated arg-max and writes fp32 weights ``[T, K]`` and int64 ids ``[T, K]``, ids in
descending score. Equal scores go to the lower expert id first (``torch.topk`` documents no tie order).
Everything after the logits is fp32, as in the torch path; the sums (softmax's denominator, the renormalising
sum) add in another order, so weights agree to fp32 rounding, not bit for bit.

Shapes alone fix the grid and the outputs, so the call is capturable in a CUDA graph. Triton is imported on
first call.
"""
from __future__ import annotations

from typing import Any

import torch

from ubatch.modular_moe.router import ScoringFunc, check_router_args
from ubatch.triton_runtime import import_triton, kernels_per_mode, launch_guard, launch_mode

__all__ = ["fused_select_experts"]

triton: Any = None
tl: Any = None


@kernels_per_mode
def _load_kernel() -> Any:
    """Decorate the kernel (once per interpreter mode: ``kernels_per_mode``)."""

    @triton.jit
    def _topk_router_kernel(
        logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_w, stride_i, scaling,
        SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, TOP_K: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        mask = offs < num_experts
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
            scores = e / tl.sum(e, axis=0)
        scores = tl.where(mask, scores, float("-inf"))  # padding lanes are never picked
        offs_k = tl.arange(0, BLOCK_K)
        top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for k in tl.static_range(TOP_K):
            best = tl.max(scores, axis=0)
            idx = tl.min(tl.where(scores == best, offs, BLOCK_E), axis=0)  # ties: the lowest id
            top_w = tl.where(offs_k == k, best, top_w)
            top_i = tl.where(offs_k == k, idx.to(tl.int64), top_i)
            scores = tl.where(offs == idx, float("-inf"), scores)
        if RENORMALIZE:
            top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
        top_w = top_w * scaling
        k_mask = offs_k < TOP_K
        tl.store(weights_ptr + row * stride_w + offs_k, top_w, mask=k_mask)
        tl.store(ids_ptr + row * stride_i + offs_k, top_i, mask=k_mask)

    return _topk_router_kernel


def fused_select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                         scoring_func: ScoringFunc = "softmax",
                         routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 [T, K], topk_ids int64 [T, K])`` as ``select_experts`` gives them without groups
    or bias (module docstring: tie order, rounding).

    CUDA tensors run the compiled kernel; CPU tensors need ``TRITON_INTERPRET=1`` (Triton's interpreter).
    """
    num_experts = check_router_args(router_logits, top_k, scoring_func)
    interpret = launch_mode("fused_select_experts", router_logits.device)
    global triton, tl
    triton, tl = import_triton("fused_select_experts")
    t = router_logits.shape[0]
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    kernel = _load_kernel()
    with launch_guard(interpret):
        kernel[(t,)](
            logits, weights, ids, num_experts, logits.stride(0), weights.stride(0), ids.stride(0),
            float(routed_scaling_factor),
            SIGMOID=scoring_func == "sigmoid", RENORMALIZE=bool(renormalize), TOP_K=top_k,
            BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            **({} if interpret else {"num_warps": max(1, min(8, block_e // 256))}),
        )
    return weights, ids
