"""Expert-parallel MoE equals the dense single-rank reference, with DBO off and on, for every CPU backend."""
from __future__ import annotations

import pytest
import torch

from moe_harness import StackWeights, dense_reference, run_ep
from ubatch.modular_moe.prepare_finalize import make_prepare_finalize
from ubatch.modular_moe.prepare_finalize.emulated_link import LinkSpec

REL_TOL = 1e-5  # max error relative to the output's magnitude (fp32 summation order differs from the reference)


def rank_inputs(sizes: list[int], hidden: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in sizes]


def check(weights: StackWeights, inputs: list[torch.Tensor], results: list[dict]) -> None:
    for x, res in zip(inputs, results):
        ref = dense_reference(weights, x)
        assert res["out"].shape == ref.shape
        if ref.numel():
            err = (res["out"] - ref).abs().max().item()
            assert err <= REL_TOL * ref.abs().max().item(), f"max error {err} vs magnitude {ref.abs().max().item()}"


CASES = [
    ("none", [9]),
    ("torch_ll", [9]),
    ("torch_ll", [7, 12]),
    ("torch_ll", [5, 0, 9, 3]),
    ("torch_ht", [9]),
    ("torch_ht", [7, 12]),
    ("torch_ht", [5, 0, 9, 3]),
]


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.parametrize("backend,sizes", CASES, ids=[f"{b}-ws{len(s)}" for b, s in CASES])
def test_ep_equals_dense(backend: str, sizes: list[int], dbo: bool) -> None:
    weights = StackWeights.random()
    inputs = rank_inputs(sizes)
    results = run_ep(weights, inputs, backend, dbo=dbo)
    check(weights, inputs, results)
    if dbo:
        for res in results:  # same yields on every ubatch and rank, per backend style
            assert res["yields"] == [len(weights.gates) * res["per_layer"]] * 2
        assert results[0]["per_layer"] == {"none": 2, "torch_ll": 2, "torch_ht": 3}[backend]


@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_uneven_routing_with_ranks_receiving_nothing(backend: str, dbo: bool) -> None:
    weights = StackWeights.random(skew_to_expert0=True, seed=3)
    inputs = rank_inputs([6, 4, 1, 8], seed=4)  # rank 2's second ubatch is empty under DBO
    check(weights, inputs, run_ep(weights, inputs, backend, dbo=dbo))


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_triton_experts_over_two_ranks(dbo: bool) -> None:
    weights = StackWeights.random(layers=1)
    inputs = rank_inputs([5, 6])
    for backend in ("torch_ll", "torch_ht"):
        check(weights, inputs, run_ep(weights, inputs, backend, experts="triton", dbo=dbo))


def test_emulated_link_keeps_results_exact() -> None:
    weights = StackWeights.random()
    inputs = rank_inputs([6, 6])
    check(weights, inputs, run_ep(weights, inputs, "torch_ll", dbo=True, emulate_link="latency_us=200,gbps=1"))


def test_capacity_overflow_raises() -> None:
    weights = StackWeights.random()
    inputs = rank_inputs([10, 10])
    with pytest.raises(ValueError, match=r"10 tokens on rank \d exceed num_max_dispatch_tokens_per_rank=8"):
        run_ep(weights, inputs, "torch_ll", capacity=8)


def test_backend_selection_errors() -> None:
    with pytest.raises(ValueError, match="unknown all2all backend 'pplx'"):
        make_prepare_finalize("pplx", num_experts=8, hidden_size=16)
    with pytest.raises(ValueError, match="'none' all2all backend serves one rank; got ep_size=2"):
        make_prepare_finalize("none", num_experts=8, hidden_size=16, ep_size=2, ep_rank=1)
    with pytest.raises(ValueError, match="needs expert-parallel process groups"):
        make_prepare_finalize("torch_ll", num_experts=8, hidden_size=16, ep_size=2)
    if torch.cuda.is_available():
        return
    with pytest.raises((ImportError, RuntimeError), match="deep_ep|CUDA"):
        make_prepare_finalize("deepep_low_latency", num_experts=8, hidden_size=16, ep_size=2, groups=[object()])


def test_link_spec_parsing() -> None:
    spec = LinkSpec.parse("latency_us=50,gbps=10")
    assert spec == LinkSpec(50.0, 10.0)
    assert spec.seconds(10_000) == pytest.approx(50e-6 + 1e-6)
    for bad, msg in [("latency=5", "bad --emulate-link item 'latency=5'"),
                     ("gbps=fast", "bad --emulate-link value 'fast' for gbps"),
                     ("gbps=0", "gbps must be > 0, got 0.0"), ("", "empty --emulate-link spec")]:
        with pytest.raises(ValueError, match=msg):
            LinkSpec.parse(bad)


@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
def test_ep_equals_dense_over_real_processes(backend: str) -> None:
    from moe_harness import process_rank_main
    from runner.launch import launch

    weights = StackWeights.random()
    inputs = rank_inputs([7, 4])
    outs = launch(process_rank_main, 2, (weights, inputs, backend, True), timeout_s=60)
    check(weights, inputs, [{"out": o} for o in outs])


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_torch_ll_with_the_dp_token_bound_equals_dense(dbo: bool) -> None:
    weights = StackWeights.random()
    inputs = rank_inputs([7, 12])
    check(weights, inputs, run_ep(weights, inputs, "torch_ll", dbo=dbo, capacity=64, dp_bound=12))


def test_torch_ll_step_capacity() -> None:
    from ubatch import set_forward_context
    from ubatch.forward_context import DPMetadata
    from ubatch.modular_moe.prepare_finalize.torch_ll import TorchLowLatency

    pf = TorchLowLatency(8, 0, 2, groups=[None, None], max_dispatch_tokens_per_rank=64)
    assert pf.step_capacity(5) == 64  # no forward context: the configured capacity
    for bound, expected in [(1, 1), (3, 4), (20, 32), (64, 64), (100, 64)]:
        with set_forward_context(dp_metadata=DPMetadata((bound, 0))):
            assert pf.step_capacity(1) == expected
    with set_forward_context(dp_metadata=DPMetadata((4, 1))):
        with pytest.raises(ValueError, match="5 tokens exceed the step's max_tokens_across_dp=4"):
            pf.step_capacity(5)
