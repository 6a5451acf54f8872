"""Expert biases and gpt-oss's clamped SwiGLU (``ExpertMLPExtras``) against transformers' ``GptOssExperts``.

The torch and grouped_mm backends run the routed tokens in both layouts (contiguous with ``-1`` routes, and
the masked buffer whose padding slots hold NaN) over weights de-interleaved as the loader stores them; the
result must equal transformers' module fed the same routing. Backends without the extras refuse by name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts import make_experts
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.types import ClampedSwiGLU, ExpertMLPExtras, ExpertTokens

transformers = pytest.importorskip("transformers")
if TYPE_CHECKING:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

T, H, I, E, K = 12, 32, 16, 4, 2  # noqa: E741  (I: the experts' intermediate size, the kernels' notation)
LIMIT = 0.8  # low enough that both clamps bite


def hf_experts() -> GptOssExperts:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=LIMIT)
    torch.manual_seed(0)
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def ours_from(hf: GptOssExperts) -> tuple[torch.Tensor, torch.Tensor, ExpertMLPExtras]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]`` and the extras from transformers' layout."""
    gu = hf.gate_up_proj.detach().transpose(1, 2)
    w13 = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1)
    b = hf.gate_up_proj_bias.detach()
    extras = ExpertMLPExtras(torch.cat((b[:, 0::2], b[:, 1::2]), dim=1), hf.down_proj_bias.detach(),
                             ClampedSwiGLU(hf.alpha, hf.limit))
    return w13, hf.down_proj.detach().transpose(1, 2).contiguous(), extras


def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x, ids, weights


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_contiguous_equals_transformers(backend: str) -> None:
    hf = hf_experts()
    x, ids, weights = routing()
    with torch.no_grad():
        want = hf(x, ids, weights)
    w13, w2, extras = ours_from(hf)
    out = make_experts(backend).apply(ExpertTokens("contiguous", x, topk_ids=ids, topk_weights=weights), w13, w2,
                                      extras)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    plain = make_experts(backend).apply(ExpertTokens("contiguous", x, topk_ids=ids, topk_weights=weights), w13, w2)
    assert not torch.allclose(plain, want, atol=1e-2)  # the extras matter here
    # a route to an expert on another rank (-1) contributes nothing, bias included
    ids_remote = ids.clone()
    ids_remote[:, 1] = -1
    with torch.no_grad():
        want_one = hf(x, ids[:, :1], weights[:, :1])
    out = make_experts(backend).apply(ExpertTokens("contiguous", x, topk_ids=ids_remote, topk_weights=weights),
                                      w13, w2, extras)
    torch.testing.assert_close(out, want_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_masked_equals_transformers_per_slot(backend: str) -> None:
    hf = hf_experts()
    x, _, _ = routing()
    counts = torch.tensor([3, 0, 5, 1])
    buf = torch.full((E, 6, H), float("nan"))
    for e, n in enumerate(counts.tolist()):
        buf[e, :n] = x[:n]
    w13, w2, extras = ours_from(hf)
    out = make_experts(backend).apply(ExpertTokens("masked", buf, expert_num_tokens=counts), w13, w2, extras)
    for e, n in enumerate(counts.tolist()):
        ids = torch.full((n, 1), e)
        with torch.no_grad():
            want = hf(x[:n], ids, torch.ones(n, 1))
        torch.testing.assert_close(out[e, :n], want, rtol=1e-5, atol=1e-5)
        assert (out[e, n:] == 0).all()


def test_backends_without_extras_refuse_by_name() -> None:
    hf = hf_experts()
    x, ids, weights = routing()
    w13, w2, extras = ours_from(hf)
    tokens = ExpertTokens("contiguous", x, topk_ids=ids, topk_weights=weights)
    with pytest.raises(ValueError, match="experts backend 'triton' does not implement expert biases"):
        make_experts("triton").apply(tokens, w13, w2, extras)
    layer = FusedMoE(E, K, H, I, expert_bias=True, activation=ClampedSwiGLU(),
                     parallel=MoEParallelConfig(experts_backend="triton"))
    with pytest.raises(ValueError, match="use --experts-backend torch or grouped_mm"):
        _ = layer.kernel
