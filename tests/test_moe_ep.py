"""Expert-parallel MoE equals the dense single-rank reference, with DBO off and on, for every CPU backend.

Every equality also shows that what it compares was active: :func:`check` asserts the DBO yields of every
DBO run, the emulated-link test that the link carried every transfer, and the zero-receive test the exact
per-(layer, ubatch, rank) receive counts it forced, zeros included.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_harness import StackWeights, dense_reference, expected_receives, halves, link_bytes, run_ep
from ubatch.modular_moe.prepare_finalize import make_prepare_finalize
from ubatch.modular_moe.prepare_finalize.emulated_link import LinkSpec

REL_TOL = 1e-5  # max error relative to the output's magnitude (fp32 summation order differs from the reference)


def rank_inputs(sizes: list[int], hidden: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in sizes]


# Yields per MoE layer per ubatch under DBO: every backend here parks its dispatch and its combine receive on
# the other ubatch. Stated here, not read back from the backend, so a backend that stopped yielding fails.
YIELDS_PER_LAYER = 2


def check(weights: StackWeights, inputs: list[torch.Tensor], results: list[dict[str, Any]]) -> None:
    """Each rank's output equals the dense reference, and a DBO run really ran as two ubatches that yielded
    at every layer (an equality between "DBO" and dense proves nothing if DBO never switched)."""
    for rank, (x, res) in enumerate(zip(inputs, results, strict=True)):
        ref = dense_reference(weights, x, rank)
        assert res["out"].shape == ref.shape
        if ref.numel():
            err = (res["out"] - ref).abs().max().item()
            assert err <= REL_TOL * ref.abs().max().item(), f"max error {err} vs magnitude {ref.abs().max().item()}"
        expected = [len(weights.gates) * YIELDS_PER_LAYER] * 2 if res["dbo"] else []
        assert res["yields"] == expected, f"rank {rank}: yields {res['yields']}, expected {expected}"


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
    check(weights, inputs, results)  # under DBO: the same yields on every ubatch and rank
    assert all(res["per_layer"] == YIELDS_PER_LAYER for res in results)  # and the backend says so too


def forced_routes(sizes: list[int]) -> list[list[torch.Tensor]]:
    """Two layers over 4 ranks x 2 experts (rank r owns experts 2r, 2r+1), every row routed explicitly:

    - layer 0: every token picks experts 0 and 1, so ranks 1, 2 and 3 receive nothing in any ubatch;
    - layer 1: a rank's first-half tokens (its ubatch 0 under DBO) pick experts 2 and 3 (rank 1), its
      second-half tokens experts 4 and 7 (ranks 2 and 3). Under DBO ubatch 0 reaches rank 1 only and
      ubatch 1 ranks 2 and 3 only; rank 0 receives nothing in layer 1 with or without DBO.
    """
    layer0, layer1 = [], []
    for n in sizes:
        first = halves(n)[0].num_tokens
        layer0.append(torch.tensor([[0, 1]] * n, dtype=torch.int64).view(n, 2))
        layer1.append(torch.tensor([[2, 3]] * first + [[4, 7]] * (n - first), dtype=torch.int64).view(n, 2))
    return [layer0, layer1]


@pytest.mark.parametrize("backend", ["torch_ll", "torch_ht"])
@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
def test_uneven_routing_with_ranks_receiving_nothing(backend: str, dbo: bool) -> None:
    sizes = [6, 4, 1, 8]  # under DBO halves(1) gives rank 2 an empty *first* ubatch: it sends nothing there
    weights = StackWeights.random(seed=3, routes=forced_routes(sizes))
    inputs = rank_inputs(sizes, seed=4)
    results = run_ep(weights, inputs, backend, dbo=dbo)
    check(weights, inputs, results)
    received = [res["received"] for res in results]
    assert weights.routes is not None
    assert received == expected_receives(weights.routes, sizes, 8, dbo)
    # the intended zeros, spelled out: (rank, layer, ubatch) that receive nothing
    zeros = {(r, 0, u) for r in (1, 2, 3) for u in range(2 if dbo else 1)}
    zeros |= {(0, 1, 0), (2, 1, 0), (3, 1, 0), (0, 1, 1), (1, 1, 1)} if dbo else {(0, 1, 0)}
    assert {(r, layer, u) for r, got in enumerate(received) for (layer, u), n in got.items() if n == 0} == zeros
    tokens = sum(sizes)
    if dbo:  # rank 0 gets all of layer 0; ubatch 0 holds 3 + 2 + 0 + 4 tokens, ubatch 1 the other 10
        assert received[0][(0, 0)] == 2 * 9 and received[0][(0, 1)] == 2 * 10
        assert received[1][(1, 0)] == 2 * 9 and received[2][(1, 1)] == received[3][(1, 1)] == 10
    else:
        assert received[0][(0, 0)] == 2 * tokens and received[1][(1, 0)] == 2 * 9


@pytest.mark.parametrize("dbo", [False, True], ids=["no-dbo", "dbo"])
@pytest.mark.triton_interpreter
def test_triton_experts_over_two_ranks(dbo: bool) -> None:
    weights = StackWeights.random(layers=1)
    inputs = rank_inputs([5, 6])
    for backend in ("torch_ll", "torch_ht"):
        check(weights, inputs, run_ep(weights, inputs, backend, experts="triton", dbo=dbo))


def test_emulated_link_keeps_results_exact() -> None:
    weights = StackWeights.random()
    sizes = [6, 5]
    inputs = rank_inputs(sizes)
    results = run_ep(weights, inputs, "torch_ll", dbo=True, emulate_link="latency_us=200,gbps=1")
    check(weights, inputs, results)
    layers = len(weights.gates)
    for n, res in zip(sizes, results, strict=True):  # the link carried both directions of every layer and ubatch
        assert res["link"] == (2 * layers * 2, link_bytes(n, weights.top_k, 16, layers))


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
    from runner.distributed.launch import launch

    weights = StackWeights.random()
    inputs = rank_inputs([7, 4])
    check(weights, inputs, launch(process_rank_main, 2, (weights, inputs, backend, True), timeout_s=60,
                                  device="cpu"))  # the harness's tensors are CPU ones: gloo


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
    for bound, expected in [(1, 1), (3, 3), (20, 20), (64, 64), (100, 64)]:
        with set_forward_context(dp_metadata=DPMetadata((bound, 0), step_token_bound=bound)):
            assert pf.step_capacity(1) == expected
    with (
        set_forward_context(dp_metadata=DPMetadata((4, 1), step_token_bound=4)),
        pytest.raises(ValueError, match="5 tokens exceed the step's agreed token bound 4"),
    ):
        pf.step_capacity(5)
