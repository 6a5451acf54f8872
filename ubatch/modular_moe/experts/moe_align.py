"""Group (token, k) routes by expert into GEMM-sized blocks: the schedule a grouped-GEMM kernel walks.

A grouped GEMM processes ``block_size`` rows that all use one expert's weights, so routes are sorted by
expert and each expert's list is padded up to a multiple of ``block_size``. The semantics follow vLLM's
``moe_align_block_size`` (and its golden torch version) so its kernels and configs carry over. This version
is vectorised torch with output shapes that depend only on ``topk_ids.numel()``, ``block_size`` and
``num_experts`` -- never on the routing itself -- so it needs no host sync and is CUDA-graph capturable.
"""
from __future__ import annotations

import torch


def max_num_tokens_padded(numel: int, block_size: int, num_experts: int) -> int:
    """Worst-case padded length: every expert wastes up to ``block_size - 1`` pad slots.

    With fewer routes than experts at most ``numel`` experts are non-empty, each needing at most one block
    per route, so ``numel * block_size`` is the tighter bound (vLLM uses the same special case).
    """
    if numel < num_experts:
        return numel * block_size
    return numel + num_experts * (block_size - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(sorted_token_ids int32 [P], expert_ids int32 [cdiv(P, B)], num_tokens_post_padded int32 [1])``.

    ``P = max_num_tokens_padded(topk_ids.numel(), B, num_experts)`` with ``B = block_size``.

    ``sorted_token_ids`` holds flat route indices (``t * top_k + k``) grouped by expert in ascending expert
    order and, within an expert, ascending route order; pad slots hold ``topk_ids.numel()`` so a kernel can
    mask them with ``id < numel``. ``expert_ids[b]`` is the expert of block ``b``; blocks at or past
    ``num_tokens_post_padded`` hold -1. Ids outside ``[0, num_experts)`` (e.g. -1 = expert on another rank)
    are dropped. Empty experts get no block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    device = topk_ids.device
    numel = topk_ids.numel()
    padded_len = max_num_tokens_padded(numel, block_size, num_experts)
    num_blocks = (padded_len + block_size - 1) // block_size

    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    # Invalid routes get key num_experts so the stable sort pushes them past every real expert.
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True)[1]
    sorted_key = key[order]

    # scatter_add, not bincount: bincount reads min/max on the host, which breaks CUDA-graph capture.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded_counts = (counts + block_size - 1) // block_size * block_size
    raw_starts = torch.cumsum(counts, 0) - counts
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts

    # Destination of the i-th sorted route: its expert's padded start plus its rank within the expert.
    # Invalid routes go to a scratch slot one past the end, which is then sliced away.
    expert_of = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(numel, device=device) - raw_starts[expert_of]
    dest = torch.where(sorted_key < num_experts, padded_starts[expert_of] + rank, torch.full_like(rank, padded_len))
    sorted_token_ids = torch.full((padded_len + 1,), numel, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_token_ids = sorted_token_ids[:padded_len]

    # Block b belongs to the first expert whose padded end (in blocks) exceeds b; empty experts share
    # their predecessor's end and are skipped by right-sided search.
    block_ends = padded_ends // block_size
    blocks = torch.arange(num_blocks, device=device, dtype=block_ends.dtype)
    expert_ids = torch.searchsorted(block_ends, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, torch.full_like(expert_ids, -1)).to(torch.int32)

    num_tokens_post_padded = padded_counts.sum().reshape(1).to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded
