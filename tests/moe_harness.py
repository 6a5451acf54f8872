"""A small MoE layer stack run over thread ranks, with a dense single-rank reference to compare against.

Routing is normally the gate's (``x @ gate``). A test that needs a precise traffic pattern -- a rank that
receives nothing in one ubatch -- gives ``StackWeights.routes``: explicit top-k expert ids per layer, rank and
token row. The stack and the dense reference then both route by them (the gate only weighs the chosen
experts), and :func:`count_receives` records what each layer's experts were handed, so the test can assert
the traffic it forced really happened.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch import UBatchConfig, UBatchSlice, UBatchWrapper, set_forward_context
from ubatch.context import dbo_current_ubatch_id
from ubatch.forward_context import DPMetadata, maybe_get_forward_context
from ubatch.modular_moe.config import MoEParallelConfig
from ubatch.modular_moe.layer import FusedMoE
from ubatch.modular_moe.prepare_finalize.emulated_link import EmulatedLink
from ubatch.modular_moe.router import select_experts
from ubatch.modular_moe.runtime import MoERuntime
from ubatch.modular_moe.types import ExpertTokens
from ubatch.testing.thread_ranks import run_thread_ranks

Routes = list[list[torch.Tensor]]  # [layer][rank] -> [tokens of that rank, top_k] global expert ids
# Logit given to every expert a forced route does not choose: softmax sends it exactly 0 in fp32, so top-k
# picks the chosen ids and the renormalised weights are the softmax over the chosen logits alone.
NOT_CHOSEN = -1e4


@dataclass
class StackWeights:
    gates: list[torch.Tensor]  # [E, H] per layer
    w13: list[torch.Tensor]  # [E, 2I, H]
    w2: list[torch.Tensor]  # [E, H, I]
    top_k: int
    routes: Routes | None = None  # forced routing (see the module docstring); None: the gate decides

    @classmethod
    def random(cls, layers: int = 2, experts: int = 8, hidden: int = 16, inter: int = 24, top_k: int = 2,
               seed: int = 0, routes: Routes | None = None) -> StackWeights:
        g = torch.Generator().manual_seed(seed)
        gates = [torch.randn(experts, hidden, generator=g) for _ in range(layers)]
        w13 = [torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2 for _ in range(layers)]
        w2 = [torch.randn(experts, hidden, inter, generator=g) * 0.2 for _ in range(layers)]
        weights = cls(gates, w13, w2, top_k, routes)
        weights.check_routes()
        return weights

    def check_routes(self) -> None:
        """A forced route names ``top_k`` distinct existing experts per row, for every layer."""
        if self.routes is None:
            return
        assert len(self.routes) == len(self.gates), "one routing table per layer"
        experts = self.gates[0].shape[0]
        for per_rank in self.routes:
            for ids in per_rank:
                assert ids.dim() == 2 and ids.shape[1] == self.top_k, f"routes need [T, {self.top_k}], got {ids.shape}"
                assert bool(((ids >= 0) & (ids < experts)).all()), "a forced route names a missing expert"
                assert all(len(set(row)) == self.top_k for row in ids.tolist()), "forced ids repeat in a row"

    def layer(self, i: int) -> StackWeights:
        """Layer ``i`` alone, its forced routes included."""
        routes = None if self.routes is None else self.routes[i:i + 1]
        return StackWeights(self.gates[i:i + 1], self.w13[i:i + 1], self.w2[i:i + 1], self.top_k, routes)

    def router_logits(self, layer: int, x: torch.Tensor, rank: int = 0, row_start: int = 0) -> torch.Tensor:
        """The gate's logits for rows ``row_start ..`` of ``rank``'s tokens, restricted to the forced route."""
        logits = x.float() @ self.gates[layer].to(x.device).t().float()
        if self.routes is None:
            return logits
        ids = self.routes[layer][rank][row_start:row_start + x.shape[0]].to(x.device)
        assert ids.shape[0] == x.shape[0], f"rank {rank} has {x.shape[0]} rows at {row_start}, routes {ids.shape[0]}"
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
        return logits.masked_fill(~chosen, NOT_CHOSEN)


def current_row_start() -> int:
    """First row of the running (micro)batch within its rank's tokens: the ubatch's token slice start."""
    fc = maybe_get_forward_context()
    return fc.ubatch_slice.token_slice.start if fc is not None and fc.ubatch_slice is not None else 0


def dense_reference(weights: StackWeights, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """Token by token, expert by expert: no permutation tricks to share bugs with. ``rank`` picks the
    forced routes of that rank's tokens (when the weights force routing)."""
    for i, (w13, w2) in enumerate(zip(weights.w13, weights.w2, strict=True)):
        logits = weights.router_logits(i, x, rank)
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
    """``x = x + moe_i(x)`` per layer, this rank's share of the experts; ``shared_experts`` (one module per
    layer, optional) are added inside each MoE layer, as DeepSeek's shared experts are."""

    def __init__(self, weights: StackWeights, parallel: MoEParallelConfig,
                 shared_experts: Sequence[torch.nn.Module] | None = None) -> None:
        super().__init__()
        experts, _, hidden = weights.w13[0].shape
        inter = weights.w2[0].shape[-1]
        self.weights = weights
        self.rank = parallel.ep_rank
        self.layers = torch.nn.ModuleList()
        self.runtime = MoERuntime(parallel)  # the layers share one backend and one link, as in a model
        shared = list(shared_experts) if shared_experts is not None else [None] * len(weights.w13)
        for w13, w2, shared_i in zip(weights.w13, weights.w2, shared, strict=True):
            layer = FusedMoE(experts, weights.top_k, hidden, inter, runtime=self.runtime, shared_experts=shared_i)
            layer.load_fused_experts(w13, w2)
            self.layers.append(layer)

    @property
    def moe_layers(self) -> list[FusedMoE]:
        """``layers`` as their type (a ``ModuleList`` indexes as ``Module``)."""
        return fused_layers(self.layers)

    @property
    def gates(self) -> list[torch.Tensor]:
        """The per-layer router gates ``[E, H]``."""
        return self.weights.gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = current_row_start()
        for i, layer in enumerate(self.layers):
            x = x + layer(x, self.weights.router_logits(i, x, self.rank, start))
        return x


