"""A small MoE layer stack run over thread ranks, with a dense single-rank reference to compare against."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, set_forward_context
from ubatch.distributed import run_thread_ranks
from ubatch.forward_context import DPMetadata
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.router import select_experts


@dataclass
class StackWeights:
    gates: list[torch.Tensor]  # [E, H] per layer
    w13: list[torch.Tensor]  # [E, 2I, H]
    w2: list[torch.Tensor]  # [E, H, I]
    top_k: int

    @classmethod
    def random(cls, layers: int = 2, experts: int = 8, hidden: int = 16, inter: int = 24, top_k: int = 2,
               seed: int = 0, skew_to_expert0: bool = False) -> "StackWeights":
        g = torch.Generator().manual_seed(seed)
        gates = [torch.randn(experts, hidden, generator=g) for _ in range(layers)]
        if skew_to_expert0:  # route everything to the first experts: other ranks receive nothing
            for gate in gates:
                gate[: top_k] += 100.0 * torch.sign(torch.randn(1, hidden, generator=g)).abs()
        w13 = [torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2 for _ in range(layers)]
        w2 = [torch.randn(experts, hidden, inter, generator=g) * 0.2 for _ in range(layers)]
        return cls(gates, w13, w2, top_k)


def dense_reference(weights: StackWeights, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: no permutation tricks to share bugs with."""
    for gate, w13, w2 in zip(weights.gates, weights.w13, weights.w2):
        logits = x.float() @ gate.t().float()
        topk_w, topk_ids = select_experts(logits, weights.top_k, True)
        out = torch.zeros_like(x, dtype=torch.float32)
        inter = w2.shape[-1]
        for t in range(x.shape[0]):
            for k in range(weights.top_k):
                e = int(topk_ids[t, k])
                gu = w13[e].float() @ x[t].float()
                h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                out[t] += topk_w[t, k] * (w2[e].float() @ h)
        x = x + out.to(x.dtype)
    return x


class MoEStack(torch.nn.Module):
    def __init__(self, weights: StackWeights, parallel: MoEParallelConfig) -> None:
        super().__init__()
        experts, _, hidden = weights.w13[0].shape
        inter = weights.w2[0].shape[-1]
        self.gates = weights.gates
        self.layers = torch.nn.ModuleList()
        self.runtime = MoERuntime(parallel)  # the layers share one backend and one link, as in a model
        for w13, w2 in zip(weights.w13, weights.w2):
            layer = FusedMoE(experts, weights.top_k, hidden, inter, runtime=self.runtime)
            layer.load_fused_experts(w13, w2)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for gate, layer in zip(self.gates, self.layers):
            x = x + layer(x, x.float() @ gate.t().float())
        return x


def halves(num_tokens: int) -> list[UBatchSlice]:
    mid = num_tokens // 2
    return [UBatchSlice(slice(0, mid), slice(0, mid)), UBatchSlice(slice(mid, num_tokens), slice(mid, num_tokens))]


def run_ep(weights: StackWeights, inputs: list[torch.Tensor], backend: str, experts: str = "torch",
           dbo: bool = False, capacity: int = 64, emulate_link: str | None = None,
           dp_bound: int | None = None) -> list[dict[str, Any]]:
    """Every rank runs the stack on its own tokens; returns per-rank output and yield counts."""
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, experts_backend=experts,
                                     ep_groups=groups, max_dispatch_tokens_per_rank=capacity,
                                     emulate_link=emulate_link)
        model = MoEStack(weights, parallel)
        x = inputs[rank]
        dp = None if dp_bound is None else DPMetadata((dp_bound,))
        if not dbo:
            with set_forward_context(dp_metadata=dp):
                return {"out": model(x), "yields": []}
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60))
        try:
            with set_forward_context(ubatch_slices=halves(x.shape[0]), dp_metadata=dp):
                out = wrapper(x)
            return {"out": out, "yields": wrapper.last_yield_counts,
                    "per_layer": model.layers[0].kernel.prepare_finalize.dbo_yields_per_layer}
        finally:
            wrapper.close()

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=60)


def process_rank_main(weights: StackWeights, inputs: list[torch.Tensor], backend: str, dbo: bool) -> torch.Tensor:
    """Body of one real rank process (under ``runner.launch.launch``): EP groups from the default world."""
    import torch.distributed as dist

    from ubatch.distributed import new_ep_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, ep_groups=new_ep_groups(2),
                                 max_dispatch_tokens_per_rank=64)
    model = MoEStack(weights, parallel)
    x = inputs[rank]
    if not dbo:
        return model(x)
    wrapper = UBatchWrapper(model)
    try:
        with set_forward_context(ubatch_slices=halves(x.shape[0])):
            return wrapper(x)
    finally:
        wrapper.close()
