"""select_experts must pick the same experts with the same weights as the Hugging Face reference gates.

Routing errors do not crash -- they silently send tokens to the wrong experts -- so the reference modules are
instantiated directly from ``transformers`` with small random configs and compared id-for-id.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ubatch.modular_moe.router import select_experts

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, Qwen3MoeConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

HIDDEN = 32
NUM_TOKENS = 64


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical per-row order: HF's DeepSeek gate uses topk(sorted=False), so only the set is defined."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def _assert_same_routing(
    ours: tuple[torch.Tensor, torch.Tensor], ref_weights: torch.Tensor, ref_ids: torch.Tensor
) -> None:
    weights, ids = ours
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == ref_ids.shape
    weights, ids = _sorted_by_id(weights, ids)
    ref_weights, ref_ids = _sorted_by_id(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    # HF casts Qwen weights back to the logits dtype; compare in that dtype so a bf16 gate is exact too.
    torch.testing.assert_close(weights.to(ref_weights.dtype), ref_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "num_experts,top_k,norm,dtype",
    [
        (8, 2, True, torch.float32),
        (8, 2, False, torch.float32),
        (16, 4, True, torch.float32),
        (5, 5, False, torch.float32),
        (16, 3, True, torch.bfloat16),
    ],
)
def test_qwen3_moe_routing_matches_hf(num_experts: int, top_k: int, norm: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(num_experts * 10 + top_k)
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=16, norm_topk_prob=norm, hidden_act="silu",
    )
    block = Qwen3MoeSparseMoeBlock(config)
    torch.nn.init.normal_(block.gate.weight, std=0.5)
    block = block.to(dtype)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, dtype=dtype)

    logits, ref_weights, ref_ids = block.gate(hidden)
    ours = select_experts(logits, top_k, renormalize=norm, scoring_func="softmax")
    _assert_same_routing(ours, ref_weights, ref_ids)


@pytest.mark.parametrize(
    "num_experts,top_k,n_group,topk_group,norm,scale",
    [
        (16, 4, 4, 2, True, 2.5),
        (16, 4, 4, 2, False, 1.0),
        (32, 6, 8, 3, True, 1.5),
        (16, 3, 1, 1, True, 2.5),
        (12, 2, 3, 3, False, 0.5),
    ],
)
def test_deepseek_v3_routing_matches_hf(
    num_experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float
) -> None:
    torch.manual_seed(num_experts + top_k + n_group)
    config = DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale,
        moe_intermediate_size=16, n_shared_experts=1,
    )
    gate = DeepseekV3MoE(config).gate
    torch.nn.init.normal_(gate.weight, std=0.5)
    # A bias comparable to the score spread, so choosing by biased and weighting by unbiased scores differ.
    gate.e_score_correction_bias.copy_(torch.randn(num_experts) * 0.3)
    hidden = torch.randn(NUM_TOKENS, HIDDEN)

    logits, ref_weights, ref_ids = gate(hidden)
    ours = select_experts(
        logits, top_k, renormalize=norm, scoring_func="sigmoid", num_expert_group=n_group,
        topk_group=topk_group, e_score_correction_bias=gate.e_score_correction_bias,
        routed_scaling_factor=scale,
    )
    _assert_same_routing(ours, ref_weights, ref_ids)


def test_bias_only_steers_choice() -> None:
    """A huge bias on expert 0 forces it in, but its weight stays its own (small) sigmoid score."""
    logits = torch.tensor([[-3.0, 1.0, 2.0, 0.5]])
    bias = torch.tensor([100.0, 0.0, 0.0, 0.0])
    weights, ids = select_experts(logits, 2, renormalize=False, scoring_func="sigmoid", e_score_correction_bias=bias)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(logits)[:, [0, 2]])


def test_groups_restrict_choice() -> None:
    """Group 1 holds the best single expert, but group 0's top-2 sum wins, so only group 0 is eligible."""
    logits = torch.tensor([[2.0, 1.9, -5.0, 3.0]])
    weights, ids = select_experts(
        logits, 2, renormalize=True, scoring_func="sigmoid", num_expert_group=2, topk_group=1
    )
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=9), "top_k=9"),
        (dict(top_k=0), "top_k=0"),
        (dict(scoring_func="relu"), "relu"),
        (dict(num_expert_group=3, topk_group=1), "num_expert_group=3"),
        (dict(num_expert_group=4, topk_group=5), "topk_group=5"),
        (dict(num_expert_group=4), "topk_group=None"),
        (dict(top_k=5, num_expert_group=4, topk_group=2), "top_k=5"),
        (dict(e_score_correction_bias=torch.zeros(7)), r"\(7,\)"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    args: dict[str, Any] = dict(top_k=2, renormalize=True, scoring_func="sigmoid")  # and bad values: any type
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        select_experts(torch.randn(3, 8), **args)


def test_non_2d_logits_raise() -> None:
    with pytest.raises(ValueError, match="2-D"):
        select_experts(torch.randn(2, 3, 8), 2, renormalize=False)


def test_group_scoring_max_matches_hf_deepseek_v2_group_limited_greedy() -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    torch.manual_seed(0)
    cfg = DeepseekV2Config(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, hidden_size=32,
                           topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    gate = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(gate.weight)
    x = torch.randn(64, 32)
    _, hf_w, hf_ids = gate(x)
    logits = x @ gate.weight.t()
    w, ids = select_experts(logits, 3, False, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5,
                            group_scoring="max")
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="unknown group_scoring 'min'"):
        select_experts(logits, 3, False, num_expert_group=4, topk_group=2, group_scoring="min")
