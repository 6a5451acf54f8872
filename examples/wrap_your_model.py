"""Make your own PyTorch MoE model DBO-capable: swap its MoE for FusedMoE and wrap it in UBatchWrapper.

The model is yours: a few blocks of ``x + FusedMoE(mixer(x))``. Its mixer is per-token (attention-free) on
purpose: a layer that mixes tokens needs per-ubatch metadata, as the runner's attention gets. Two expert-
parallel ranks run as threads (``run_thread_ranks``) over the ``torch_ll`` all-to-all; each rank computes its
tokens without and with DBO and checks that the outputs match. Run: ``python examples/wrap_your_model.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from ubatch import UBatchWrapper, maybe_create_ubatch_slices, set_forward_context
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.testing.thread_ranks import run_thread_ranks

HIDDEN, EXPERTS, TOP_K, INTER, LAYERS, WORLD = 32, 8, 2, 64, 3, 2
TOKENS_PER_RANK = [10, 14]  # DP ranks need not hold equal batches


def make_weights(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Built once and shared: every rank must see the same weights (thread ranks share the global RNG)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return [{"mixer": r(HIDDEN, HIDDEN), "router": r(EXPERTS, HIDDEN), "gate": r(EXPERTS, INTER, HIDDEN),
             "up": r(EXPERTS, INTER, HIDDEN), "down": r(EXPERTS, HIDDEN, INTER)} for _ in range(LAYERS)]


class MyMoEBlock(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], runtime: MoERuntime) -> None:
        super().__init__()
        self.mixer, self.router = w["mixer"], w["router"]
        self.moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, runtime=runtime)  # keeps only this rank's experts
        for e in range(EXPERTS):
            for shard in ("gate", "up", "down"):
                self.moe.load_expert_weight(e, shard, w[shard][e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.mixer.t())
        return x + self.moe(h, h @ self.router.t())  # dispatch/combine inside yield to the other ubatch


class MyMoEModel(nn.Module):
    def __init__(self, weights: list[dict[str, torch.Tensor]], parallel: MoEParallelConfig) -> None:
        super().__init__()
        runtime = MoERuntime(parallel)  # the blocks share one all-to-all backend
        self.blocks = nn.ModuleList(MyMoEBlock(w, runtime) for w in weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def rank_main(rank: int, groups: list, weights: list[dict[str, torch.Tensor]]) -> dict:
    parallel = MoEParallelConfig(ep_rank=rank, ep_size=WORLD, all2all_backend="torch_ll", ep_groups=groups,
                                 max_dispatch_tokens_per_rank=64)  # one group per ubatch: see distributed.py
    model = MyMoEModel(weights, parallel)
    n = TOKENS_PER_RANK[rank]
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        reference = model(x)  # no DBO: one batch, the all-to-alls run inline
        wrapper = UBatchWrapper(model)
        # One "request" per token here; the runner passes real per-request token counts.
        slices, _ = maybe_create_ubatch_slices(True, [1] * n, n, n)
        with set_forward_context(ubatch_slices=slices):
            out = wrapper(x)  # two ubatches ping-pong on two threads
        wrapper.close()
    return {"max_diff": (out - reference).abs().max().item(), "yields": wrapper.last_yield_counts}


if __name__ == "__main__":
    weights = make_weights()
    results = run_thread_ranks(WORLD, lambda rank, groups: rank_main(rank, groups, weights), num_groups=2)
    for rank, res in enumerate(results):
        print(f"rank {rank}: {TOKENS_PER_RANK[rank]} tokens, DBO vs no-DBO max |diff| = {res['max_diff']:.2e}, "
              f"yields per ubatch = {res['yields']}")
    ok = all(res["max_diff"] <= 1e-5 for res in results)
    print("outputs match" if ok else "OUTPUTS DIFFER")
    raise SystemExit(0 if ok else 1)
