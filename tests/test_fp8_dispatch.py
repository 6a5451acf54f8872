"""DeepEP's FP8 low-latency dispatch into the DeepGEMM experts, over the CPU stand-ins (``tests/standins``).

First the stand-in's ``low_latency_dispatch(use_fp8=True)``: the return layout of ``deep_ep/buffers/legacy.py``
(fp8 values, fp32 per-128-column scales column-major, UE8M0 packed four to an int32), values within e4m3 rounding
of the tokens, power-of-two scales with ``round_scale``, DeepEP's refusals. Then the contract: FP8 ``ExpertTokens``
are masked with scales, and only experts that take FP8 activations get them. Last the path: DeepEP LL (FP8) ->
DeepGEMM masked GEMM on the dispatched values and scales -> combine, 2 ranks under the sanitizer; DBO and no-DBO
give the same output, and it is within the FP8 tolerance of the dense bf16 reference.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from moe_harness import dense_reference
from standin_harness import CAPACITY, EXPERTS, HIDDEN, bf16_inputs, bf16_weights, run_standin_ep
from standins import deep_ep as standin
from standins import deep_gemm as dg
from ubatch.modular_moe.experts.base import ExpertWeight
from ubatch.modular_moe.experts.deep_gemm_experts import DeepGemmExperts
from ubatch.modular_moe.experts.torch_experts import TorchExperts
from ubatch.modular_moe.prepare_finalize import make_prepare_finalize
from ubatch.modular_moe.types import ExpertMLPExtras, ExpertTokens
from ubatch.testing import stream_sanitizer
from ubatch.testing.thread_ranks import run_thread_ranks

FP8_REL = 1e-1  # as tests/test_deep_gemm_standin.py: two GEMMs with e4m3 activations, measured 0.06-0.07
E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself


def on_two_ranks(body: Callable[[int, Any], Any]) -> list[Any]:
    return run_thread_ranks(2, lambda rank, groups: body(rank, groups[0]), num_groups=1, timeout_s=60)


def ll_buffer(group: Any) -> standin.Buffer:
    nbytes = standin.Buffer.get_low_latency_rdma_size_hint(CAPACITY, HIDDEN, group.size(), EXPERTS)
    return standin.Buffer(group, num_rdma_bytes=nbytes, low_latency_mode=True, num_qps_per_rank=EXPERTS // 2)


def tokens_to_expert_zero(rank: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` tokens per rank, each to local expert 0 of rank 0 and of rank 1; token scales vary widely."""
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(n, HIDDEN, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)).bfloat16()
    return x, torch.tensor([[0, EXPERTS // 2]] * n)


# ---- the stand-in's FP8 dispatch ----------------------------------------------------------------------
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_dispatch_returns_deepeps_layout_and_the_tokens_within_e4m3_rounding(round_scale: bool) -> None:
    def body(rank: int, group: Any) -> None:
        x, topk = tokens_to_expert_zero(rank)
        (values, scales), count, _handle, _event, hook = ll_buffer(group).low_latency_dispatch(
            x, topk, CAPACITY, EXPERTS, use_fp8=True, round_scale=round_scale, return_recv_hook=True)
        assert hook is not None
        hook()
        e_loc, cap = EXPERTS // 2, 2 * CAPACITY
        assert values.dtype == torch.float8_e4m3fn and tuple(values.shape) == (e_loc, cap, HIDDEN)
        assert scales.dtype == torch.float32 and tuple(scales.shape) == (e_loc, cap, HIDDEN // 128)
        assert scales.stride() == (HIDDEN // 128 * cap, 1, cap)  # column-major in the last two dims (TMA)
        assert count.tolist() == [10, 0, 0, 0]
        got = values[0, :10].float() * scales[0, :10].repeat_interleave(128, dim=1)
        sent = torch.cat([tokens_to_expert_zero(r)[0] for r in range(2)]).float()  # source ranks in order
        assert bool(((got - sent).abs() <= E4M3_REL * sent.abs() + 2.0**-10 * scales[0, :10].repeat_interleave(
            128, dim=1)).all())
        amax = sent.view(10, -1, 128).abs().amax(-1).clamp(min=1e-4)
        if round_scale:
            assert torch.equal(scales[0, :10], torch.exp2(torch.ceil(torch.log2(amax / 448))))
        else:
            assert torch.allclose(scales[0, :10], amax / 448, rtol=2**-22, atol=0)

    on_two_ranks(body)


def test_ue8m0_scales_come_packed_and_need_round_scale() -> None:
    def body(rank: int, group: Any) -> None:
        x, topk = tokens_to_expert_zero(rank)
        buf = ll_buffer(group)
        with pytest.raises(RuntimeError, match="round_scale"):
            buf.low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=True, use_ue8m0=True)
        (values, packed), *_ = ll_buffer(group).low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=True,
                                                                     round_scale=True, use_ue8m0=True)
        (_, scales), *_ = ll_buffer(group).low_latency_dispatch(x, topk, CAPACITY, EXPERTS, use_fp8=True,
                                                                round_scale=True)
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (EXPERTS // 2, 2 * CAPACITY, HIDDEN // 512)
        exponents = packed[0, :10].contiguous().view(torch.uint8).float()  # four per int32, lowest byte first
        assert torch.equal(torch.exp2(exponents - 127), scales[0, :10])

    on_two_ranks(body)


def test_only_deepep_low_latency_dispatches_fp8_and_says_why_not() -> None:
    def body(rank: int, group: Any) -> tuple[str | None, str | None, str | None]:
        def make(name: str) -> Any:
            return make_prepare_finalize(name, num_experts=EXPERTS, hidden_size=HIDDEN, ep_rank=rank, ep_size=2,
                                         groups=[group], max_dispatch_tokens_per_rank=CAPACITY,
                                         deep_ep_module=standin)

        ll = make("deepep_low_latency")
        return ll.fp8_dispatch_for(HIDDEN), ll.fp8_dispatch_for(HIDDEN + 128), make("torch_ll").fp8_dispatch_for(HIDDEN)

    for ok, odd, torch_ll in on_two_ranks(body):
        assert ok is None
        assert odd is not None and "multiple of 512, got 2176" in odd
        assert torch_ll == "torch_ll dispatches the activations' own dtype only"


# ---- the contract -------------------------------------------------------------------------------------
def test_fp8_expert_tokens_are_masked_with_per_128_column_scales() -> None:
    q = torch.zeros(2, 4, 256, dtype=torch.float8_e4m3fn)
    count = torch.tensor([1, 0], dtype=torch.int32)
    assert ExpertTokens("masked", q, expert_num_tokens=count, hidden_scales=torch.ones(2, 4, 2)).output_dtype \
        == torch.bfloat16
    with pytest.raises(ValueError, match="only with"):
        ExpertTokens("masked", q, expert_num_tokens=count)
    with pytest.raises(ValueError, match=r"fp32 hidden_scales \(2, 4, 2\)"):
        ExpertTokens("masked", q, expert_num_tokens=count, hidden_scales=torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="only with"):
        ExpertTokens("masked", q.bfloat16(), expert_num_tokens=count, hidden_scales=torch.ones(2, 4, 2))


def test_experts_that_take_no_fp8_activations_refuse_them() -> None:
    tokens = ExpertTokens("masked", torch.zeros(2, 4, 256, dtype=torch.float8_e4m3fn),
                          expert_num_tokens=torch.tensor([1, 0], dtype=torch.int32), hidden_scales=torch.ones(2, 4, 2))
    with pytest.raises(TypeError, match="'torch' does not take FP8 activations"):
        TorchExperts().run(tokens, torch.zeros(2, 512, 256), torch.zeros(2, 256, 256))


# ---- DeepEP LL (FP8) -> DeepGEMM experts -> combine -----------------------------------------------------
class RecordingDeepGemm(DeepGemmExperts):
    """The DeepGEMM experts (stand-in module, SM90 rules), noting the dtype of every buffer they are handed."""

    def __init__(self, seen: list[torch.dtype], use_ue8m0: bool = False) -> None:
        super().__init__(deep_gemm_module=dg, use_ue8m0=use_ue8m0)
        self.seen = seen

    def run(self, tokens: ExpertTokens, w13: ExpertWeight, w2: ExpertWeight,
            extras: ExpertMLPExtras | None = None) -> torch.Tensor:
        self.seen.append(tokens.hidden.dtype)
        return super().run(tokens, w13, w2, extras)


def run_fp8_path(dbo: bool, use_ue8m0: bool = False) -> tuple[list[dict[str, Any]], list[torch.dtype]]:
    weights, inputs = bf16_weights(layers=1), bf16_inputs(2)
    seen: list[torch.dtype] = []
    with stream_sanitizer.sanitizing() as races:
        results = run_standin_ep(weights, inputs, "deepep_low_latency", dbo,
                                 experts=lambda: RecordingDeepGemm(seen, use_ue8m0))
    assert races == [], str(races[0])
    return results, seen


@pytest.fixture
def gpu_generation() -> Iterator[Callable[[int], None]]:
    """Set the DeepGEMM stand-in's GPU generation for one test (module state), back to SM90 after it."""
    yield dg.set_arch_major
    dg.set_arch_major(9)


@pytest.mark.parametrize("arch", [9, 10], ids=["hopper", "blackwell"])
def test_fp8_dispatch_into_deep_gemm_is_the_same_with_and_without_dbo_and_within_fp8_of_dense(
        arch: int, gpu_generation: Callable[[int], None]) -> None:
    """Per-token quantisation and per-row GEMMs make each token's result independent of how the batch is cut,
    so DBO changes nothing; against the dense bf16 reference the FP8 rounding of activations and weights (one
    layer: a second would route by the first's output, where an FP8-sized change can flip a near-tie). On
    Blackwell the experts ask the dispatch for power-of-two scales, which the GEMM's UE8M0 reading keeps exactly."""
    gpu_generation(arch)
    weights, inputs = bf16_weights(layers=1), bf16_inputs(2)
    plain, seen_plain = run_fp8_path(dbo=False, use_ue8m0=arch == 10)
    ubatched, seen_dbo = run_fp8_path(dbo=True, use_ue8m0=arch == 10)
    assert seen_plain and set(seen_plain) == set(seen_dbo) == {torch.float8_e4m3fn}  # FP8 came over the wire
    assert len(seen_dbo) == 2 * len(seen_plain)  # two ubatches
    for rank in range(2):
        assert torch.equal(plain[rank]["out"], ubatched[rank]["out"]), f"rank {rank}: DBO changed the output"
        ref = dense_reference(weights, inputs[rank], rank)
        moe = (ref.float() - inputs[rank].float()).abs().max().item()
        err = (plain[rank]["out"].float() - ref.float()).abs().max().item()
        assert err <= FP8_REL * moe, f"rank {rank}: max err {err:.4g} vs the layer's contribution {moe:.4g}"


def test_blackwell_gets_power_of_two_scales_from_the_dispatch(gpu_generation: Callable[[int], None]) -> None:
    """Without ``round_scale`` the SM100 GEMM would truncate each scale to its exponent: the kernel must ask."""
    experts = RecordingDeepGemm([], use_ue8m0=True)
    assert experts.wants_power_of_two_scales(torch.device("cpu"))
    assert not RecordingDeepGemm([]).wants_power_of_two_scales(torch.device("cpu"))
    assert not TorchExperts().wants_power_of_two_scales(torch.device("cpu"))
