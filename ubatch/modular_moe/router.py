"""Top-k expert selection, bit-compatible with Hugging Face's Qwen3-MoE and DeepSeek-V3 gates.

Routing decides which rank every token is sent to, so any drift from the reference model (a different tie
order, a bias applied to the weights instead of only to the choice) silently changes the model's output.
The order of operations below therefore mirrors ``transformers``' ``Qwen3MoeTopKRouter`` and
``DeepseekV3TopkRouter`` exactly, and everything after the logits is computed in fp32.
"""
from __future__ import annotations

from typing import Literal

import torch

ScoringFunc = Literal["softmax", "sigmoid"]
_SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")
GROUP_SCORINGS: tuple[str, ...] = ("top2_sum", "max")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: ScoringFunc = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    group_scoring: str = "top2_sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; returns ``(topk_weights fp32 [T, K], topk_ids int64 [T, K])``.

    - Qwen3-MoE: ``scoring_func="softmax"``, ``renormalize=norm_topk_prob``, no groups, no bias.
    - DeepSeek-V3: ``scoring_func="sigmoid"``, ``num_expert_group=n_group``, ``topk_group``,
      ``e_score_correction_bias``, ``routed_scaling_factor``, ``renormalize=norm_topk_prob``. HF computes the
      gate logits in fp32; pass fp32 logits to be bit-equal.

    The bias only steers *which* experts are chosen (DeepSeek's aux-loss-free balancing); the returned weights
    are the unbiased scores at the chosen ids. Groups limit a token to the ``topk_group`` groups with the
    largest sum of their two best (biased) scores (``group_scoring="top2_sum"``, DeepSeek-V3), or with the
    best single score (``"max"``, DeepSeek-V2's ``group_limited_greedy``); this bounds how many nodes a token
    fans out to. Ids come out ordered by descending choice score.
    """
    if group_scoring not in GROUP_SCORINGS:
        raise ValueError(f"unknown group_scoring {group_scoring!r}; expected one of {GROUP_SCORINGS}")
    _validate(
        router_logits, top_k, scoring_func, num_expert_group, topk_group, e_score_correction_bias
    )

    if scoring_func == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    else:
        scores = router_logits.float().sigmoid()

    scores_for_choice = scores
    if e_score_correction_bias is not None:
        scores_for_choice = scores + e_score_correction_bias.to(device=scores.device, dtype=torch.float32)

    if num_expert_group is not None and topk_group is not None and topk_group < num_expert_group:
        scores_for_choice = _mask_to_top_groups(scores_for_choice, num_expert_group, topk_group, group_scoring)

    topk_ids = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=True)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # HF DeepSeek-V3 adds 1e-20 to guard a zero sum; for softmax (sum >= top_k/E) it is an exact no-op,
        # so one expression is bit-equal to both references.
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def check_router_args(router_logits: torch.Tensor, top_k: int, scoring_func: str) -> int:
    """What every router checks without groups or bias: 2-D logits, ``top_k`` in ``[1, E]``, a known scoring
    function; returns ``E``."""
    return _validate(router_logits, top_k, scoring_func, None, None, None)


def _mask_to_top_groups(scores_for_choice: torch.Tensor, num_groups: int, topk_group: int,
                        group_scoring: str = "top2_sum") -> torch.Tensor:
    """-inf out every expert outside the ``topk_group`` best groups (group score: sum of its top-2, or max).

    With a group size of 1 the "top-2" is the single expert; HF would fail there, we degrade gracefully.
    """
    num_tokens, num_experts = scores_for_choice.shape
    grouped = scores_for_choice.view(num_tokens, num_groups, num_experts // num_groups)
    if group_scoring == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores_for_choice.masked_fill(~score_mask, float("-inf"))


def _validate(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    num_expert_group: int | None,
    topk_group: int | None,
    e_score_correction_bias: torch.Tensor | None,
) -> int:
    """Reject bad configs up front: a wrong group count would otherwise surface as an opaque view() error."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [num_tokens, num_experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if scoring_func not in _SCORING_FUNCS:
        raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {_SCORING_FUNCS}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group={num_expert_group} and topk_group={topk_group} must be given together or not at all"
        )
    if num_expert_group is not None and topk_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} does not divide num_experts={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
        if top_k > topk_group * (num_experts // num_expert_group):
            raise ValueError(
                f"top_k={top_k} exceeds the {topk_group * (num_experts // num_expert_group)} experts "
                f"in the topk_group={topk_group} kept groups"
            )
    if e_score_correction_bias is not None and tuple(e_score_correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}, expected ({num_experts},)"
        )
    return num_experts