def received_routes(tokens: ExpertTokens) -> int:
    """(token, expert) pairs an experts call was handed: its rank's share of the routed copies."""
    if tokens.layout == "masked":
        assert tokens.expert_num_tokens is not None
        return int(tokens.expert_num_tokens.sum())
    assert tokens.topk_ids is not None
    return int((tokens.topk_ids >= 0).sum())


def shadow_method(obj: object, name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``obj``'s method ``name`` on this instance only: a test's probe or injected fault
    (``del obj.<name>`` restores the class's)."""
    if not callable(getattr(obj, name, None)):
        raise AttributeError(f"{type(obj).__name__} has no method {name!r} to replace")
    setattr(obj, name, replacement)


def fused_layers(layers: torch.nn.ModuleList) -> list[FusedMoE]:
    """The modules of ``layers``, each checked to be a :class:`FusedMoE`."""
    out = []
    for layer in layers:
        assert isinstance(layer, FusedMoE), f"a {type(layer).__name__} among the MoE layers"
        out.append(layer)
    return out


def count_receives(layers: Sequence[FusedMoE]) -> dict[tuple[int, int], int]:
    """Wrap each layer's experts so every call records ``(layer, ubatch) -> received routes``.

    The kernel calls its experts once per layer and ubatch even when nothing arrived, so a rank that
    receives nothing shows up as an explicit 0 -- the zero-receive path -- rather than as a missing key.
    """
    log: dict[tuple[int, int], int] = {}
    for i, layer in enumerate(layers):
        experts = layer.kernel.experts
        apply = experts.apply

        def counting(tokens: ExpertTokens, w13: torch.Tensor, w2: torch.Tensor, extras: Any = None, *, i: int = i,
                     apply: Any = apply) -> torch.Tensor:
            key = (i, dbo_current_ubatch_id())
            assert key not in log, f"layer {i} ran its experts twice for ubatch {key[1]}"
            log[key] = received_routes(tokens)
            return apply(tokens, w13, w2, extras)

        shadow_method(experts, "apply", counting)
    return log


def expected_receives(routes: Routes, sizes: Sequence[int], num_experts: int,
                      dbo: bool) -> list[dict[tuple[int, int], int]]:
    """Per rank, ``(layer, ubatch) -> routes it must receive`` under ``routes``, worked out from the table
    alone: ubatch ``u`` of every rank is its ``halves`` slice (the whole batch without DBO), and expert ``e``
    lives on rank ``e // (num_experts / world)``."""
    world = len(sizes)
    per_rank = num_experts // world
    out: list[dict[tuple[int, int], int]] = [{} for _ in range(world)]
    for layer, table in enumerate(routes):
        for u in range(2 if dbo else 1):
            for dest in range(world):
                total = 0
                for src, n in enumerate(sizes):
                    rows = halves(n)[u].token_slice if dbo else slice(0, n)
                    total += int((table[src][rows] // per_rank == dest).sum())
                out[dest][(layer, u)] = total
    return out


def link_stats(link: EmulatedLink | None) -> tuple[int, int] | None:
    """``(transfers, bytes)`` the emulated link modelled, or ``None`` without a link."""
    return None if link is None else (link.num_transfers, link.total_bytes)


def link_bytes(num_rows: int, top_k: int, hidden: int, layers: int, element_size: int = 4) -> int:
    """What the link must have charged for ``num_rows`` real rows over ``layers`` MoE layers: every routed
    copy of a row, once per direction (dispatch and combine), as ``routed_bytes`` documents."""
    return 2 * layers * num_rows * top_k * hidden * element_size


def halves(num_tokens: int) -> list[UBatchSlice]:
    mid = num_tokens // 2
    return [UBatchSlice(slice(0, mid), slice(0, mid)), UBatchSlice(slice(mid, num_tokens), slice(mid, num_tokens))]


def run_ep(weights: StackWeights, inputs: list[torch.Tensor], backend: str, experts: str = "torch",
           dbo: bool = False, capacity: int = 64, emulate_link: str | None = None,
           dp_bound: int | None = None) -> list[dict[str, Any]]:
    """Every rank runs the stack on its own tokens; returns per rank what a test needs to show the features
    it compares were active: ``out``, ``dbo``, ``yields`` (per ubatch; ``[]`` without DBO) and the backend's
    claimed ``per_layer`` yields, ``received`` (:func:`count_receives`) and ``link`` (:func:`link_stats`)."""
    world = len(inputs)

    def rank_main(rank: int, groups: list[Any]) -> dict[str, Any]:
        parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, experts_backend=experts,
                                     ep_groups=groups, max_dispatch_tokens_per_rank=capacity,
                                     emulate_link=emulate_link)
        model = MoEStack(weights, parallel)
        received = count_receives(model.moe_layers)
        x = inputs[rank]
        dp = None if dp_bound is None else DPMetadata((dp_bound,), step_token_bound=dp_bound)
        res: dict[str, Any] = {"dbo": dbo, "received": received,
                               "per_layer": model.moe_layers[0].kernel.prepare_finalize.dbo_yields_per_layer}
        if not dbo:
            with set_forward_context(dp_metadata=dp):
                res.update(out=model(x), yields=[])
            res["link"] = link_stats(model.runtime.link())
            return res
        wrapper = UBatchWrapper(model, UBatchConfig(num_ubatches=2, handoff_timeout_s=60))
        try:
            with set_forward_context(ubatch_slices=halves(x.shape[0]), dp_metadata=dp):
                res["out"] = wrapper(x)
            res.update(yields=wrapper.last_yield_counts, link=link_stats(model.runtime.link()))
            return res
        finally:
            wrapper.close()

    return run_thread_ranks(world, rank_main, num_groups=2, timeout_s=60)


def process_rank_main(weights: StackWeights, inputs: list[torch.Tensor], backend: str, dbo: bool) -> dict[str, Any]:
    """Body of one real rank process (under ``runner.distributed.launch.launch``): EP groups from the default world.
    Returns ``out``, ``dbo`` and the DBO ``yields`` per ubatch (``[]`` without DBO), as :func:`run_ep`."""
    import torch.distributed as dist

    from ubatch.distributed import new_ep_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    parallel = MoEParallelConfig(ep_rank=rank, ep_size=world, all2all_backend=backend, ep_groups=new_ep_groups(2),
                                 max_dispatch_tokens_per_rank=64)
    model = MoEStack(weights, parallel)
    x = inputs[rank]
    if not dbo:
        return {"out": model(x), "dbo": False, "yields": []}
    wrapper = UBatchWrapper(model)
    try:
        with set_forward_context(ubatch_slices=halves(x.shape[0])):
            out = wrapper(x)
        return {"out": out, "dbo": True, "yields": wrapper.last_yield_counts}
    finally:
        wrapper.close()
