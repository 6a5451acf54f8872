"""FP8 expert weights (``ubatch/fp8.py``): block quantisation with partial blocks, W8A16 through any backend, and
the DeepGEMM experts on a checkpoint's own FP8 weights and scales (over the CPU stand-in, ``tests/standins``)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from standins import deep_gemm as dg
from ubatch.fp8 import FP8_DTYPE, FP8_MAX, Fp8Tensor, dequantize_blocks, quantize_blocks, scale_shape
from ubatch.modular_moe.experts.deep_gemm_experts import DeepGemmExperts
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.experts.triton_configs import TritonMoEConfig
from ubatch.modular_moe.types import ExpertTokens

E, H, I = 4, 256, 256  # noqa: E741  (I: the experts' intermediate size, the kernels' notation)
FP8_REL = 1e-1  # as tests/test_deep_gemm_standin.py: two GEMMs with e4m3 activations


@pytest.fixture(autouse=True)
def hopper() -> Iterator[None]:
    dg.set_arch_major(9)
    yield
    dg.set_arch_major(9)


def test_block_quantisation_with_partial_blocks_is_within_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 576, 200, generator=g)  # 4.5 x 1.5625 blocks, as DeepSeek-V3's kv_a_proj_with_mqa rows
    q, scale = quantize_blocks(w, (128, 128))
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.shape == (3, 5, 2) == (3, *scale_shape(576, 200, (128, 128)))
    assert q.float().abs().amax() == FP8_MAX  # each block's largest entry maps to the largest e4m3 value
    back = dequantize_blocks(q, scale, (128, 128))
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 of each entry (normal range)
    big = w.abs() > scale.repeat_interleave(128, 1)[:, :576].repeat_interleave(128, 2)[..., :200] * 2 ** -6
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[big].all()
    last = w[:, 512:, 128:]  # the partial corner block has a scale of its own
    assert torch.allclose(scale[:, 4, 1], last.abs().amax(dim=(-2, -1)) / FP8_MAX)


def fp8_experts(i: int = I, block: tuple[int, int] = (128, 128), seed: int = 0) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Experts as a checkpoint holds them: gate, up and down quantised one matrix at a time."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, i, H, generator=g) / H ** 0.5 for _ in range(2))
    down = torch.randn(E, H, i, generator=g) / i ** 0.5
    (qg, sg), (qu, su) = quantize_blocks(gate, block), quantize_blocks(up, block)
    w13 = Fp8Tensor(torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1), block, row_shards=2)
    return w13, Fp8Tensor(*quantize_blocks(down, block), block)


def test_fused_gate_up_dequantises_each_projection_with_its_own_grid() -> None:
    w13, _ = fp8_experts(i=96)  # 96 rows: 0.75 of a block each, so the two grids are not one grid
    assert not w13.uniform_grid() and w13.scale.shape == (E, 2, 2)
    half = w13.data.shape[1] // 2
    gate = dequantize_blocks(w13.data[:, :half], w13.scale[:, :1], (128, 128))
    up = dequantize_blocks(w13.data[:, half:], w13.scale[:, 1:], (128, 128))
    assert torch.equal(w13.dequantize(torch.float32), torch.cat([gate, up], dim=1))
    assert fp8_experts()[0].uniform_grid()


def masked_tokens(capacity: int = 40) -> ExpertTokens:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(E, capacity, H, generator=g).bfloat16()
    return ExpertTokens("masked", x, expert_num_tokens=torch.tensor([30, 0, capacity, 7], dtype=torch.int32))


def contiguous_tokens() -> ExpertTokens:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, H, generator=g)
    ids = torch.randint(-1, E, (12, 2), generator=g)
    return ExpertTokens("contiguous", x, topk_ids=ids, topk_weights=torch.rand(12, 2, generator=g))


@pytest.mark.parametrize("tokens", [masked_tokens(), contiguous_tokens()], ids=["masked", "contiguous"])
def test_a_backend_without_fp8_kernels_runs_the_dequantised_weights(tokens: ExpertTokens) -> None:
    w13, w2 = fp8_experts(i=96)
    dtype = tokens.hidden.dtype
    out = TorchExperts().run(tokens, w13, w2)
    assert torch.equal(out, TorchExperts().apply(tokens, w13.dequantize(dtype), w2.dequantize(dtype)))


def test_fp8_and_plain_weights_do_not_mix() -> None:
    w13, w2 = fp8_experts()
    with pytest.raises(TypeError, match="both be FP8 or both plain"):
        TorchExperts().run(masked_tokens(), w13, w2.dequantize(torch.bfloat16))


class Recording:
    """The stand-in module, recording the weight operand of every masked GEMM."""

    def __init__(self) -> None:
        self.b: list[tuple[torch.Tensor, torch.Tensor]] = []

    def m_grouped_fp8_gemm_nt_masked(self, a: Any, b: Any, *args: Any) -> None:
        self.b.append(b)
        dg.m_grouped_fp8_gemm_nt_masked(a, b, *args)


@pytest.mark.parametrize("capacity", [40, 128])
@pytest.mark.parametrize("arch,use_ue8m0", [(9, False), (10, True)], ids=["sm90", "sm100_ue8m0"])
def test_deep_gemm_experts_on_checkpoint_fp8_weights_match_torch_on_the_dequantised(arch: int, use_ue8m0: bool,
                                                                                    capacity: int) -> None:
    tokens = masked_tokens(capacity)
    w13, w2 = fp8_experts()
    dg.set_arch_major(arch)
    module = Recording()
    experts = DeepGemmExperts(deep_gemm_module=module, use_ue8m0=use_ue8m0)
    out = experts.run(tokens, w13, w2)
    ref = TorchExperts().apply(tokens, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16))
    err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert out.shape == ref.shape and err <= FP8_REL
    assert not out[1].any() and not out[0, 30:].any()
    if not use_ue8m0:  # Hopper: the checkpoint's own values and scales, nothing requantised
        assert module.b[0][0] is w13.data and torch.equal(module.b[0][1], w13.scale)
        assert module.b[1][0] is w2.data
    else:  # Blackwell: requantised once to power-of-two scales, then cached
        assert torch.equal(torch.exp2(torch.log2(module.b[0][1]).round()), module.b[0][1])
        experts.run(tokens, w13, w2)
        assert module.b[2][0] is module.b[0][0]


@pytest.mark.parametrize("i, block, match", [
    (96, (128, 128), "intermediate size \\(96\\) to be a multiple of 128"),
    (I, (64, 64), "needs 128 x 128 weight blocks on one grid; w13 has \\(64, 64\\) blocks"),
])
def test_deep_gemm_refuses_fp8_weights_off_its_block_grid(i: int, block: tuple[int, int], match: str) -> None:
    w13, w2 = fp8_experts(i=i, block=block)
    with pytest.raises(ValueError, match=match):
        DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=False).run(masked_tokens(), w13, w2)


TRITON_CONFIG = TritonMoEConfig(block_m=16, block_n=64, block_k=32)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("block", [(128, 128), (32, 48)], ids=["one_partial_block", "blocks_straddling_tiles"])
def test_triton_experts_dequantise_fp8_blocks_in_the_kernel(layout: str, block: tuple[int, int]) -> None:
    """fp32 activations: the kernels' per-element scales give the torch experts' result on the dequantised
    weights up to fp32 summation order; intermediate 48 puts gate and up on two grids that do not line up."""
    from ubatch.modular_moe.experts.triton_experts import TritonExperts

    e, h, i = 4, 64, 48
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(e, i, h, generator=g) / h ** 0.5 for _ in range(2))
    (qg, sg), (qu, su) = quantize_blocks(gate, block), quantize_blocks(up, block)
    w13 = Fp8Tensor(torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1), block, row_shards=2)
    w2 = Fp8Tensor(*quantize_blocks(torch.randn(e, h, i, generator=g) / i ** 0.5, block), block)
    if layout == "masked":
        tokens = ExpertTokens("masked", torch.randn(e, 12, h, generator=g),
                              expert_num_tokens=torch.tensor([5, 0, 12, 1]))
    else:
        ids = torch.randint(-1, e, (10, 2), generator=g)
        tokens = ExpertTokens("contiguous", torch.randn(10, h, generator=g), topk_ids=ids,
                              topk_weights=torch.rand(10, 2, generator=g))
    out = TritonExperts(config=TRITON_CONFIG).run(tokens, w13, w2)
    ref = TorchExperts().apply(tokens, w13.dequantize(torch.float32), w2.dequantize(torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def routed_tokens(dtype: torch.dtype = torch.bfloat16) -> ExpertTokens:
    """Contiguous tokens with a route to another rank (-1), a token routed nowhere and an expert with none."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, E - 1, (20, 2), generator=g)
    ids[0, 1], ids[5] = -1, -1
    return ExpertTokens("contiguous", torch.randn(20, H, generator=g).to(dtype), topk_ids=ids,
                        topk_weights=torch.rand(20, 2, generator=g))


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["checkpoint_fp8", "bf16_quantised_at_run_time"])
@pytest.mark.parametrize("arch,use_ue8m0", [(9, False), (10, True)], ids=["sm90", "sm100_ue8m0"])
def test_deep_gemm_contiguous_layout_matches_torch_experts(fp8_weights: bool, arch: int, use_ue8m0: bool) -> None:
    """Prefill's layout: routes grouped by expert, each group padded to DeepGEMM's M alignment."""
    tokens = routed_tokens()
    w13, w2 = fp8_experts()
    dg.set_arch_major(arch)
    experts = DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=use_ue8m0)
    bf13, bf2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    out = experts.run(tokens, w13, w2) if fp8_weights else experts.run(tokens, bf13, bf2)
    ref = TorchExperts().apply(tokens, bf13, bf2)
    err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and err <= FP8_REL
    assert not out[5].any()  # a token routed to no local expert gets nothing


