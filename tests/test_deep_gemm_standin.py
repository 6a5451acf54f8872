"""The deep_gemm experts over the CPU DeepGEMM stand-in (``tests/standins/deep_gemm.py``).

First the stand-in itself: the masked grouped fp8 GEMM equals the fp32 product of its dequantised operands
(so every difference from the torch experts below is the fp8 recipe, not the stand-in), writes only the
masked rows, and refuses what DeepGEMM refuses. Then the experts: they match the torch experts within fp8
tolerance on Hopper's and Blackwell's scaling rules, and do not when Blackwell gets scales that are not
powers of two. Last, the whole path on CPU: DeepEP low-latency (stand-in) + DeepGEMM experts, EP vs dense.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moe_harness import dense_reference
from standin_harness import bf16_inputs, bf16_weights, run_standin_ep
from standins import deep_gemm as dg
from ubatch.modular_moe.experts.deep_gemm_experts import (
    DeepGemmExperts,
    per_block_cast_to_fp8,
    per_block_dequant,
    per_token_cast_to_fp8,
    per_token_dequant,
)
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.types import ExpertTokens
from ubatch.testing import stream_sanitizer

E, H, I = 4, 256, 256  # noqa: E741  (I: the experts' intermediate size, the kernels' notation)
# Two fp8 GEMMs with both operands rounded to e4m3 (3 mantissa bits: up to 2^-4 relative each): measured
# 0.06-0.07 of the largest output on these shapes; a wrong scaling rule is an order of magnitude worse.
FP8_REL = 1e-1


@pytest.fixture(autouse=True)
def hopper() -> Iterator[None]:
    """The stand-in's GPU generation is module state: every test starts on SM90 and leaves it there."""
    dg.set_arch_major(9)
    yield
    dg.set_arch_major(9)


def operands(seed: int = 0, m: int = 40) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor],
                                                  torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = per_token_cast_to_fp8(torch.randn(E, m, H, generator=g))
    b = per_block_cast_to_fp8(torch.randn(E, I, H, generator=g) / H**0.5)
    return a, b, torch.tensor([m, 0, 7, m // 2], dtype=torch.int32)


def test_masked_gemm_is_the_product_of_the_dequantised_operands_on_masked_rows_only() -> None:
    a, b, masked_m = operands()
    d = torch.full((E, 40, I), 7.0, dtype=torch.bfloat16)  # a sentinel the kernel must leave where it writes nothing
    dg.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, 40)
    ref = torch.einsum("gmk,gnk->gmn", per_token_dequant(*a), per_block_dequant(*b)).to(torch.bfloat16)
    for grp, rows in enumerate(masked_m.tolist()):
        assert torch.equal(d[grp, :rows], ref[grp, :rows])
        assert bool((d[grp, rows:] == 7.0).all())


def test_old_and_new_names_are_one_function() -> None:
    assert dg.fp8_m_grouped_gemm_nt_masked is dg.m_grouped_fp8_gemm_nt_masked is dg.m_grouped_fp8_fp4_gemm_nt_masked


@pytest.mark.parametrize("fault,match", [
    ("d_fp32", "kBFloat16"),
    ("masked_m_int64", "torch::kInt"),
    ("a_bf16", "kFloat8_e4m3fn"),
    ("a_mn_major", "Major::K"),
    ("sfa_per_block", "sfa: sf.size"),
    ("masked_m_past_m", "masked_m <= m"),
    ("expected_m_zero", "expected_m > 0"),
])
def test_refuses_what_deep_gemm_refuses(fault: str, match: str) -> None:
    (qa, sfa), b, masked_m = operands()
    d = torch.empty(E, 40, I, dtype=torch.bfloat16)
    expected_m = 40
    if fault == "d_fp32":
        d = d.float()
    elif fault == "masked_m_int64":
        masked_m = masked_m.long()
    elif fault == "a_bf16":
        qa = qa.to(torch.bfloat16)
    elif fault == "a_mn_major":
        qa = qa.transpose(1, 2).contiguous().transpose(1, 2)
    elif fault == "sfa_per_block":
        sfa = sfa[:, ::128]
    elif fault == "masked_m_past_m":
        masked_m = masked_m + 41
    else:
        expected_m = 0
    with pytest.raises(RuntimeError, match=match):
        dg.m_grouped_fp8_gemm_nt_masked((qa, sfa), b, d, masked_m, expected_m)


def gemm(arch: int, a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
         masked_m: torch.Tensor) -> torch.Tensor:
    dg.set_arch_major(arch)
    d = torch.zeros(E, a[0].shape[1], I, dtype=torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, 40)
    return d


def test_sm100_keeps_only_each_scales_exponent() -> None:
    """Blackwell reads fp32 scales as UE8M0 (the exponent: each scale rounded down to a power of two)."""
    (qa, sfa), (qb, sfb), masked_m = operands()

    def floor2(sf: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.floor(torch.log2(sf)))

    blackwell = gemm(10, (qa, sfa), (qb, sfb), masked_m)
    assert torch.equal(blackwell, gemm(9, (qa, floor2(sfa)), (qb, floor2(sfb)), masked_m))
    assert not torch.equal(blackwell, gemm(9, (qa, sfa), (qb, sfb), masked_m))
    pow2_a = per_token_cast_to_fp8(per_token_dequant(qa, sfa), use_ue8m0=True)
    pow2_b = per_block_cast_to_fp8(per_block_dequant(qb, sfb), use_ue8m0=True)
    assert torch.equal(gemm(10, pow2_a, pow2_b, masked_m), gemm(9, pow2_a, pow2_b, masked_m))


def expert_case(capacity: int) -> tuple[ExpertTokens, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    x = torch.randn(E, capacity, H, generator=g).bfloat16()
    counts = torch.tensor([min(30, capacity), 0, capacity, 7], dtype=torch.int32)
    return ExpertTokens("masked", x, expert_num_tokens=counts), w13, w2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


@pytest.mark.parametrize("capacity", [40, 128], ids=["capacity_40_padded", "capacity_128"])
@pytest.mark.parametrize("arch,use_ue8m0", [(9, False), (9, True), (10, True)])
def test_deep_gemm_experts_match_torch_experts(arch: int, use_ue8m0: bool, capacity: int) -> None:
    tokens, w13, w2 = expert_case(capacity)
    dg.set_arch_major(arch)
    out = DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=use_ue8m0).apply(tokens, w13, w2)
    ref = TorchExperts().apply(tokens, w13, w2)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert out.is_contiguous()  # DeepEP's low-latency combine asserts it, padded capacity or not
    assert rel_err(out, ref) <= FP8_REL
    assert not out[1].any() and not out[0, 30:].any()  # rows past each expert's count are zeros


def test_blackwell_needs_power_of_two_scales() -> None:
    tokens, w13, w2 = expert_case(40)
    dg.set_arch_major(10)
    out = DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=False).apply(tokens, w13, w2)
    assert rel_err(out, TorchExperts().apply(tokens, w13, w2)) > 3 * FP8_REL


