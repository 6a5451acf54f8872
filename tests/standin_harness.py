"""The MoE test stack over the DeepEP / DeepGEMM stand-ins: bf16, DeepEP-sized, thread ranks over gloo.

DeepEP's low-latency kernels take bf16 activations of a few fixed hidden sizes only (``SWITCH_HIDDEN``), and
its high-throughput combine bf16 only, so these runs use bf16 weights and activations and ``HIDDEN = 2048``.
The dense reference (``moe_harness.dense_reference``) computes each layer in fp32 and rounds once, to bf16,
per layer; the EP path also rounds each expert's output and the combined sum to bf16, so the two agree to
a few bf16 ulps of the layer output, not exactly: :func:`assert_bf16_close` allows 2^-6 of the largest output
element (2 ulps of bf16 at that magnitude).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_harness import StackWeights, current_row_start, fused_layers, halves
from standins import deep_ep as standin_deep_ep
from ubatch import UBatchConfig, UBatchWrapper, set_forward_context
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.experts.base import MoEExperts
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.deepep import DeepEPHighThroughput, DeepEPLowLatency
from ubatch.modular_moe.prepare_finalize.deepep_v2 import DeepEPV2
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.sbo import SBO_OFF, SboFlags
from ubatch.testing.thread_ranks import run_thread_ranks

HIDDEN, EXPERTS, INTER, TOP_K, LAYERS, CAPACITY = 2048, 8, 128, 2, 2, 16
BF16_REL = 2.0**-6  # 2 ulps of bf16 (8 significant bits: ulp = 2^-7 of the leading power of two)


def bf16_weights(seed: int = 0, layers: int = LAYERS) -> StackWeights:
    """Random weights scaled by 1/sqrt(fan-in), so activations stay O(1) through the layers, in bf16."""
    g = torch.Generator().manual_seed(seed)
    gates = [torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(layers)]
    w13 = [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).bfloat16() for _ in range(layers)]
    w2 = [(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).bfloat16() for _ in range(layers)]
    return StackWeights(gates, w13, w2, TOP_K)


def bf16_inputs(world: int, seed: int = 1, base_tokens: int = 6) -> list[torch.Tensor]:
    """Uneven token counts per rank (``base_tokens + rank``), so ranks and ubatches differ."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(base_tokens + r, HIDDEN, generator=g).bfloat16() for r in range(world)]


class LinearShared(torch.nn.Module):
    """A shared expert as a plain bf16 linear map (SBO moves it around the all-to-all)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter((torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5).bfloat16(),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class StandinStack(torch.nn.Module):
    """``x = x + moe_i(x)`` with the DeepEP adapters built over the stand-in module (``MoERuntime``'s
    ``deep_ep_module``); ``experts`` optionally replaces each layer's experts backend (DeepGEMM stand-in)."""

    def __init__(self, weights: StackWeights, parallel: MoEParallelConfig, shared: bool = False,
                 experts: Callable[[], MoEExperts] | None = None) -> None:
        super().__init__()
        self.weights, self.rank = weights, parallel.ep_rank
        self.runtime = MoERuntime(parallel, deep_ep_module=standin_deep_ep)
        self.layers = torch.nn.ModuleList()
        for i, (w13, w2) in enumerate(zip(weights.w13, weights.w2, strict=True)):
            layer = FusedMoE(EXPERTS, weights.top_k, HIDDEN, INTER, runtime=self.runtime, params_dtype=torch.bfloat16,
                             shared_experts=LinearShared(100 + i) if shared else None)
            layer.load_fused_experts(w13, w2)
            if experts is not None:
                layer.kernel.experts = experts()
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = current_row_start()
        for i, layer in enumerate(self.layers):
            x = x + layer(x, self.weights.router_logits(i, x, self.rank, start))
        return x

    @property
    def moe_layers(self) -> list[FusedMoE]:
        """``layers`` as their type (a ``ModuleList`` indexes as ``Module``)."""
        return fused_layers(self.layers)

    def deepep(self) -> DeepEPLowLatency | DeepEPHighThroughput | DeepEPV2:
        """The DeepEP adapter the layers share (one backend instance per shape)."""
        pf = self.moe_layers[0].kernel.prepare_finalize
        assert isinstance(pf, (DeepEPLowLatency, DeepEPHighThroughput, DeepEPV2)), f"not DeepEP: {type(pf).__name__}"
        return pf

    def deepep_v2(self) -> DeepEPV2:
        """The DeepEP V2 adapter the layers share (``all2all_backend="deepep_v2"``)."""
        pf = self.deepep()
        assert isinstance(pf, DeepEPV2), f"not DeepEP V2: {type(pf).__name__}"
        return pf

    def buffer(self) -> Any:
        """The stand-in ``deep_ep.Buffer`` the layers share (one backend instance per shape)."""
        return self.deepep().buffer


def run_standin_ep(weights: StackWeights, inputs: Sequence[torch.Tensor], backend: str, dbo: bool,
                   sbo: SboFlags = SBO_OFF, shared: bool = False, experts: Callable[[], MoEExperts] | None = None,
                   num_ubatches: int = 2, prepare: Callable[[StandinStack], None] | None = None
                   ) -> list[dict[str, Any]]:
    """Every rank runs the stack on its own tokens; per rank: ``out``, ``yields`` (``[]`` without DBO),
    ``per_layer`` (the backend's claimed yields), ``calls`` (DeepEP calls the stand-in served) and
    ``buffer_type``. ``prepare`` may alter the built stack (a test injecting a fault)."""
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=CAPACITY, sbo=sbo)
        model = StandinStack(weights, parallel, shared, experts)
        if prepare is not None:
            prepare(model)
        x = inputs[rank]
        res: dict[str, Any] = {"per_layer": model.moe_layers[0].kernel.prepare_finalize.dbo_yields_per_layer}
        if not dbo:
            with set_forward_context():
                res.update(out=model(x), yields=[])
        else:
            wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=num_ubatches, handoff_timeout_s=60))
            try:
                with set_forward_context(ubatch_slices=_slices(x.shape[0], num_ubatches)):
                    res["out"] = wrapper(x)
                res["yields"] = wrapper.last_yield_counts
            finally:
                wrapper.close()
        res.update(calls=model.buffer()._calls, buffer_type=type(model.buffer()))
        return res

    return run_thread_ranks(world, rank_main, num_groups=max(2, num_ubatches), timeout_s=120)


def _slices(num_tokens: int, n: int) -> list[Any]:
    if n == 2:
        return halves(num_tokens)
    from ubatch import UBatchSlice

    bounds = [num_tokens * i // n for i in range(n + 1)]
    return [UBatchSlice(slice(a, b), slice(a, b)) for a, b in itertools.pairwise(bounds)]


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= BF16_REL * scale, f"{what}: max |EP - dense| {err:.4g} > 2^-6 x max |dense| {scale:.4g}"