def test_contiguous_stand_in_skips_padding_rows() -> None:
    g = torch.Generator().manual_seed(5)
    qa = quantize_blocks(torch.randn(256, H, generator=g), (1, 128))
    qb = quantize_blocks(torch.randn(2, I, H, generator=g), (128, 128))
    layout = torch.tensor([0] * 100 + [-1] * 28 + [1] * 128, dtype=torch.int32)
    d = torch.full((256, I), 7.0, dtype=torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, d, layout)
    a, b = dequantize_blocks(*qa, (1, 128)), dequantize_blocks(*qb, (128, 128))
    assert torch.equal(d[:100], (a[:100] @ b[0].t()).bfloat16())
    assert torch.equal(d[128:], (a[128:] @ b[1].t()).bfloat16())
    assert bool((d[100:128] == 7.0).all())


# DeepGEMM main 54e2261, csrc/apis/gemm.hpp: the py::arg list of ``m_grouped_fp8_fp4_gemm_nt_contiguous`` (also
# bound as ``m_grouped_fp8_gemm_nt_contiguous``)
DEEP_GEMM_MAIN_CONTIGUOUS_ARGS = ("a", "b", "d", "grouped_layout", "recipe", "recipe_a", "recipe_b",
                                  "compiled_dims", "disable_ue8m0_cast", "use_psum_layout", "ensure_zero_padding",
                                  "expected_m_for_psum_layout")