def test_off_cuda_the_gpu_generation_must_be_given() -> None:
    tokens, w13, w2 = expert_case(40)
    with pytest.raises(ValueError, match="pass use_ue8m0"):
        DeepGemmExperts(deep_gemm_module=dg).apply(tokens, w13, w2)


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_deepep_low_latency_with_deep_gemm_experts_equals_dense(dbo: bool) -> None:
    """The production decode path on CPU: DeepEP LL dispatch (stand-in) -> DeepGEMM fp8 experts (stand-in)
    -> DeepEP LL combine, 2 ranks, under the sanitizer; against the dense bf16 reference in fp8 tolerance.
    One layer: a second layer routes by the first one's output, and an fp8-sized difference there can flip a
    near-tie in the top-k, which is not an error of either path."""
    weights, inputs = bf16_weights(layers=1), bf16_inputs(2)
    experts_used: list[DeepGemmExperts] = []

    def make() -> DeepGemmExperts:
        experts_used.append(DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=False))
        return experts_used[-1]

    with stream_sanitizer.sanitizing() as races:
        results = run_standin_ep(weights, inputs, "deepep_low_latency", dbo, experts=make)
    assert races == [], str(races[0])
    assert len(experts_used) == 2  # one per rank (one layer)
    for rank, res in enumerate(results):
        ref = dense_reference(weights, inputs[rank], rank)
        moe = (ref.float() - inputs[rank].float()).abs().max().item()  # size of what the layer added
        err = (res["out"].float() - ref.float()).abs().max().item()
        assert err <= FP8_REL * moe, f"rank {rank}: max err {err:.4g} vs the layers' contribution {moe:.4g}"


# DeepGEMM main at 54e22612409371d6364144b69086735beb54e98b (2026-06-23), csrc/apis/gemm.hpp: the pybind
# ``py::arg`` list of ``m_grouped_fp8_fp4_gemm_nt_masked``, also bound as ``m_grouped_fp8_gemm_nt_masked``
# (``m.attr`` alias) and, in deep_gemm/__init__.py, ``fp8_m_grouped_gemm_nt_masked``. sgl-deep-gemm 0.2.5
# (PyPI, 2026-10-27) has the same parameters plus a trailing ``epilogue=None``.
DEEP_GEMM_MAIN_MASKED_ARGS = ("a", "b", "d", "masked_m", "expected_m", "recipe", "recipe_a", "recipe_b",
                              "compiled_dims", "disable_ue8m0_cast")


def test_the_masked_gemm_the_experts_call_has_deepgemm_mains_name_and_arguments() -> None:
    """The experts resolve DeepGEMM's current name first and pass its five required arguments positionally;
    the stand-in's parameters are upstream's, in order, with the same five required."""
    import inspect

    from ubatch.modular_moe.experts import deep_gemm_experts

    assert deep_gemm_experts._MASKED_GEMM_NAMES[0] == "m_grouped_fp8_fp4_gemm_nt_masked"
    assert "m_grouped_fp8_gemm_nt_masked" in deep_gemm_experts._MASKED_GEMM_NAMES
    assert deep_gemm_experts._resolve_masked_gemm(dg) is dg.m_grouped_fp8_fp4_gemm_nt_masked
    params = inspect.signature(dg.m_grouped_fp8_fp4_gemm_nt_masked).parameters.values()
    assert tuple(p.name for p in params) == DEEP_GEMM_MAIN_MASKED_ARGS
    assert [p.name for p in params if p.default is inspect.Parameter.empty] == list(DEEP_GEMM_MAIN_MASKED_ARGS[:5])