def test_the_contiguous_stand_in_has_deepgemm_mains_name_and_arguments() -> None:
    import inspect

    assert dg.m_grouped_fp8_fp4_gemm_nt_contiguous is dg.m_grouped_fp8_gemm_nt_contiguous
    params = inspect.signature(dg.m_grouped_fp8_gemm_nt_contiguous).parameters.values()
    assert tuple(p.name for p in params) == DEEP_GEMM_MAIN_CONTIGUOUS_ARGS
    assert [p.name for p in params if p.default is inspect.Parameter.empty] == list(DEEP_GEMM_MAIN_CONTIGUOUS_ARGS[:4])


def test_deep_gemm_contiguous_layout_with_no_local_route_gives_zeros() -> None:
    tokens = routed_tokens()
    assert tokens.topk_ids is not None
    tokens.topk_ids.fill_(-1)
    w13, w2 = fp8_experts()
    out = DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=False).run(tokens, w13, w2)
    assert out.shape == tokens.hidden.shape and not out.any()


@pytest.mark.parametrize("dbo", [False, True], ids=["dbo_off", "dbo_on"])
def test_deepep_high_throughput_with_deep_gemm_experts_equals_dense(dbo: bool) -> None:
    """The prefill path on CPU: DeepEP HT dispatch (stand-in, contiguous layout) -> DeepGEMM contiguous fp8
    experts (stand-in) -> HT combine, 2 ranks; against the dense bf16 reference in fp8 tolerance (one layer, as
    tests/test_deep_gemm_standin.py's low-latency case)."""
    from moe_harness import dense_reference
    from standin_harness import bf16_inputs, bf16_weights, run_standin_ep

    weights, inputs = bf16_weights(layers=1), bf16_inputs(2)
    results = run_standin_ep(weights, inputs, "deepep_high_throughput", dbo,
                             experts=lambda: DeepGemmExperts(deep_gemm_module=dg, use_ue8m0=False))
    for rank, res in enumerate(results):
        ref = dense_reference(weights, inputs[rank], rank)
        moe = (ref.float() - inputs[rank].float()).abs().max().item()
        err = (res["out"].float() - ref.float()).abs().max().item()
        assert err <= FP8_REL * moe, f"rank {rank}: max err {err:.4g} vs the layer's contribution {moe:.4g}"
